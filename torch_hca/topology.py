"""Where each rank runs, and the hierarchy's groups from it (`groups="auto"`).

At init every rank reports its place through the store: for CPU tensors, the CPU packages and
NUMA nodes of the CPUs it may run on; for CUDA tensors, its GPU and the GPUs it reaches by
NVLink or a common PCIe switch. The plan (`_C.groups_from_places`) turns the reports into
groups, the same on every rank since every rank reads the same reports. Unpinned ranks, one
NUMA node or no information leave TF's halves, as before.

Detection reads the machine through `Machine` only (sysfs, the affinity mask, GPU links),
so tests hand it fake machines."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from . import _C
from .costs import CostModel

CPU_LEVELS = ("CPU package", "NUMA node")  # coarsest first: the first that splits the ranks wins
GPU_LEVELS = ("GPU link domain",)


@dataclasses.dataclass(frozen=True)
class Machine:
    """What detection reads. sysfs_root: the root under which `sys/devices/system` lies;
    affinity: the CPUs this process may run on (None: `os.sched_getaffinity(0)`);
    gpu: this rank's GPU and the GPUs it reaches fast, as `GpuLinks` (None: asked of NVML or
    CUDA where this process has initialized CUDA)."""

    sysfs_root: str = "/"
    affinity: Optional[FrozenSet[int]] = None
    gpu: Optional["GpuLinks"] = None


@dataclasses.dataclass(frozen=True)
class GpuLinks:
    """A GPU by its UUID, the GPUs (UUIDs, itself included) it reaches by NVLink or through a
    common PCIe switch, and those of them it reaches by NVLink (known from NVML only)."""

    uuid: str
    reaches: FrozenSet[str]
    nvlink: FrozenSet[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Place:
    """One rank's report: CPU packages and NUMA nodes of its CPUs (empty: unknown), its GPU."""

    packages: tuple = ()
    numa_nodes: tuple = ()
    gpu: Optional[GpuLinks] = None

    def to_json(self) -> str:
        gpu = None if self.gpu is None else {"uuid": self.gpu.uuid, "reaches": sorted(self.gpu.reaches),
                                             "nvlink": sorted(self.gpu.nvlink)}
        return json.dumps({"packages": list(self.packages), "numa_nodes": list(self.numa_nodes), "gpu": gpu})

    @classmethod
    def from_json(cls, text: str) -> "Place":
        d = json.loads(text)
        gpu = None if d["gpu"] is None else GpuLinks(d["gpu"]["uuid"], frozenset(d["gpu"]["reaches"]),
                                                     frozenset(d["gpu"]["nvlink"]))
        return cls(tuple(d["packages"]), tuple(d["numa_nodes"]), gpu)

    def __str__(self) -> str:
        cpu = (f"CPU package {_ids(self.packages)}, NUMA node {_ids(self.numa_nodes)}"
               if self.numa_nodes else "no NUMA information")
        return cpu + (f", GPU {self.gpu.uuid}" if self.gpu else "")


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """The groups of one device type and why: `basis` is the level they follow ("CPU package",
    "NUMA node", "GPU link domain"), "halves" (TF's rule) or "given" (the user's groups)."""

    groups: List[List[int]]
    basis: str
    reason: str

    def __str__(self) -> str:
        return f"groups {self.groups} by {self.basis}: {self.reason}"


def detect(machine: Optional[Machine] = None) -> Place:
    """This process's place on its node."""
    machine = machine or MACHINE()
    affinity = set(os.sched_getaffinity(0) if machine.affinity is None else machine.affinity)
    sysfs = Path(machine.sysfs_root) / "sys/devices/system"
    node_cpus = {int(d.name[4:]): _cpulist(d / "cpulist") for d in sysfs.glob("node/node[0-9]*")}
    numa_nodes = tuple(sorted(n for n, cpus in node_cpus.items() if cpus & affinity))
    packages = [_read_int(sysfs / f"cpu/cpu{cpu}/topology/physical_package_id") for cpu in sorted(affinity)]
    packages = () if None in packages else tuple(sorted(set(packages)))
    return Place(packages, numa_nodes, machine.gpu if machine.gpu is not None else _gpu_links())


MACHINE: Callable[[], Machine] = Machine  # what `detect` reads by default; tests replace it with a fake machine


def cpu_hierarchy(places: Sequence[Place]) -> Hierarchy:
    """Ranks grouped by CPU package where the ranks span several, else by NUMA node."""
    return _hierarchy([[list(p.packages), list(p.numa_nodes)] for p in places], CPU_LEVELS)


def gpu_hierarchy(places: Sequence[Place]) -> Hierarchy:
    """Ranks grouped by cliques of GPUs that reach each other by NVLink or a PCIe switch; one group
    where every rank has a GPU of its own and all of them form one clique (an NVSwitch node, one
    PCIe switch): every GPU reaches every other at once, so TF's halves would only add steps."""
    kind = clique_kind(places)
    if kind is not None:
        return Hierarchy([list(range(len(places)))], GPU_LEVELS[0],
                         f"every rank has a GPU of its own, and each reaches every other's over {kind}: one group")
    gpus = list(dict.fromkeys(p.gpu.uuid for p in places if p.gpu is not None))
    reaches: Dict[str, set] = {g: set() for g in gpus}
    for p in places:
        if p.gpu is not None:
            reaches[p.gpu.uuid] |= p.gpu.reaches
    linked = [[a == b or (b in reaches[a] and a in reaches[b]) for b in gpus] for a in gpus]
    clique = dict(zip(gpus, _C.link_cliques(linked)))
    return _hierarchy([[[clique[p.gpu.uuid]] if p.gpu is not None else []] for p in places], GPU_LEVELS)


def clique_kind(places: Sequence[Place]) -> Optional[str]:
    """ "nvlink" or "pcie" where at least two ranks each report a GPU of their own and every GPU reaches
    every other (both ends say so), by NVLink between every pair or else (some pair by PCIe, or the
    kind unknown without NVML) "pcie"; None otherwise."""
    if len(places) < 2 or any(p.gpu is None for p in places) or len({p.gpu.uuid for p in places}) < len(places):
        return None
    gpus = [p.gpu for p in places]
    if not all(b.uuid in a.reaches for a in gpus for b in gpus):
        return None
    return "nvlink" if all(b.uuid in a.nvlink for a in gpus for b in gpus if a is not b) else "pcie"


# Link layouts a user can name to see a plan without the machine (`explain(links=...)`): each GPU's
# GPUs by position among the distinct ones, (reached, over NVLink), as NVML would report them.
LINK_LAYOUTS: Dict[str, Callable[[int, int, int], Tuple[bool, bool]]] = {
    "nvswitch": lambda a, b, n: (True, True),  # every GPU on one NVSwitch fabric
    "pcie": lambda a, b, n: (True, False),  # every GPU under one PCIe switch, with P2P
    "pcie-switches": lambda a, b, n: ((a < n // 2) == (b < n // 2), False),  # two switches, no P2P across
    "dgx1": lambda a, b, n: ((a // 4 == b // 4 or abs(a - b) == 4),) * 2,  # DGX-1's NVLink hybrid cube mesh
}


def layout_places(gpus: Sequence[str], links: str) -> List[Place]:
    """The places of ranks on `gpus` (each rank's GPU, as text) in the link layout named `links`
    (LINK_LAYOUTS), the GPUs in the order of their numbers: what those ranks would report."""
    if links not in LINK_LAYOUTS:
        raise ValueError(f"links: expected one of {', '.join(LINK_LAYOUTS)}, got {links!r}")
    distinct = sorted(set(gpus), key=lambda g: (0, int(g), "") if g.isdigit() else (1, 0, g))  # GPU 0 first
    if links == "dgx1" and len(distinct) != 8:
        raise ValueError(f"links='dgx1': a DGX-1 has 8 GPUs, the ranks name {len(distinct)}")
    n = len(distinct)
    pairs = {(a, b): LINK_LAYOUTS[links](i, j, n) if a != b else (True, False)
             for i, a in enumerate(distinct) for j, b in enumerate(distinct)}
    return [Place(gpu=GpuLinks(g, frozenset(b for b in distinct if pairs[g, b][0]),
                               frozenset(b for b in distinct if pairs[g, b][1]))) for g in gpus]


def resolve(groups, store=None, rank=0, size=1, timeout_ms=0, places: Optional[Sequence[Place]] = None):
    """(CPU hierarchy, CUDA hierarchy, places) for `Options.groups`: the user's groups, TF's
    halves, or ("auto") from the places the ranks report through `store` (or the `places` given;
    places is None unless "auto")."""
    if not isinstance(groups, str):
        given = Hierarchy([list(g) for g in groups], "given", "the groups option")
        return given, given, None
    if groups == "halves":
        halves = Hierarchy(_C.default_groups(size), "halves", "groups='halves' (TF's rule)")
        return halves, halves, None
    if places is None:
        reports = _C.exchange_reports(store, "place", rank, size, detect().to_json(), timeout_ms)
        places = [Place.from_json(r) for r in reports]
    return cpu_hierarchy(places), gpu_hierarchy(places), list(places)


def describe(cpu: Hierarchy, cuda: Hierarchy, places: Optional[Sequence[Place]]) -> str:
    """What `torch_hca.hierarchy` returns, as stored on the backend."""
    return json.dumps({"cpu": dataclasses.asdict(cpu), "cuda": dataclasses.asdict(cuda),
                       "places": None if places is None else [str(p) for p in places],
                       "gpu_sharing": gpu_sharing(places or ())})


def gpu_sharing(places: Sequence[Place], environ=None) -> Optional[str]:
    """Which ranks share a GPU, and how their processes run on it: under MPS where its control
    daemon's pipe is there (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps: hca starts no daemon),
    else taking turns (time-slicing), where each wait of one rank for another is a switch between
    contexts; None where no two ranks reported the same GPU."""
    environ = os.environ if environ is None else environ
    ranks_of: Dict[str, List[int]] = {}
    for rank, p in enumerate(places):
        if p.gpu is not None:
            ranks_of.setdefault(p.gpu.uuid, []).append(rank)
    shared = [(uuid, ranks) for uuid, ranks in ranks_of.items() if len(ranks) > 1]
    if not shared:
        return None
    pipes = environ.get("CUDA_MPS_PIPE_DIRECTORY", "").strip() or "/tmp/nvidia-mps"
    how = (f"under MPS (its control daemon's pipe is in {pipes})" if os.path.exists(os.path.join(pipes, "control"))
           else f"taking turns (time-slicing: no MPS control daemon's pipe in {pipes})")
    return "; ".join(f"ranks {_ids(ranks)} share GPU {uuid}" for uuid, ranks in shared) + ", " + how


def _hierarchy(places, level_names) -> Hierarchy:
    groups, level, reason = _C.groups_from_places(places, list(level_names))
    return Hierarchy(groups, level_names[level] if level >= 0 else "halves", reason)


def _gpu_links() -> Optional[GpuLinks]:
    """This rank's GPU where the process has initialized CUDA (torch.cuda.set_device does):
    asking otherwise would create a CUDA context in CPU-only jobs."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    device = torch.cuda.current_device()

    def uuid_of(d):
        return _bare_uuid(torch.cuda.get_device_properties(d).uuid)

    links = _nvml_links(uuid_of(device))
    if links is None:  # NVML cannot tell: CUDA's ranking of the links among the GPUs this process sees
        if not _C.has_cuda:
            return None
        count = torch.cuda.device_count()
        ranks = {(a, b): _C.peer_performance_rank(a, b) for a in range(count) for b in range(count) if a != b}
        links = {uuid_of(d): "unknown" for d in fastest_peers(device, ranks)}
    return GpuLinks(uuid_of(device), frozenset(links.keys() | {uuid_of(device)}),
                    frozenset(g for g, kind in links.items() if kind == "nvlink"))


def fastest_peers(device: int, ranks: Dict[tuple, Optional[int]]) -> set:
    """The devices `device` reaches over the fastest kind of link there is among them: `ranks`
    holds CUDA's performance rank of each ordered pair of devices (lower is faster; None: no peer
    access). Every rank judges against the same best rank, so the links it finds agree."""
    known = [r for r in ranks.values() if r is not None]
    if not known:
        return set()
    best = min(known)
    return {b for (a, b), r in ranks.items() if a == device and r == best and ranks.get((b, a)) == best}


def _nvml_links(uuid: str) -> Optional[Dict[str, str]]:
    """The other GPUs NVML sees linked to `uuid`, each with how: "nvlink", or "pcie" under a common
    PCIe switch; None where NVML cannot tell (no binding, or a query it does not support, as in a
    virtual machine)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = {_bare_uuid(pynvml.nvmlDeviceGetUUID(h)): h
                   for h in map(pynvml.nvmlDeviceGetHandleByIndex, range(pynvml.nvmlDeviceGetCount()))}
        mine = handles[uuid]
        links = {}
        for other, h in handles.items():
            if other == uuid:
                continue
            if pynvml.nvmlDeviceGetP2PStatus(mine, h, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK:
                links[other] = "nvlink"
            elif pynvml.nvmlDeviceGetTopologyCommonAncestor(mine, h) <= pynvml.NVML_TOPOLOGY_MULTIPLE:
                links[other] = "pcie"
        return links
    except (pynvml.NVMLError, KeyError):
        return None
    finally:
        pynvml.nvmlShutdown()


def _bare_uuid(uuid) -> str:
    """A GPU's UUID as text without NVML's "GPU-" prefix (torch prints it without)."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.removeprefix("GPU-")


def _cpulist(path: Path) -> set:
    """A sysfs CPU list ("0-3,8-11") as a set."""
    cpus = set()
    for part in path.read_text().strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _ids(ids) -> str:
    return ",".join(map(str, ids)) or "?"


def hierarchy(group=None) -> Dict[str, object]:
    """The hierarchy an `hca` process group (default: the world) found at init:
    {"cpu": Hierarchy, "cuda": Hierarchy, "places": each rank's place in words, or None where
    groups were given or "halves", "gpu_sharing": which ranks share a GPU and whether under MPS or
    taking turns (gpu_sharing), or None (none do, or unknown at init), "staging": {"cpu": ..., "cuda": ...}: where each device's
    tensors are staged, in words, or None until the group's first collective on that device sets
    it up (CUDA's: GPU memory by CUDA IPC, or host shared memory where a rank cannot map a peer's
    GPU or its mapping failed, and why; with fewer or smaller slots where /dev/shm is short),
    "staging_slot_bytes": {"cpu": ..., "cuda": ...}: the bytes of a rank's staging slot, which
    cut larger packs into rounds, or None while "staging" is, "cost_model": {"cpu": ..., "cuda": ...}:
    the `torch_hca.costs.CostModel` that chooses each device's all-reduces per call, or None where
    nothing is chosen (CUDA's: None until the group's first collective on CUDA tensors found every
    rank's on one GPU)}. Across nodes: this rank's node's group."""
    import torch
    import torch.distributed as dist

    backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    if isinstance(backend, _C.NodeBackend):
        backend = backend.local
    if not isinstance(backend, _C.ProcessGroupHCA):
        raise ValueError(f"hierarchy: the group's backend is {type(backend).__name__}; only hca's own algorithms "
                         "(hierarchical_copy, reduce_to_one_device) have one")
    d = json.loads(backend.hierarchy)
    # The groups as the plans use them (the backend's), the rest as found at init.
    return {"cpu": dataclasses.replace(Hierarchy(**d["cpu"]), groups=backend.groups(cuda=False)),
            "cuda": dataclasses.replace(Hierarchy(**d["cuda"]), groups=backend.groups(cuda=True)),
            "places": d["places"],
            "gpu_sharing": d.get("gpu_sharing"),
            "staging": {device: backend.staging(cuda=device == "cuda") or None for device in ("cpu", "cuda")},
            "staging_slot_bytes": {device: backend.staging_slot_bytes(cuda=device == "cuda") or None
                                   for device in ("cpu", "cuda")},
            "cost_model": _cost_models(backend)}


def _cost_models(backend) -> Dict[str, Optional[CostModel]]:
    models = {"cpu": json.loads(backend.cpu_cost_model), "cuda": json.loads(backend.cuda_cost_model)}
    return {device: CostModel.from_json(model) if model else None for device, model in models.items()}
