"""The tf.distribute face: HierarchicalCopyAllReduce, ReductionToOneDevice and AllReduceCrossDeviceOps
with TensorFlow's signatures (`reduce`, `batch_reduce`, `broadcast`, `options`), mapped onto ranks.

A TensorFlow device is a rank here: a value is this rank's tensor, and `destinations` is a rank, a
list of ranks, or None (every rank). The reduced value goes to the destinations only: each of them
gets a new tensor, and a rank outside them gets None, as a device outside a TF value's destinations
holds no copy of it. Inputs are never changed. Every rank of the default group makes every call.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .options import Options


class ReduceOp(enum.Enum):
    """TensorFlow's tf.distribute.ReduceOp: SUM, or MEAN (the sum divided once, after it)."""
    SUM = "SUM"
    MEAN = "MEAN"


_IMPLEMENTATIONS = ("auto", "ring", "nccl")


@dataclass(frozen=True)
class CommunicationOptions:
    """tf.distribute.experimental.CommunicationOptions for one call. `bytes_per_pack` > 0 packs the
    call's tensors into ceil(bytes / bytes_per_pack) packs; `timeout_seconds` bounds the call's
    waits (None: the group's timeout); `implementation` is a hint, as in TensorFlow: "auto" and
    "ring" run the object's own algorithm (hca has no ring), "nccl" the stock engines after hca's
    packing (`algorithm="nccl"`). TensorFlow's own object is accepted wherever this one is."""
    bytes_per_pack: int = 0
    timeout_seconds: Optional[float] = None
    implementation: str = "auto"

    def __post_init__(self):
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative integer, got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive or None, got {self.timeout_seconds!r}")
        if self.implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(_IMPLEMENTATIONS)}, got {self.implementation!r}")


def _communication(options) -> CommunicationOptions:
    """Ours, TensorFlow's (its implementation an enum: CommunicationImplementation.NCCL), or None."""
    if options is None:
        return CommunicationOptions()
    if isinstance(options, CommunicationOptions):
        return options
    implementation = getattr(options, "implementation", "auto")
    implementation = getattr(implementation, "name", implementation)
    return CommunicationOptions(getattr(options, "bytes_per_pack", 0), getattr(options, "timeout_seconds", None),
                                str(implementation).lower())


def _reduce_op(reduce_op) -> ReduceOp:
    """"sum"/"mean", torch_hca.ReduceOp, dist.ReduceOp.SUM/AVG, or TensorFlow's ReduceOp."""
    if isinstance(reduce_op, ReduceOp):
        return reduce_op
    if reduce_op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return ReduceOp.SUM if reduce_op == dist.ReduceOp.SUM else ReduceOp.MEAN
    name = getattr(reduce_op, "value", reduce_op)  # tf.distribute.ReduceOp.SUM.value == "SUM"
    if isinstance(name, str) and name.upper() in ReduceOp.__members__:
        return ReduceOp[name.upper()]
    raise ValueError(f"reduce_op: expected 'sum' or 'mean', torch_hca.ReduceOp or dist.ReduceOp.SUM/AVG, "
                     f"got {reduce_op!r}")


def _ranks(destinations, world: int) -> Tuple[int, ...]:
    """The destination ranks, sorted: None is every rank."""
    if destinations is None:
        return tuple(range(world))
    ranks = [destinations] if isinstance(destinations, int) else list(destinations)
    if not ranks or not all(isinstance(r, int) and 0 <= r < world for r in ranks):
        raise ValueError(f"destinations: expected a rank, a list of ranks in [0, {world}) or None, got {destinations!r}")
    return tuple(sorted(set(ranks)))


def _pairs(value_destination_pairs) -> List[Tuple[torch.Tensor, object]]:
    """TensorFlow's check: a non-empty list or tuple of (value, destinations) pairs."""
    if not isinstance(value_destination_pairs, (list, tuple)) or not value_destination_pairs or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], torch.Tensor)
            for p in value_destination_pairs):
        raise ValueError("value_destination_pairs should be a non-empty list or tuple of (value, destinations) "
                         f"pairs, each value a tensor; got {value_destination_pairs!r}")
    return [tuple(p) for p in value_destination_pairs]


class CrossDeviceOps:
    """TensorFlow's CrossDeviceOps over the default group's ranks, with a process group of `hca`
    (made at the first call, one per set of options a call asks for) running `options`."""

    def __init__(self, options: Options):
        self.options = options
        self._groups: Dict[str, dist.ProcessGroup] = {}  # by the options' repr (groups may be lists)

    def _group(self, options: Options):
        if not dist.is_initialized():
            raise RuntimeError("torch_hca: call torch.distributed.init_process_group first")
        key = repr(options)
        if key not in self._groups:  # every rank asks for the same, in the same order: new_group is collective
            self._groups[key] = dist.new_group(backend="hca", pg_options=options)
        return self._groups[key]

    def options_for(self, values: Sequence[torch.Tensor], options=None) -> Options:
        """The hca options a call of `values` runs with, under TensorFlow's `options`."""
        comm = _communication(options)
        chosen = self.options
        if comm.implementation == "nccl":
            chosen = replace(chosen, algorithm="nccl")
        if comm.bytes_per_pack:
            total = sum(v.numel() * v.element_size() for v in values)
            chosen = replace(chosen, num_packs=max(1, math.ceil(total / comm.bytes_per_pack)))
        return chosen

    def reduce(self, reduce_op, per_replica_value: torch.Tensor, destinations=None, options=None):
        """The reduction of every rank's `per_replica_value`, on the destination ranks (None elsewhere)."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None) -> List[Optional[torch.Tensor]]:
        """Each pair's reduction, in order, on its destinations (None elsewhere); pairs that share
        their destinations go in one packed call. ValueError for an empty batch or a pair that is not one."""
        pairs = _pairs(value_destination_pairs)
        op, world = _reduce_op(reduce_op), dist.get_world_size()
        by_destinations: Dict[Tuple[int, ...], List[int]] = {}
        for i, (_, destinations) in enumerate(pairs):
            by_destinations.setdefault(_ranks(destinations, world), []).append(i)
        results: List[Optional[torch.Tensor]] = [None] * len(pairs)
        for ranks, indices in by_destinations.items():
            reduced = self._reduced([pairs[i][0] for i in indices], op, ranks, _communication(options))
            for i, tensor in zip(indices, reduced):
                results[i] = tensor if dist.get_rank() in ranks else None
        return results

    def _reduced(self, values, op: ReduceOp, ranks, comm: CommunicationOptions) -> List[torch.Tensor]:
        """`values` reduced, right on `ranks` (the others' are scratch)."""
        results = [v.detach().clone() for v in values]
        chosen = self.options_for(results, comm)
        backend = self._group(chosen)._get_backend(results[0].device)
        if len(ranks) == 1:  # one destination: a reduce into it
            opts = dist.ReduceOptions()
            opts.rootRank = ranks[0]
        else:  # several: every rank gets the result, and the others drop it
            opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op is ReduceOp.SUM else dist.ReduceOp.AVG
        if comm.timeout_seconds:
            opts.timeout = timedelta(seconds=comm.timeout_seconds)
        if len(ranks) > 1:
            works = [backend.allreduce_coalesced(results, opts)]
        elif chosen.algorithm == "nccl":  # gloo's and NCCL's reduce take one tensor a call
            works = [backend.reduce([t], opts) for t in results]
        else:
            works = [backend.reduce(results, opts)]  # one packed call
        for work in works:
            work.wait()
        return results

    def broadcast(self, tensor: torch.Tensor, destinations=None, src: int = 0) -> Optional[torch.Tensor]:
        """Rank `src`'s `tensor`, mirrored to the destination ranks (None elsewhere)."""
        ranks = _ranks(destinations, dist.get_world_size())
        result = tensor.detach().clone()
        dist.broadcast(result, src=src, group=self._group(self.options))
        return result if dist.get_rank() in ranks else None


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """tf.distribute.HierarchicalCopyAllReduce(num_packs=1)."""

    def __init__(self, num_packs: int = 1, groups: Optional[Sequence[Sequence[int]]] = None):
        if num_packs < 0:
            raise ValueError(f"HierarchicalCopy requires num_packs >= 0, but {num_packs} is specified")
        super().__init__(Options("hierarchical_copy", num_packs=num_packs, groups=groups))


class ReductionToOneDevice(CrossDeviceOps):
    """tf.distribute.ReductionToOneDevice(reduce_to_device=None, accumulation_fn=None): every rank's
    value goes to one rank (`reduce_to_device`, else the first destination), is reduced there and
    goes to the destinations. `accumulation_fn` folds the list of every rank's tensor (in rank
    order) into one of the same shape and dtype, on that rank (TensorFlow's default, `add_n`, is
    hca's own sum); with MEAN its result is divided by the number of ranks."""

    def __init__(self, reduce_to_device: Optional[int] = None,
                 accumulation_fn: Optional[Callable[[List[torch.Tensor]], torch.Tensor]] = None):
        super().__init__(Options("reduce_to_one_device", reduce_to_device=reduce_to_device))
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise ValueError(f"accumulation_fn must be callable, got {accumulation_fn!r}")
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn

    def _reduced(self, values, op, ranks, comm):
        if self.accumulation_fn is None:
            return super()._reduced(values, op, ranks, comm)
        reducer = ranks[0] if self.reduce_to_device is None else self.reduce_to_device
        group = self._group(self.options_for(values, comm))
        return [self._accumulated(v.detach(), op, reducer, group) for v in values]

    def _accumulated(self, value: torch.Tensor, op: ReduceOp, reducer: int, group) -> torch.Tensor:
        """accumulation_fn over every rank's `value`, run on `reducer` and sent to every rank; a
        result of the wrong kind is a ValueError on every rank."""
        rank, world = dist.get_rank(), dist.get_world_size()
        gathered = [torch.empty_like(value) for _ in range(world)] if rank == reducer else None
        dist.gather(value.contiguous(), gathered, dst=reducer, group=group)
        result, problem = torch.empty_like(value), [None]
        if rank == reducer:
            try:
                out = self.accumulation_fn(gathered)
                if not isinstance(out, torch.Tensor) or out.shape != value.shape or out.dtype != value.dtype:
                    raise ValueError(f"returned {type(out).__name__}" + (
                        f" of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, torch.Tensor) else "") +
                        f", expected a tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
                result.copy_(out / world if op is ReduceOp.MEAN else out)
            except Exception as e:  # noqa: BLE001  every rank raises it, not the reducer alone
                problem = [f"{type(e).__name__}: {e}"]
        dist.broadcast_object_list(problem, src=reducer, group=group)
        if problem[0] is not None:
            raise ValueError(f"ReductionToOneDevice: accumulation_fn on rank {reducer} failed: {problem[0]}")
        dist.broadcast(result, src=reducer, group=group)
        return result


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
