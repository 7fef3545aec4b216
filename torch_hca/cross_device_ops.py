"""TF-style face for users coming from tf.distribute: the seeds' classes over the default group.

Values are tensors of this rank (one "device" per rank); `reduce` returns the reduced value,
`batch_reduce` a list, both without changing the inputs; `broadcast` returns a copy of src's tensor.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import batch_allreduce
from .options import Options

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG}


def _reduce_op(reduce_op):
    if isinstance(reduce_op, str):
        try:
            return _OPS[reduce_op.lower()]
        except KeyError:
            raise ValueError(f"reduce_op: expected 'sum' or 'mean' (or a dist.ReduceOp), got {reduce_op!r}") from None
    return reduce_op


class CrossDeviceOps:
    """Runs the seeds' reductions with a process group of `hca` built for these options."""

    def __init__(self, options: Options, group=None):
        self.options = options
        self._group = group

    def _process_group(self):
        if self._group is None:
            if not dist.is_initialized():
                raise RuntimeError("torch_hca: call torch.distributed.init_process_group first")
            # A group over every rank with this object's options (the default group may use others).
            self._group = dist.new_group(backend="hca", pg_options=self.options)
        return self._group

    def reduce(self, reduce_op, value: torch.Tensor, destinations=None) -> torch.Tensor:
        """The reduction of every rank's `value` (sum, or mean divided once after the sum)."""
        return self.batch_reduce(reduce_op, [value], destinations)[0]

    def batch_reduce(self, reduce_op, values: Sequence[torch.Tensor], destinations=None) -> List[torch.Tensor]:
        if not values:
            raise ValueError("batch_reduce: `values` is empty")
        results = [v.detach().clone() for v in values]
        batch_allreduce(results, op=_reduce_op(reduce_op), group=self._process_group())
        return results

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        result = tensor.detach().clone()
        dist.broadcast(result, src=src, group=self._process_group())
        return result


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """tf.distribute.HierarchicalCopyAllReduce(num_packs=1)."""

    def __init__(self, num_packs: int = 1, groups: Optional[Sequence[Sequence[int]]] = None):
        if num_packs < 0:
            raise ValueError(f"HierarchicalCopy requires num_packs >= 0, but {num_packs} is specified")
        super().__init__(Options("hierarchical_copy", num_packs=num_packs, groups=groups))


class ReductionToOneDevice(CrossDeviceOps):
    """tf.distribute.ReductionToOneDevice(reduce_to_device=None): rank `reduce_to_device` reduces."""

    def __init__(self, reduce_to_device: Optional[int] = None):
        super().__init__(Options("reduce_to_one_device", reduce_to_device=reduce_to_device))


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """tf.distribute's AllReduceCrossDeviceOps(all_reduce_alg='nccl', num_packs=1,
    agg_small_grads_max_bytes=0, agg_small_grads_max_group=10): "nccl" packs, then hands the
    packs to stock NCCL (CUDA tensors) or gloo (CPU tensors)."""

    def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1, agg_small_grads_max_bytes: int = 0,
                 agg_small_grads_max_group: int = 10):
        if all_reduce_alg not in ("nccl", "hierarchical_copy"):
            raise ValueError(f"all_reduce_alg: expected 'nccl' or 'hierarchical_copy', got {all_reduce_alg!r}")
        super().__init__(Options(all_reduce_alg, num_packs=num_packs,
                                 agg_small_grads_max_bytes=agg_small_grads_max_bytes,
                                 agg_small_grads_max_group=agg_small_grads_max_group))
