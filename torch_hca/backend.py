"""Registers the c10d backend "hca" for CPU and CUDA devices."""
import os
import socket

import torch
import torch.distributed as dist

from . import _C
from .options import Options, cuda_chunk_bytes, cuda_slots, shm_chunk_bytes, shm_slots

BACKEND_NAME = "hca"


def create_backend(dist_backend_opts, backend_options):
    """torch's creator hook (extended API): one backend per process group. `nccl` is a wrapper
    around stock engines (which span nodes themselves); the other algorithms run hca's own
    executors inside each node and, when the ranks span nodes, engines between them."""
    options = Options.from_env() if backend_options is None else backend_options
    if not isinstance(options, Options):
        raise TypeError(f"hca: pg_options must be torch_hca.Options, got {type(options).__name__}")
    store, rank, size = dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout_ms = int(dist_backend_opts.timeout.total_seconds() * 1000)
    if options.algorithm == "nccl":
        cpu_engine, cuda_engine = _engines(dist_backend_opts)
        return _C.PassthroughBackend(rank=rank, size=size, timeout_ms=timeout_ms, packing=options.packing_options(),
                                     cpu_engine=cpu_engine, cuda_engine=cuda_engine)
    identities = _C.exchange_node_identities(store, rank, size, node_identity(), timeout_ms)
    if len(set(identities)) == 1:
        return _node_group(store, rank, size, timeout_ms, options.plan_options())
    try:
        return _across_nodes(dist_backend_opts, options, identities, timeout_ms)
    except Exception as e:
        _C.publish_setup_failure(store, rank, f"{type(e).__name__}: {e}")
        raise


def node_identity() -> str:
    """What names this rank's node: TORCH_HCA_NODE_ID where set (for setups where hostnames
    mislead), else the hostname. Ranks with equal identities share memory and devices."""
    return os.environ.get("TORCH_HCA_NODE_ID", "").strip() or socket.gethostname()


def _node_group(store, rank, size, timeout_ms, plan_options):
    """hca's own group over the ranks of one node."""
    return _C.ProcessGroupHCA(store=store, rank=rank, size=size, timeout_ms=timeout_ms, options=plan_options,
                              shm_slot_bytes=shm_chunk_bytes(), shm_slots=shm_slots(),
                              cuda_slot_bytes=cuda_chunk_bytes(), cuda_slots=cuda_slots())


def _across_nodes(dist_backend_opts, options, identities, timeout_ms):
    """hca inside this rank's node, gloo among the node leaders of each leader position (one
    group per position: every local rank of the largest node leads one), gloo over every rank
    for the operations that have no hierarchical form."""
    if options.inter_node_backend == "nccl":
        raise ValueError("inter_node_backend: 'nccl' carries CUDA tensors between nodes, and hca does not run "
                         "CUDA tensors across nodes yet; use 'gloo' (CPU tensors), or algorithm='nccl'")
    store, rank, size = dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size
    members, leaders = _C.nodes(identities)
    node = next(n for n, ranks in enumerate(members) if rank in ranks)
    plan_options = options.plan_options()
    plan_options.validate_across_nodes(identities)
    inside = Options(options.algorithm, num_packs=1)  # one call per pack: the node's group need not split it again
    local = _node_group(dist.PrefixStore(f"hca_node{node}/", store), members[node].index(rank), len(members[node]),
                        timeout_ms, inside.plan_options())
    leader_cpu = {}
    for position, ranks in enumerate(leaders):
        if rank in ranks:
            leader_cpu[position] = dist.ProcessGroupGloo(dist.PrefixStore(f"hca_leaders{position}/", store),
                                                         ranks.index(rank), len(ranks), dist_backend_opts.timeout)
    world_cpu, world_cuda = _engines(dist_backend_opts)
    return _C.NodeBackend(rank=rank, size=size, timeout_ms=timeout_ms, options=plan_options,
                          node_identities=identities, local=local, leader_cpu=leader_cpu, leader_cuda={},
                          world_cpu=world_cpu, world_cuda=world_cuda)


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
