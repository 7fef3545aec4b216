"""Registers the c10d backend "hca" for CPU and CUDA devices."""
import torch.distributed as dist

from . import _C
from .options import Options, shm_chunk_bytes

BACKEND_NAME = "hca"


def create_backend(dist_backend_opts, backend_options):
    """torch's creator hook (extended API): one ProcessGroupHCA per process group."""
    options = Options.from_env() if backend_options is None else backend_options
    if not isinstance(options, Options):
        raise TypeError(f"hca: pg_options must be torch_hca.Options, got {type(options).__name__}")
    return _C.ProcessGroupHCA(
        store=dist_backend_opts.store,
        rank=dist_backend_opts.group_rank,
        size=dist_backend_opts.group_size,
        timeout_ms=int(dist_backend_opts.timeout.total_seconds() * 1000),
        algorithm=options.algorithm,
        num_packs=options.num_packs,
        reduce_to_device=-1 if options.reduce_to_device is None else options.reduce_to_device,
        groups=[list(g) for g in options.groups or ()],
        agg_small_grads_max_bytes=options.agg_small_grads_max_bytes,
        agg_small_grads_max_group=options.agg_small_grads_max_group,
        chunk_bytes=shm_chunk_bytes(),
    )


def register():
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
