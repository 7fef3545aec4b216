"""Options of the `hca` backend, from `pg_options=Options(...)` or `TORCH_HCA_*` variables.

Python reads and types the values; their rules live once, in the C++ plan
(`_C.PackingOptions`, `_C.PlanOptions`), which raises ValueError naming the option."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence, Tuple, Union

from . import _C

ALGORITHMS = ("hierarchical_copy", "reduce_to_one_device", "direct", "nccl")
INTER_NODE_BACKENDS = ("gloo", "nccl")
ENV_PREFIX = "TORCH_HCA_"
NAMED_GROUPS = ("auto", "halves")


@dataclasses.dataclass(frozen=True)
class Options:
    """How `hca` reduces. Checked here for what needs no world size; the world-dependent
    checks (`reduce_to_device`, `groups`) run when the process group is created.

    algorithm: "hierarchical_copy", "reduce_to_one_device", "direct" (in one step every rank
        reads every peer's staged input and sums them all, in rank order, so every rank holds the
        same bits; a reduce goes straight to its root; one node only: fastest for small messages
        on 3-4 ranks sharing few CPUs) or "nccl" (hca's packing in front of a
        stock engine: a wrapper backend, not a schedule). None (the default): chosen per call with
        num_packs, by a cost model (`torch_hca.costs`), for all-reduces of CPU tensors in one node;
        hierarchical_copy elsewhere, and wherever num_packs is set.
    num_packs: split each batch's concatenated tensors into this many packs (0: no packing).
        None (the default): chosen per call (one pack, or one per rank) by the cost model for
        hierarchical_copy on CPU tensors in one node; 1 elsewhere (reduce_to_one_device, CUDA
        tensors, across nodes, the nccl pass-through).
    reduce_to_device: the rank that reduces for reduce_to_one_device (None: the destination
        of `reduce`, else rank 0).
    groups: the hierarchy's groups of ranks: "auto" (default: ranks that share a CPU package or
        NUMA node, or whose GPUs reach each other by NVLink or a PCIe switch, form a group; TF's
        halves where nothing splits the ranks), "halves" (TF's rule: two halves of the ranks), or
        the groups themselves, e.g. [[0, 1, 2, 3], [4, 5, 6, 7]]. None means "auto".
    agg_small_grads_max_bytes / agg_small_grads_max_group: with num_packs=0, tensors smaller than
        max_bytes are aggregated into packs of at most max_group tensors.
    inter_node_backend: the engine among node leaders when the ranks span several nodes, for CUDA
        tensors: "nccl" (ProcessGroupNCCL), "gloo" (through host memory), None: NCCL where torch
        has it, else gloo. CPU tensors always go through gloo.
    """

    algorithm: Optional[str] = None
    num_packs: Optional[int] = None
    reduce_to_device: Optional[int] = None
    groups: Union[str, Sequence[Sequence[int]], None] = "auto"
    agg_small_grads_max_bytes: int = 0
    agg_small_grads_max_group: int = 10
    inter_node_backend: Optional[str] = None

    def __post_init__(self):
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: unknown algorithm {self.algorithm!r} (expected one of {', '.join(ALGORITHMS)})")
        if self.inter_node_backend is not None and self.inter_node_backend not in INTER_NODE_BACKENDS:
            raise ValueError(f"inter_node_backend: unknown engine {self.inter_node_backend!r} "
                             f"(expected one of {', '.join(INTER_NODE_BACKENDS)}, or None)")
        if self.num_packs is not None:
            _check_int("num_packs", self.num_packs)
        _check_int("agg_small_grads_max_bytes", self.agg_small_grads_max_bytes, limit=2**63 - 1)
        _check_int("agg_small_grads_max_group", self.agg_small_grads_max_group)
        if self.reduce_to_device is not None:
            _check_int("reduce_to_device", self.reduce_to_device)
        if self.groups is None:
            object.__setattr__(self, "groups", "auto")
        if isinstance(self.groups, str):
            if self.groups not in NAMED_GROUPS:
                raise ValueError(f"groups: unknown rule {self.groups!r} (expected {' or '.join(map(repr, NAMED_GROUPS))}, "
                                 "or lists of ranks)")
        else:
            try:
                groups = tuple(tuple(g) for g in self.groups)
            except TypeError:
                raise ValueError(f"groups: expected lists of ranks, got {self.groups!r}") from None
            if not groups:
                raise ValueError(f"groups: every group needs at least one rank, got {self.groups!r}")
            for rank in (r for g in groups for r in g):
                _check_int("groups", rank)
            object.__setattr__(self, "groups", groups)
        self.packing_options()
        if self.algorithm != "nccl":
            self.plan_options()

    def packing_options(self) -> "_C.PackingOptions":
        """The packing, validated by the plan (ValueError naming the option); num_packs None: 1."""
        return _C.PackingOptions(1 if self.num_packs is None else self.num_packs, self.agg_small_grads_max_bytes,
                                 self.agg_small_grads_max_group)

    def plan_options(self, groups: Optional[Sequence[Sequence[int]]] = None,
                     by_size: Sequence[Tuple[int, str, bool]] = ()) -> "_C.PlanOptions":
        """Everything the plan needs, validated by it; the world-dependent rules run in `validate_for`.
        `groups`: the groups "auto" or "halves" resolved to (default: the given groups, else halves).
        `by_size`: an all-reduce's choice per call, (from bytes, algorithm, a pack per rank)
        ascending from 0 (`costs.CostModel.by_size`); empty: the options as they are."""
        if self.algorithm == "nccl":
            raise ValueError("algorithm: 'nccl' hands packs to a stock engine; it has no schedule")
        if groups is None:
            groups = () if isinstance(self.groups, str) else self.groups
        return _C.PlanOptions(self.algorithm or "hierarchical_copy", self.packing_options(), self.reduce_to_device,
                              [list(g) for g in groups], list(by_size))

    @classmethod
    def from_env(cls, environ=None) -> "Options":
        """Options from TORCH_HCA_ALGORITHM, _NUM_PACKS, _REDUCE_TO_DEVICE, _GROUPS ("auto", "halves" or "0,1;2,3"),
        _AGG_SMALL_GRADS_MAX_BYTES, _AGG_SMALL_GRADS_MAX_GROUP and _INTER_NODE_BACKEND; unset ones
        take the defaults."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            name = ENV_PREFIX + field.name.upper()
            text = environ.get(name)
            if text is None or text.strip() == "":
                continue
            try:
                values[field.name] = _parse(field.name, text.strip())
            except ValueError as e:
                raise ValueError(f"{name}={text!r}: {e}") from None
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"from the environment: {e}") from None


def _check_int(name, value, limit=2**31 - 1):
    """Types only (the plan owns the rules): an int that fits the C++ field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if not -limit - 1 <= value <= limit:
        raise ValueError(f"{name}: {value} is out of range (at most {limit} in magnitude)")


def _parse(field, text):
    if field in ("algorithm", "inter_node_backend"):
        return text
    if field == "groups":
        if text in NAMED_GROUPS:
            return text
        return [[int(r) for r in group.split(",")] for group in text.split(";")]
    return int(text)


def _env_int(name, default, minimum, environ, maximum=2**40):
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_PREFIX + name, "")
    try:
        value = int(text) if text.strip() else default
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name}={text!r}: expected an int") from None
    if not minimum <= value <= maximum:
        raise ValueError(f"{ENV_PREFIX}{name}={text!r}: must be between {minimum} and {maximum}")
    return value


MAX_SLOTS = 1 << 16  # a ring longer than this buys nothing, and the count must fit the C++ int


def shm_chunk_bytes(environ=None) -> int:
    """Bytes of one staging slot per rank (TORCH_HCA_SHM_CHUNK_BYTES, default 128 KiB)."""
    return _env_int("SHM_CHUNK_BYTES", 128 << 10, 4096, environ)


def shm_slots(environ=None) -> int:
    """Staging slots per rank, used as a ring (TORCH_HCA_SHM_SLOTS, default 16). A long ring lets
    the copies that peers' caches hold of a slot age out before the slot is written again: writing
    a line another core still holds must invalidate that copy first, which made 2 slots 1.2-2.2x
    slower than 16 on a 2-vCPU VM (docs/history/performance-log.md)."""
    return _env_int("SHM_SLOTS", 16, 2, environ, MAX_SLOTS)


def cuda_chunk_bytes(environ=None) -> int:
    """Bytes of one CUDA staging slot per rank (TORCH_HCA_CUDA_CHUNK_BYTES), or 0 where it is not
    set: then the group chooses at its first CUDA collective, the same on every rank, 64 MiB where
    every rank uses one GPU (processes sharing a GPU take turns on it, and each round of a call
    costs about a millisecond there whatever its size) and 8 MiB otherwise."""
    environ = os.environ if environ is None else environ
    if not environ.get(ENV_PREFIX + "CUDA_CHUNK_BYTES", "").strip():
        return 0
    return _env_int("CUDA_CHUNK_BYTES", 0, 4096, environ)


def cuda_slots(environ=None) -> int:
    """CUDA staging slots per rank, a ring: chunk i+1 stages while chunk i reduces (TORCH_HCA_CUDA_SLOTS, default 4)."""
    return _env_int("CUDA_SLOTS", 4, 2, environ, MAX_SLOTS)


def cuda_staging(environ=None) -> str:
    """Where the CUDA staging rings live (TORCH_HCA_CUDA_STAGING): "auto" (default) in GPU memory
    shared by CUDA IPC where every rank can map every peer's GPU memory, else (one visible GPU per
    process, GPUs that are not peers) in host shared memory that every GPU maps; "host": in host
    shared memory always. One rank choosing host memory makes every rank use it."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_PREFIX + "CUDA_STAGING", "").strip() or "auto"
    if value not in ("auto", "host"):
        raise ValueError(f"{ENV_PREFIX}CUDA_STAGING={value!r}: expected 'auto' (the default) or 'host'")
    return value


def cpu_executor(environ=None) -> str:
    """What runs collectives on CPU tensors (TORCH_HCA_CPU_EXECUTOR): "shm" (default, shared
    memory), or "streams": the executor CUDA tensors use, its device operations run by a host
    thread per rank, so that its logic (deferred waits, the watchdog, releasing waits after a
    failure) is tested without a GPU. Checked by the extension when the group is created."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_PREFIX + "CPU_EXECUTOR", "").strip() or "shm"
