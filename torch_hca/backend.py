"""Registers the c10d backend "hca" for CPU and CUDA devices."""
import torch
import torch.distributed as dist

from . import _C
from .options import Options, shm_chunk_bytes

BACKEND_NAME = "hca"


def create_backend(dist_backend_opts, backend_options):
    """torch's creator hook (extended API): one ProcessGroupHCA per process group."""
    options = Options.from_env() if backend_options is None else backend_options
    if not isinstance(options, Options):
        raise TypeError(f"hca: pg_options must be torch_hca.Options, got {type(options).__name__}")
    cpu_engine, cuda_engine = _engines(dist_backend_opts) if options.algorithm == "nccl" else (None, None)
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
        cpu_engine=cpu_engine,
        cuda_engine=cuda_engine,
    )


def _engines(dist_backend_opts):
    """The stock engines of the nccl algorithm, on the same store, rank, world and timeout:
    gloo for CPU tensors, ProcessGroupNCCL for CUDA tensors where torch has it and a GPU is present."""
    store = dist.PrefixStore("engine/", dist_backend_opts.store)
    rank, size, timeout = dist_backend_opts.group_rank, dist_backend_opts.group_size, dist_backend_opts.timeout
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    cuda = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        cuda = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)
    return cpu, cuda


def register():
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
