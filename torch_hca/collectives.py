"""Collectives beyond torch.distributed's own calls."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def batch_allreduce(tensors: Sequence[torch.Tensor], op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduces `tensors` in place as one batch, packed by the group's hca options
    (tensors of several dtypes may be mixed: packs never mix them). Returns a Work if async_op."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("batch_allreduce: `tensors` is empty")
    group = group or c10d._get_default_group()
    backend = group._get_backend(tensors[0].device)
    if backend.name() != "hca":
        raise ValueError(f"batch_allreduce: the group's backend for {tensors[0].device} is {backend.name()}, not hca")
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    work = backend.allreduce_coalesced(tensors, opts)
    if async_op:
        return work
    work.wait()
    return None


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """torch.distributed.monitored_barrier for an hca group (torch's own function accepts only
    gloo groups, though the backend call is generic). Rank 0 waits for every rank and raises
    naming the first rank (every rank, with `wait_all_ranks`) that did not arrive in time."""
    group = group or c10d._get_default_group()
    group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)  # None: the group's timeout
