"""Registers the c10d backend "hca" for CPU and CUDA devices."""
import torch
import torch.distributed as dist

from . import _C
from .options import Options, cuda_chunk_bytes, cuda_slots, shm_chunk_bytes, shm_slots

BACKEND_NAME = "hca"


def create_backend(dist_backend_opts, backend_options):
    """torch's creator hook (extended API): one backend per process group. `nccl` is a wrapper
    around stock engines; the other algorithms run hca's own executors."""
    options = Options.from_env() if backend_options is None else backend_options
    if not isinstance(options, Options):
        raise TypeError(f"hca: pg_options must be torch_hca.Options, got {type(options).__name__}")
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout_ms = int(dist_backend_opts.timeout.total_seconds() * 1000)
    if options.algorithm == "nccl":
        cpu_engine, cuda_engine = _engines(dist_backend_opts)
        return _C.PassthroughBackend(rank=rank, size=size, timeout_ms=timeout_ms, packing=options.packing_options(),
                                     cpu_engine=cpu_engine, cuda_engine=cuda_engine)
    return _C.ProcessGroupHCA(store=dist_backend_opts.store, rank=rank, size=size, timeout_ms=timeout_ms,
                              options=options.plan_options(), shm_slot_bytes=shm_chunk_bytes(),
                              shm_slots=shm_slots(), cuda_slot_bytes=cuda_chunk_bytes(), cuda_slots=cuda_slots())


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
