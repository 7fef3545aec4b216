"""How many packs an all-reduce gets where the user left `num_packs` unset: a cost model.

The two candidates, one pack (one leader per call) and a pack per rank (every rank leads the
reduction of a part), are each a line, time = fixed_us + bytes / bytes_per_us, as NCCL's tuner
models its algorithms; a call gets a pack per rank where that line is predicted at least 5% faster
(a near tie keeps one pack). The lines are fitted to measured times, from, in this order:
- a calibration cached for this machine and world shape (`python -m torch_hca.calibrate`, or
  TORCH_HCA_CALIBRATE=1 at init, which measures one where none is cached; "force" measures again);
- else the table shipped with the package, measured on a 2-vCPU VM.
Rank 0 chooses the lines and every rank uses rank 0's, so that all make the same choice for every
call (ranks that chose differently would run different plans). The cache is a JSON file per
machine and world shape under TORCH_HCA_CACHE_DIR (default ~/.cache/torch_hca); delete it to go
back to the shipped table.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .options import cpu_executor, shm_chunk_bytes, shm_slots

MARGIN = 0.95  # a pack per rank must be predicted this much of one pack's time, or less
NEVER = 1 << 62  # the threshold of a choice that never takes a pack per rank
CANDIDATES = ("one_pack", "pack_per_rank")

# `benchmarks/bench.py --ops choice` on a 2-vCPU AMD EPYC VM, torch 2.13 (2026-11-26, batches of the
# candidates alternating; µs per call, median, slowest rank): bytes -> (one pack, a pack per rank).
SHIPPED_POINTS = {
    2: {4: (34.8, 33.0), 16: (23.0, 25.6), 64: (22.7, 22.2), 256: (28.5, 23.8), 1 << 10: (131.9, 29.1),
        4 << 10: (28.5, 28.2), 16 << 10: (43.0, 92.1), 64 << 10: (58.7, 50.6), 256 << 10: (164.9, 114.1),
        1 << 20: (688.2, 464.1), 4 << 20: (1849.7, 1085.0), 16 << 20: (5741.8, 3626.2),
        64 << 20: (45697.2, 24379.2)},
    3: {4: (135.8, 171.6), 16: (143.8, 161.4), 64: (158.9, 409.4), 256: (131.0, 152.5), 1 << 10: (209.6, 157.6),
        4 << 10: (135.8, 152.3), 16 << 10: (164.7, 189.6), 64 << 10: (181.6, 197.6), 256 << 10: (377.8, 387.9),
        1 << 20: (1191.1, 1097.1), 4 << 20: (4817.4, 4320.7), 16 << 20: (12580.9, 12591.9),
        64 << 20: (59122.6, 56806.3)},
    4: {4: (218.6, 633.2), 16: (217.5, 211.7), 64: (196.8, 307.1), 256: (186.7, 823.0), 1 << 10: (1100.8, 1994.9),
        4 << 10: (283.7, 328.5), 16 << 10: (310.2, 563.5), 64 << 10: (630.1, 1414.8), 256 << 10: (600.2, 765.3),
        1 << 20: (1987.6, 2073.3), 4 << 20: (5788.0, 4899.1), 16 << 20: (21240.4, 22177.9),
        64 << 20: (96499.6, 96021.1)},
}
SHIPPED_MACHINE = "2 vCPUs"

# What a calibration times: each candidate at these sizes, REPS batches each after a warm-up call,
# a batch being back-to-back calls for about BATCH_US (a group's threads that just ran a call still
# look for the next one a while: single calls of two groups alternating would slow each other).
CALIBRATION_BYTES = (16 << 10, 256 << 10, 2 << 20, 8 << 20)
CALIBRATION_REPS = 7
BATCH_US = 3000


@dataclasses.dataclass(frozen=True)
class Line:
    fixed_us: float
    bytes_per_us: float

    def predict_us(self, nbytes: int) -> float:
        return self.fixed_us + nbytes / self.bytes_per_us


@dataclasses.dataclass(frozen=True)
class CostModel:
    """One line per candidate, and where they came from (shipped, cached, calibrated)."""

    one_pack: Line
    pack_per_rank: Line
    origin: str

    def predict_us(self, nbytes: int) -> Dict[str, float]:
        return {name: getattr(self, name).predict_us(nbytes) for name in CANDIDATES}

    def pack_per_rank_from_bytes(self) -> int:
        """The smallest call (bytes) that gets a pack per rank; NEVER where none does. Two lines
        cross once: where a pack per rank would win only below some size (its fixed cost the
        smaller, which the extra step makes noise), one pack is kept."""
        per_byte_gain = 1 / self.pack_per_rank.bytes_per_us - MARGIN / self.one_pack.bytes_per_us
        fixed_gain = MARGIN * self.one_pack.fixed_us - self.pack_per_rank.fixed_us
        if per_byte_gain < 0:  # a pack per rank gains with size: from where it is ahead
            return max(1, int(-(-fixed_gain // per_byte_gain))) if fixed_gain < 0 else 1
        return 1 if per_byte_gain == 0 and fixed_gain >= 0 else NEVER

    def rule(self) -> str:
        """Which calls get a pack per rank, in words."""
        threshold = self.pack_per_rank_from_bytes()
        return "never" if threshold == NEVER else f"from {threshold} bytes"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls(Line(**d["one_pack"]), Line(**d["pack_per_rank"]), d["origin"])


def fit(points: Sequence[Tuple[float, float]]) -> Line:
    """The line through (bytes, µs) points with the least relative error (weights 1/t²), as every
    size matters alike; its fixed cost at least 0 and its bandwidth positive."""
    if len(points) < 2:
        raise ValueError(f"fit: needs two points or more, got {len(points)}")
    w = [1 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    slope = max(slope, 1e-9)  # µs per byte: no faster than a TB/s
    fixed = max(0.0, (sy - slope * sx) / sw)
    return Line(fixed, 1 / slope)


def fitted(points: Dict[str, Sequence[Tuple[float, float]]], origin: str) -> CostModel:
    return CostModel(fit(points["one_pack"]), fit(points["pack_per_rank"]), origin)


def shipped(world: int, cpus: int) -> CostModel:
    """The shipped table's lines for `world` ranks on `cpus` CPUs between them: its 2 ranks where
    every rank has a CPU, else its 3 or 4 ranks (taking turns on 2 CPUs) for 3 or more."""
    measured = 2 if cpus >= world else min(max(world, 3), 4)
    table = SHIPPED_POINTS[measured]
    points = {name: [(b, times[i]) for b, times in table.items()] for i, name in enumerate(CANDIDATES)}
    return fitted(points, f"the shipped table ({measured} ranks on {SHIPPED_MACHINE})")


def calibrate_mode(environ=None) -> str:
    """TORCH_HCA_CALIBRATE: "0" (default: the cached calibration, else the shipped table), "1"
    (measure at init where nothing is cached) or "force" (measure at init and cache it). Read on
    rank 0 only."""
    environ = os.environ if environ is None else environ
    mode = environ.get("TORCH_HCA_CALIBRATE", "").strip() or "0"
    if mode not in ("0", "1", "force"):
        raise ValueError(f"TORCH_HCA_CALIBRATE={mode!r}: expected 0 (the default), 1 or force")
    return mode


def cache_dir(environ=None) -> pathlib.Path:
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_HCA_CACHE_DIR", "").strip():
        return pathlib.Path(environ["TORCH_HCA_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "torch_hca"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def _version() -> str:
    try:
        return importlib.metadata.version("torch_hca")
    except importlib.metadata.PackageNotFoundError:  # a build in place, not installed
        return "unknown"


def cache_path(world: int, cpus: int, groups: Sequence[Sequence[int]], environ=None) -> pathlib.Path:
    """The cache file of this machine (its CPU model, torch_hca's version) and world shape: the
    ranks, the CPUs between them, their groups, and the staging and executor, which change the times."""
    key = json.dumps({"cpu": _cpu_model(), "version": _version(), "world": world, "cpus": cpus,
                      "groups": [list(g) for g in groups], "slot_bytes": shm_chunk_bytes(environ),
                      "slots": shm_slots(environ), "executor": cpu_executor(environ)}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir(environ) / f"costs-{world}ranks-{cpus}cpus-{digest}.json"


def load(path: pathlib.Path) -> Optional[CostModel]:
    """The cached model, or None (no file, or one this version cannot read: measured again)."""
    try:
        return CostModel.from_json(json.loads(path.read_text())["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_or_shipped(path: pathlib.Path, world: int, cpus: int) -> CostModel:
    """What a group gets without a calibration at init: the cached one, else the shipped table's."""
    return load(path) or shipped(world, cpus)


def save(model: CostModel, points: dict, path: pathlib.Path) -> None:
    """Written whole or not at all (a rename), so that a reader never sees half a file; where it
    cannot be written the model still serves this group (a warning says so)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"model": model.to_json(), "points": points}, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"hca: the calibration could not be cached in {path}: {e}", stacklevel=2)


def measure(groups: Dict[str, object], exchange: Callable[[str, str], List[str]]) -> Dict[str, list]:
    """Times each candidate's group (name -> a process group of hca's) at CALIBRATION_BYTES, their
    batches alternating so that a drift of the machine's speed hits them alike; every rank takes
    part. The points: per size, the median of each rank's batches (µs per call), the slowest rank's."""
    import torch

    times = {name: {b: [] for b in CALIBRATION_BYTES} for name in groups}
    for nbytes in CALIBRATION_BYTES:
        t = torch.zeros(nbytes // 4)
        calls = 1
        for group in groups.values():
            start = time.perf_counter()
            group.allreduce([t]).wait()  # warm-up: the plan, the staging's first touch
            calls = max(calls, int(BATCH_US / max((time.perf_counter() - start) * 1e6, 1.0)))
        # Every rank runs as many calls per batch as rank 0 found it needs.
        calls = min(int(exchange(f"hca_costs_calls{nbytes}", str(calls))[0]), 200)
        for rep in range(CALIBRATION_REPS):
            for name in (CANDIDATES if rep % 2 == 0 else CANDIDATES[::-1]):
                start = time.perf_counter()
                for _ in range(calls):
                    groups[name].allreduce([t]).wait()
                times[name][nbytes].append((time.perf_counter() - start) * 1e6 / calls)
    mine = {name: {b: statistics.median(ts) for b, ts in by_size.items()} for name, by_size in times.items()}
    reports = [json.loads(r) for r in exchange("hca_costs_measured", json.dumps(
        {name: list(by_size.items()) for name, by_size in mine.items()}))]
    return {name: [(b, max(dict(map(tuple, r[name]))[b] for r in reports)) for b in CALIBRATION_BYTES]
            for name in CANDIDATES}


def for_group(rank: int, world: int, cpus: int, groups: Sequence[Sequence[int]],
              exchange: Callable[[str, str], List[str]], make_group: Callable[[int], object]) -> Optional[CostModel]:
    """The model a group of `world` ranks uses: rank 0's choice of cached, calibrated now or
    shipped, shared through `exchange(key, text)` (every rank's text, by rank). None for one rank.
    `make_group(num_packs)`: a private group of the same ranks and options but `num_packs`, for a
    calibration."""
    if world == 1:
        return None
    decision = {}
    if rank == 0:
        path = cache_path(world, cpus, groups)
        try:
            mode = calibrate_mode()
        except ValueError as e:
            decision = {"error": str(e)}  # every rank raises it, none waits for rank 0
        else:
            if mode == "0":
                decision = {"model": cached_or_shipped(path, world, cpus).to_json()}
            else:
                cached = load(path) if mode == "1" else None
                decision = {"model": cached.to_json()} if cached else {"calibrate": str(path)}
    decision = json.loads(exchange("hca_costs", json.dumps(decision))[0])
    if "error" in decision:
        raise ValueError(f"hca: rank 0's {decision['error']}")
    if "model" in decision:
        return CostModel.from_json(decision["model"])
    groups = {name: make_group(num_packs) for name, num_packs in zip(CANDIDATES, (1, world))}
    points = measure(groups, exchange)
    for group in groups.values():
        group.shutdown()
    model = fitted(points, f"calibrated on this machine at init on {time.strftime('%Y-%m-%d')} "
                           f"(cached in {decision['calibrate']})")
    if rank == 0:
        save(model, points, pathlib.Path(decision["calibrate"]))
    return model
