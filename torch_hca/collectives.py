"""Collectives beyond torch.distributed's own calls."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def batch_allreduce(tensors: Sequence[torch.Tensor], op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduces `tensors` in place as one packed batch (hca packs them by its options)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("batch_allreduce: `tensors` is empty")
    return dist.all_reduce_coalesced(tensors, op=op, group=group, async_op=async_op)
