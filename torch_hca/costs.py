"""How an all-reduce runs where the user left `algorithm` and/or `num_packs` unset: a cost model.

The candidates, one pack (hierarchical copy, one leader per call), a pack per rank (every rank leads
the reduction of a part), reduce_to_one_device (one rank reduces everything, no hierarchy) and direct
(in one step every rank sums every peer's staged input), are each a line, time = fixed_us + bytes /
bytes_per_us, as NCCL's tuner models its algorithms. A call gets the fastest predicted candidate
where it is predicted at least 3% faster than one pack (a near tie keeps one pack, TF's default);
the lines cross at a few sizes, so the choice is a short table of sizes that the plan reads per
call. Only the candidates the user's options leave open compete:
all four with neither option set; one pack or a pack per rank with algorithm="hierarchical_copy".
The lines of CPU tensors are fitted to measured times, from, in this order:
- a calibration cached for this machine and world shape (`python -m torch_hca.calibrate`, or
  TORCH_HCA_CALIBRATE=1 at init, which measures one where none is cached; "force" measures again);
- else the table shipped with the package, measured on a 2-vCPU VM.
CUDA tensors get a table of their own where the group's first collective on them finds every rank's
tensors on one and the same GPU: there each step of a call costs about a switch between the
processes that share the GPU, so the plans with fewer steps win. Where each rank has a GPU of its
own and every GPU reaches every other, the lines come from a model of the links (links.py:
predicted, never measured); elsewhere CUDA tensors keep one pack, TF's default.
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
import stat
import statistics
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .options import cpu_executor, shm_chunk_bytes, shm_slots

# Another candidate must be predicted this much of one pack's time, or less. 0.97 from six runs of
# `bench.py --ops choice` held out of the shipped table (2026-11-27, -28, -30): the shipped lines' choice was
# within 1.05x of the fastest fixed setting at 218 of 234 sizes with 0.97 (216-217 up to 1.0), 213 with 0.95;
# with four runs more, 359 of 390 against 350.
MARGIN = 0.97
# name -> (algorithm, a pack per rank); the first is the baseline the others must beat by the margin.
CANDIDATES = {"one_pack": ("hierarchical_copy", False), "pack_per_rank": ("hierarchical_copy", True),
              "reduce_to_one_device": ("reduce_to_one_device", False), "direct": ("direct", False)}
BASELINE = "one_pack"
WORDS = {"one_pack": "one pack", "pack_per_rank": "a pack per rank", "reduce_to_one_device": "reduce_to_one_device",
         "direct": "direct"}

# `benchmarks/bench.py --ops choice` on a 2-vCPU AMD EPYC VM, torch 2.13 (2026-11-27, after waits stopped
# spinning for a rank on their own CPU; batches of the candidates alternating; µs per call, the median
# over 4 runs of each run's median, slowest rank; the runs are in benchmarks/results/
# cpu-choice-ranks2_3_4-same-cpu-2026-11-27.json): bytes -> the candidates' times, in CANDIDATES' order.
# The last, direct's, came later (2026-11-27, night): one pack's time here times the median over 3 runs
# (1 above 256 KiB, and at 2 ranks) of direct's time over one pack's in the same run, their batches
# alternating (benchmarks/results/cpu-choice-direct-prototype-ranks2_3_4-2026-11-27.json).
SHIPPED_POINTS = {
    2: {4: (5.0, 5.0, 5.1, 4.9), 16: (4.9, 5.0, 4.9, 4.8), 64: (5.2, 5.2, 4.9, 5.2), 256: (4.9, 5.1, 4.9, 4.8),
        1 << 10: (5.2, 5.2, 5.1, 5.7), 4 << 10: (5.7, 5.6, 5.7, 5.9), 16 << 10: (6.6, 5.7, 6.3, 6.5),
        64 << 10: (11.9, 8.2, 11.1, 11.0), 256 << 10: (29.9, 19.1, 30.1, 26.9), 1 << 20: (104.6, 58.3, 103.5, 92.8),
        4 << 20: (403.4, 219.5, 396.7, 345.9), 16 << 20: (2409.5, 1290.7, 2392.9, 1896.6),
        64 << 20: (9853.8, 5254.7, 9651.9, 8010.6)},
    3: {4: (16.5, 15.6, 16.2, 16.6), 16: (15.2, 16.7, 15.4, 14.6), 64: (15.0, 17.2, 14.7, 14.7), 256: (18.4, 18.3, 19.2, 18.4),
        1 << 10: (14.6, 18.8, 18.3, 11.5), 4 << 10: (16.2, 19.1, 17.3, 13.1), 16 << 10: (17.5, 21.8, 18.1, 13.9),
        64 << 10: (34.0, 26.0, 27.7, 31.0), 256 << 10: (79.0, 72.9, 78.4, 92.1), 1 << 20: (215.5, 183.4, 213.7, 281.0),
        4 << 20: (832.2, 701.0, 848.0, 858.2), 16 << 20: (5054.0, 4214.9, 4880.7, 6691.6),
        64 << 20: (22090.6, 17287.0, 21747.5, 21947.8)},
    4: {4: (46.3, 40.0, 38.4, 42.8), 16: (31.9, 43.1, 34.1, 27.4), 64: (32.0, 41.8, 34.8, 25.1), 256: (34.4, 39.2, 34.3, 28.9),
        1 << 10: (41.3, 38.6, 34.3, 32.8), 4 << 10: (37.0, 39.5, 35.8, 38.9), 16 << 10: (41.3, 46.6, 40.1, 45.2),
        64 << 10: (62.9, 64.7, 56.1, 73.2), 256 << 10: (140.9, 142.3, 139.1, 176.0), 1 << 20: (481.0, 456.8, 491.4, 626.7),
        4 << 20: (2097.2, 1882.2, 2047.9, 2765.2), 16 << 20: (8702.0, 6951.0, 7942.3, 10584.4),
        64 << 20: (29864.4, 24102.6, 30398.4, 35678.0)},
}
SHIPPED_MACHINE = "2 vCPUs"

# `benchmarks/bench.py --device cuda --ops all_reduce --step 4` with 2, 3 and 4 ranks sharing one
# NVIDIA H200 (torch 2.11, CUDA 13, 64 MiB staging slots; 2026-11-28, one run, µs per call, slowest
# rank; benchmarks/results/NVIDIA_H200-cuda-ranks2_3_4-one-pack-2026-11-28.json), in CANDIDATES' order. At 3
# ranks one pack and reduce_to_one_device run the same two steps; at 4, one pack's hierarchy takes
# four steps where reduce_to_one_device takes two (11-38% faster here from 16 B up, as in the
# 2026-11-27 run).
SHIPPED_CUDA_POINTS = {
    2: {4: (334.2, 331.6, 332.0, 332.2), 16: (335.0, 662.4, 332.5, 335.3), 64: (337.5, 660.6, 330.8, 333.6),
        256: (336.8, 661.9, 328.2, 333.3), 1 << 10: (338.3, 661.9, 327.5, 335.0), 4 << 10: (339.2, 665.0, 330.5, 337.9),
        16 << 10: (346.5, 666.2, 339.3, 349.7), 64 << 10: (380.8, 699.3, 371.0, 406.2),
        256 << 10: (514.0, 835.4, 508.1, 638.8), 1 << 20: (1108.4, 1353.6, 1095.3, 1651.8),
        4 << 20: (2233.2, 3505.8, 2260.5, 3354.8), 16 << 20: (3173.6, 6371.6, 3197.6, 4314.1),
        64 << 20: (3394.4, 6644.9, 3413.7, 4900.1)},
    3: {4: (770.8, 652.4, 779.2, 797.0), 16: (771.0, 1002.6, 779.6, 796.7), 64: (772.1, 1056.8, 779.3, 817.8),
        256: (796.4, 1053.2, 780.1, 784.1), 1 << 10: (770.9, 1057.0, 779.6, 791.5), 4 << 10: (775.4, 1056.2, 779.8, 790.7),
        16 << 10: (782.3, 1068.2, 790.8, 821.9), 64 << 10: (828.5, 1189.6, 834.1, 909.6),
        256 << 10: (1005.2, 1729.9, 1014.5, 1268.9), 1 << 20: (1799.1, 4001.3, 1688.6, 2933.1),
        4 << 20: (3694.2, 13097.8, 3714.6, 4221.0), 16 << 20: (5610.9, 25650.6, 5703.7, 7173.6),
        64 << 20: (5914.5, 54729.1, 5975.0, 7689.0)},
    4: {4: (1260.6, 1262.8, 1094.6, 1106.5), 16: (1260.8, 2095.0, 1079.9, 1112.8), 64: (1259.6, 2111.6, 1087.0, 1160.3),
        256: (1259.8, 2106.9, 1100.0, 1109.2), 1 << 10: (1001.7, 2117.2, 1082.3, 1166.7),
        4 << 10: (993.8, 2103.6, 952.3, 1171.6), 16 << 10: (1285.6, 2100.9, 966.2, 1196.1),
        64 << 10: (1388.8, 2196.5, 1193.7, 1251.8), 256 << 10: (1793.4, 2622.8, 1506.2, 1723.7),
        1 << 20: (3705.9, 4248.1, 2714.7, 3855.4), 4 << 20: (7137.1, 11758.0, 6355.4, 7260.8),
        16 << 20: (10290.1, 27867.0, 9633.5, 9378.6), 64 << 20: (11123.8, 41493.5, 9522.0, 10269.5)},
}
SHIPPED_CUDA_MACHINE = "NVIDIA H200"

# What a calibration times: each candidate at these sizes, small ones included, in CALIBRATION_BATCHES
# batches of about BATCH_US of back-to-back calls, as `bench.py --ops choice` times its contenders (before
# 2026-11-30 it took 7 batches at 16 KiB to 8 MiB, without a barrier before each: those lines' choice was within
# 1.05x of the fastest fixed setting at 149-171 of 234 held-out sizes, the shipped table's at 218).
CALIBRATION_BYTES = (4, 64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20, 8 << 20)
CALIBRATION_BATCHES = 16
BATCH_US = 5000


@dataclasses.dataclass(frozen=True)
class Line:
    fixed_us: float
    bytes_per_us: float

    def predict_us(self, nbytes: int) -> float:
        return self.fixed_us + nbytes / self.bytes_per_us


def candidates(algorithm: Optional[str], num_packs: Optional[int]) -> Tuple[str, ...]:
    """The candidates the user's options leave open (none: they fixed the choice)."""
    if num_packs is not None:
        return ()
    if algorithm is None:
        return tuple(CANDIDATES)
    return ("one_pack", "pack_per_rank") if algorithm == "hierarchical_copy" else ()


@dataclasses.dataclass(frozen=True)
class CostModel:
    """One line per candidate, and where they came from (shipped, cached, calibrated)."""

    lines: Dict[str, Line]
    origin: str

    def predict_us(self, nbytes: int, names: Sequence[str] = tuple(CANDIDATES)) -> Dict[str, float]:
        return {name: self.lines[name].predict_us(nbytes) for name in names}

    def choose(self, nbytes: float, names: Sequence[str] = tuple(CANDIDATES)) -> str:
        """The candidate a call of `nbytes` gets: the fastest of those predicted at least 3% faster
        than one pack (MARGIN), else one pack."""
        t = self.predict_us(nbytes, names)
        ahead = [n for n in names if n != BASELINE and t[n] <= MARGIN * t[BASELINE]]
        return min(ahead, key=t.get) if ahead else BASELINE

    def by_size(self, names: Sequence[str] = tuple(CANDIDATES)) -> List[Tuple[int, str]]:
        """The choice for every size, as (from bytes, candidate) pairs, the first from 0. It can
        change only where two lines (one pack's scaled by the margin) cross, so it is constant
        between consecutive crossings."""
        def scaled(n):
            k = MARGIN if n == BASELINE else 1.0
            return k * self.lines[n].fixed_us, k / self.lines[n].bytes_per_us

        crossings = {0}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                (fa, sa), (fb, sb) = scaled(a), scaled(b)
                if sa != sb and (fb - fa) / (sa - sb) > 0:
                    crossings.add(int(-(-(fb - fa) // (sa - sb))))
        starts = sorted(crossings)
        table = []
        for i, start in enumerate(starts):
            inside = (start + starts[i + 1]) / 2 if i + 1 < len(starts) else 2 * start + 1
            name = self.choose(inside, names)
            if not table or table[-1][1] != name:
                table.append((start, name))
        return table

    def rule(self, names: Sequence[str] = tuple(CANDIDATES)) -> str:
        """Which calls get which candidate, in words."""
        table = self.by_size(names)
        return ", ".join(f"{WORDS[name]} from {start} bytes" if start else WORDS[name] for start, name in table)

    def to_json(self) -> dict:
        return {"lines": {name: dataclasses.asdict(line) for name, line in self.lines.items()}, "origin": self.origin}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        lines = {name: Line(**d["lines"][name]) for name in CANDIDATES}  # KeyError: an older file
        return cls(lines, d["origin"])


def plan_choices(model: CostModel, names: Sequence[str]) -> List[Tuple[int, str, bool]]:
    """The model's choice over `names` as the plan reads it: (from bytes, algorithm, a pack per rank)."""
    return [(start, *CANDIDATES[name]) for start, name in model.by_size(names)]


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
    return CostModel({name: fit(points[name]) for name in CANDIDATES}, origin)


def shipped(world: int, cpus: int) -> CostModel:
    """The shipped table's lines for `world` ranks on `cpus` CPUs between them: its 2 ranks where
    every rank has a CPU, else its 3 or 4 ranks (taking turns on 2 CPUs) for 3 or more."""
    measured = 2 if cpus >= world else min(max(world, 3), 4)
    return _table_model(SHIPPED_POINTS[measured], f"the shipped table ({measured} ranks on {SHIPPED_MACHINE})")


def by_world(model: CostModel, world: int, cpus: int) -> Dict[Tuple[int, bool], CostModel]:
    """The CPU models of a group of `world` ranks on `cpus` CPUs and of the children split off it,
    by their size (2 up to `world`) and whether their ranks have fewer CPUs between them than ranks
    (the child counts its own ranks' CPUs): the group's own `model`, and for the others the shipped
    table of their size. Not a cached calibration: the cache is read on rank 0 only, at init, and
    keyed by groups that a child's split has yet to choose; the shipped table is the same on every
    rank."""
    children = {(size, fewer): shipped(size, size - 1 if fewer else size)
                for size in range(2, world) for fewer in (False, True)}
    return {**children, (world, cpus < world): model}


def sharing_one_gpu(world: int) -> Optional[CostModel]:
    """The model of CUDA tensors of `world` ranks that share one GPU: the shipped table of as many
    ranks (4 for more); None for one rank."""
    if world < 2:
        return None
    measured = min(world, 4)
    return _table_model(SHIPPED_CUDA_POINTS[measured],
                        f"the shipped table of CUDA tensors ({measured} ranks sharing one {SHIPPED_CUDA_MACHINE})")


def _table_model(table: Dict[int, Tuple[float, ...]], origin: str) -> CostModel:
    return fitted({name: [(b, times[i]) for b, times in table.items()] for i, name in enumerate(CANDIDATES)}, origin)


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


def _own_and_private(path: pathlib.Path) -> bool:
    """Whether `path` (not a link) belongs to this user and no one else may write it: a cache that
    another user could have written would let them pick this user's algorithms."""
    info = path.lstat()
    return not stat.S_ISLNK(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def load(path: pathlib.Path) -> Optional[CostModel]:
    """The cached model, or None (no file, one this version cannot read: measured again; or one
    in a file or folder another user could have written: ignored, with a warning)."""
    try:
        if not (_own_and_private(path.parent) and _own_and_private(path)):
            warnings.warn(f"hca: ignoring the calibration in {path}: it or its folder is not this user's own, or "
                          "others may write it", stacklevel=2)
            return None
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
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)  # O_EXCL, mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump({"model": model.to_json(), "points": points}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"hca: the calibration could not be cached in {path}: {e}", stacklevel=2)


def measure(groups: Dict[str, object], exchange: Callable[[str, str], List[str]],
            barrier: Callable[[], None]) -> Dict[str, list]:
    """Times each candidate's group (name -> a process group of hca's) at CALIBRATION_BYTES; every rank
    takes part. The points: per size, the median of each rank's batches (µs per call), the slowest
    rank's. As `bench.py --ops choice` times its contenders, their batches alternate (torch_hca.bench's
    alternating_samples), each after `barrier()`, which must not be an hca call (its threads would still
    be looking for work during the batch), all with as many calls, counted from warm calls."""
    import torch

    from .bench import alternating_samples, calls_per_batch

    points = {name: [] for name in groups}
    for nbytes in CALIBRATION_BYTES:
        t = torch.zeros(max(1, nbytes // 4))
        modes = {name: (lambda g=g: g.allreduce([t]).wait()) for name, g in groups.items()}
        for fn in modes.values():
            fn()  # the plan, the staging's first touch
        calls = calls_per_batch(modes, _largest_over_ranks(exchange, f"hca_costs_estimate{nbytes}"), probe=3, least=1,
                                batch_s=BATCH_US * 1e-6)
        samples = alternating_samples(modes, calls, CALIBRATION_BATCHES, barrier)
        medians = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
        reports = [json.loads(r) for r in exchange(f"hca_costs_measured{nbytes}", json.dumps(medians))]
        for name in groups:
            points[name].append((nbytes, max(r[name] for r in reports)))
    return points


def _largest_over_ranks(exchange: Callable[[str, str], List[str]], topic: str) -> Callable[[List[float]], List[float]]:
    """calls_per_batch's `slowest`, through `exchange`: each of this rank's numbers replaced by the
    largest of the ranks'."""
    def largest(numbers):
        return [max(column) for column in zip(*(json.loads(r) for r in exchange(topic, json.dumps(numbers))))]
    return largest


# Ranks that take turns on CPUs time differently from moment to moment. On the shipped table's 2-vCPU VM
# (2026-11-30), ten calibrations each of 3 and of 4 ranks (six as made here, four averaging two sweeps) chose
# within 1.05x of the fastest fixed setting at 34-119 of 130 sizes (ten `bench.py --ops choice` runs,
# benchmarks/score_choice.py), the shipped lines at 118-119; eleven of 2 ranks, a CPU each, at 119-128
# against 122.
SHARED_CPUS_WARNING = (
    "hca: this calibration timed {world} ranks taking turns on {cpus}, whose times vary from moment to moment: "
    "on a 2-vCPU VM such calibrations chose well at 34-119 of 130 sizes where the shipped table chose well at "
    "118-119. Score it beside the table on runs of benchmarks/bench.py --ops choice (benchmarks/score_choice.py, "
    "in torch_hca's repository); deleting {path} goes back to the shipped table.")


def counting_barrier(add: Callable[[str, int], int], world: int, timeout_s: float) -> Callable[[], None]:
    """A barrier through a store's counter (`add`, a c10d Store's add): one key however often it is
    passed; a rank missing for `timeout_s` raises RuntimeError."""
    passed = 0

    def barrier():
        nonlocal passed
        passed += 1
        add("hca_costs_barrier", 1)
        deadline = time.monotonic() + timeout_s
        while add("hca_costs_barrier", 0) < passed * world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"hca: a rank did not reach the calibration's barrier #{passed} "
                                   f"within {timeout_s:g} s")
            time.sleep(2e-4)

    return barrier


def for_group(rank: int, world: int, cpus: int, groups: Sequence[Sequence[int]],
              exchange: Callable[[str, str], List[str]], make_group: Callable[[str, int], object],
              barrier: Callable[[], None]) -> Optional[CostModel]:
    """The model a group of `world` ranks uses: rank 0's choice of cached, calibrated now or
    shipped, shared through `exchange(key, text)` (every rank's text, by rank). None for one rank.
    `make_group(algorithm, num_packs)`: a private group of the same ranks and options but these,
    for a calibration (of every candidate, so that the cache serves any options); `barrier()`, one
    that is not an hca call (counting_barrier), before each of its batches."""
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
    groups = {name: make_group(algorithm, world if per_rank else 1) for name, (algorithm, per_rank) in CANDIDATES.items()}
    points = measure(groups, exchange, barrier)
    for group in groups.values():
        group.shutdown()
    model = fitted(points, f"calibrated on this machine at init on {time.strftime('%Y-%m-%d')} "
                           f"(cached in {decision['calibrate']})")
    if rank == 0:
        save(model, points, pathlib.Path(decision["calibrate"]))
        if cpus < world:
            cpus_text = f"{cpus} CPU" if cpus == 1 else f"{cpus} CPUs"
            warnings.warn(SHARED_CPUS_WARNING.format(world=world, cpus=cpus_text, path=decision["calibrate"]),
                          stacklevel=2)
    return model
