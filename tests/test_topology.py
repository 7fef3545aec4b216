"""groups="auto": the hierarchy from where the ranks run, on fake machines (sysfs trees, affinity
masks, GPU link tables), and every collective checked under each detected hierarchy."""
from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torch_hca
from torch_hca import topology
from torch_hca.topology import GpuLinks, Machine, Place

from harness import SMALL_CHUNKS, run_ranks
from reference import all_gather_single, make_input, mismatch, reduce_reference, reduce_scatter_single


def fake_sysfs(root: Path, node_cpus, package_of_node):
    """A sysfs tree: NUMA node n holds CPUs node_cpus[n]; its CPUs sit in package package_of_node[n]."""
    system = root / "sys/devices/system"
    for node, cpus in enumerate(node_cpus):
        (system / f"node/node{node}").mkdir(parents=True)
        (system / f"node/node{node}/cpulist").write_text(_cpulist(cpus) + "\n")
        for cpu in cpus:
            (system / f"cpu/cpu{cpu}/topology").mkdir(parents=True)
            (system / f"cpu/cpu{cpu}/topology/physical_package_id").write_text(f"{package_of_node[node]}\n")
    return str(root)


def _cpulist(cpus):
    """sysfs's form: ranges of consecutive CPUs ("0-3,8")."""
    cpus, parts = sorted(cpus), []
    start = prev = cpus[0]
    for c in cpus[1:] + [None]:
        if c != prev + 1 if c is not None else True:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = c
        prev = c
    return ",".join(parts)


# Machines, as (CPUs of each NUMA node, package of each node).
TWO_SOCKETS_X2 = ([range(0, 4), range(4, 8), range(8, 12), range(12, 16)], [0, 0, 1, 1])  # 2 sockets x 2 nodes
FOUR_NODES = ([range(0, 4), range(4, 8), range(8, 12), range(12, 16)], [0, 0, 0, 0])      # one socket, 4 nodes
UNEVEN = ([range(0, 6), range(6, 8)], [0, 1])                                             # 6 + 2 CPUs
ONE_NODE = ([range(0, 8)], [0])


def machine_root(tmp_path, machine):
    node_cpus, packages = machine
    return fake_sysfs(tmp_path / "m", [list(c) for c in node_cpus], packages)


# (name, machine, each rank's CPUs, expected CPU groups, expected basis)
CASES = [
    ("2 sockets x 2 nodes, ranks alternate sockets", TWO_SOCKETS_X2,
     [[0], [8], [1], [9], [4], [12], [5], [13]], [[0, 2, 4, 6], [1, 3, 5, 7]], "CPU package"),
    ("4 nodes of one socket, 8 ranks", FOUR_NODES,
     [[r % 4 * 4 + r // 4] for r in range(8)], [[0, 4], [1, 5], [2, 6], [3, 7]], "NUMA node"),
    ("uneven nodes", UNEVEN, [[0], [1], [6], [2], [7]], [[0, 1, 3], [2, 4]], "CPU package"),
    ("ranks pinned across two nodes", FOUR_NODES,
     [range(0, 8), range(8, 16), range(0, 8), range(8, 16)], [[0, 2], [1, 3]], "NUMA node"),
    ("unpinned ranks", TWO_SOCKETS_X2, [range(16)] * 4, [[0, 1], [2, 3]], "halves"),
    ("some ranks unpinned", TWO_SOCKETS_X2, [[0], [8], range(16)], [[0, 1, 2]], "halves"),
    ("one NUMA node", ONE_NODE, [[0], [1], [2], [3], [4]], [[0, 1], [2, 3, 4]], "halves"),
]


@pytest.mark.parametrize("name,machine,cpus,groups,basis", CASES, ids=[c[0] for c in CASES])
def test_cpu_groups_from_fake_machines(tmp_path, name, machine, cpus, groups, basis):
    root = machine_root(tmp_path, machine)
    places = [topology.detect(Machine(root, frozenset(c))) for c in cpus]
    h = topology.cpu_hierarchy(places)
    assert (h.groups, h.basis) == (groups, basis), h.reason


def test_detect_reads_packages_nodes_and_no_information(tmp_path):
    root = machine_root(tmp_path, TWO_SOCKETS_X2)
    assert topology.detect(Machine(root, frozenset({3, 4}))) == Place((0,), (0, 1), None)
    assert topology.detect(Machine(root, frozenset({0, 15}))) == Place((0, 1), (0, 3), None)
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = topology.detect(Machine(str(empty), frozenset({0})))
    assert (nothing.packages, nothing.numa_nodes) == ((), ())
    h = topology.cpu_hierarchy([nothing] * 4)
    assert (h.groups, h.basis) == ([[0, 1], [2, 3]], "halves") and "rank 0 reported no NUMA node" in h.reason


def test_overlapping_places_keep_the_halves_and_say_why(tmp_path):
    root = machine_root(tmp_path, FOUR_NODES)
    places = [topology.detect(Machine(root, frozenset(c))) for c in ([0, 4], [1], [8], [12])]
    h = topology.cpu_hierarchy(places)
    assert h.basis == "halves"
    assert "rank 1 runs on NUMA node 0 and rank 0 on NUMA node 0,1, which overlap" in h.reason, h.reason


def test_this_machine_is_detected():
    """Whatever this machine is, detection runs on its real sysfs and gives a partition."""
    place = topology.detect()
    assert place.numa_nodes, "this machine's sysfs names no NUMA node for this process"
    h = topology.cpu_hierarchy([place] * 4)
    assert h.groups == [[0, 1], [2, 3]] and h.basis == "halves"


def _dgx1():
    """DGX-1's NVLink hybrid cube mesh: quads fully linked, GPU i linked to i + 4."""
    return [[a // 4 == b // 4 or abs(a - b) == 4 for b in range(8)] for a in range(8)]


def _gpu_places(linked, gpu_of_rank):
    uuids = [f"gpu{i}" for i in range(len(linked))]
    links = [GpuLinks(uuids[i], frozenset(u for j, u in enumerate(uuids) if linked[i][j])) for i in range(len(linked))]
    return [Place(gpu=None if g is None else links[g]) for g in gpu_of_rank]


GPU_CASES = [
    ("DGX-1 cube mesh", _dgx1(), list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]], "GPU link domain"),
    ("DGX-1, ranks interleaved", _dgx1(), [0, 4, 1, 5, 2, 6, 3, 7], [[0, 2, 4, 6], [1, 3, 5, 7]], "GPU link domain"),
    ("two PCIe switches, 2 ranks a GPU", [[a // 2 == b // 2 for b in range(4)] for a in range(4)],
     [0, 0, 1, 1, 2, 2, 3, 3], [[0, 1, 2, 3], [4, 5, 6, 7]], "GPU link domain"),
    ("NVSwitch: every GPU linked", [[True] * 4 for _ in range(4)], [0, 1, 2, 3], [[0, 1, 2, 3]], "GPU link domain"),
    ("every GPU linked, two ranks on one", [[True] * 3 for _ in range(3)], [0, 1, 2, 2], [[0, 1], [2, 3]], "halves"),
    ("several ranks on one GPU", [[True]], [0, 0, 0], [[0, 1, 2]], "halves"),
    ("a rank without GPU information", _dgx1(), [0, 1, 4, None], [[0, 1], [2, 3]], "halves"),
    ("no links at all", [[a == b for b in range(3)] for a in range(3)], [0, 1, 2], [[0], [1], [2]],
     "GPU link domain"),
]


@pytest.mark.parametrize("name,linked,gpu_of_rank,groups,basis", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_groups_from_link_tables(name, linked, gpu_of_rank, groups, basis):
    h = topology.gpu_hierarchy(_gpu_places(linked, gpu_of_rank))
    assert (h.groups, h.basis) == (groups, basis), h.reason


def test_a_link_one_side_reports_is_not_a_link():
    linked = [[True, True], [False, True]]
    assert topology.gpu_hierarchy(_gpu_places(linked, [0, 1])).groups == [[0], [1]]


def _ranked(kind_of_pair, count):
    """A table of CUDA performance ranks: kind_of_pair(a, b) -> "nvlink" (0), "pcie" (1) or None."""
    return {(a, b): {"nvlink": 0, "pcie": 1, None: None}[kind_of_pair(a, b)]
            for a in range(count) for b in range(count) if a != b}


PEER_RANK_CASES = [
    # DGX-1: NVLink inside quads and to i + 4, PCIe peer access otherwise
    ("DGX-1", _ranked(lambda a, b: "nvlink" if a // 4 == b // 4 or abs(a - b) == 4 else "pcie", 8),
     {0: {1, 2, 3, 4}, 5: {1, 4, 6, 7}}),
    # PCIe only: every link is the fastest there is
    ("PCIe only", _ranked(lambda a, b: "pcie", 4), {0: {1, 2, 3}}),
    # two switches, no peer access across them
    ("two switches", _ranked(lambda a, b: "pcie" if a // 2 == b // 2 else None, 4), {0: {1}, 3: {2}}),
    ("no peer access", _ranked(lambda a, b: None, 3), {0: set(), 2: set()}),
    # a link only one side ranks fast is not taken
    ("one-sided", {(0, 1): 0, (1, 0): 1, (0, 2): 1, (2, 0): 1, (1, 2): 1, (2, 1): 1}, {0: set(), 1: set()}),
]


@pytest.mark.parametrize("name,ranks,want", PEER_RANK_CASES, ids=[c[0] for c in PEER_RANK_CASES])
def test_without_nvml_the_fastest_ranked_cuda_links_count(name, ranks, want):
    for device, peers in want.items():
        assert topology.fastest_peers(device, ranks) == peers, device


class _FakeNvml:
    """pynvml on a machine of `count` GPUs, NVLink between all (or, `nvlink=False`, one PCIe switch),
    where NVML supports no topology query of a GPU with itself (seen on an H200 VM) or none at all
    (`topology=False`)."""

    class NVMLError(Exception):
        pass

    NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK, NVML_TOPOLOGY_MULTIPLE = 0, 0, 20

    def __init__(self, count, topology=True, nvlink=True):
        self.count, self.topology, self.nvlink = count, topology, nvlink

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}".encode()

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if a == b or not self.topology:
            raise self.NVMLError("Not Supported")
        return self.NVML_P2P_STATUS_OK if self.nvlink else 1

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        if a == b or not self.topology:
            raise self.NVMLError("Not Supported")
        return 10


def test_nvml_links_leave_out_the_gpu_itself_and_unsupported_queries_fall_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(3))
    assert topology._nvml_links("1") == {"0": "nvlink", "2": "nvlink"}
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(3, nvlink=False))
    assert topology._nvml_links("1") == {"0": "pcie", "2": "pcie"}
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(3, topology=False))
    assert topology._nvml_links("1") is None  # CUDA's link ranking decides instead
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert topology._nvml_links("1") is None


@pytest.mark.parametrize("shared_out", [True, False])
def test_each_rank_reserves_its_own_share_of_staging_memory(shared_out):
    """Staging memory on the right node: with a share per rank (as the staging slots have), rank 0
    reserves only its own share and each rank then its own, so the kernel takes each rank's pages
    from the NUMA node that rank runs on; without shares rank 0 reserves everything. Seen as the
    segment's allocated bytes as the ranks join one by one (3 ranks)."""
    share = 1 << 20
    store = dist.HashStore()
    join = functools.partial(torch_hca._C._join_shared_segment, store, "seg", world=3, bytes=3 * share,
                             layout="test", timeout_ms=20_000, share_bytes=share if shared_out else 0)
    creator = threading.Thread(target=join, kwargs={"rank": 0})
    creator.start()
    store.wait(["seg"])
    name = store.get("seg").decode().split("\n")[1]
    fd = os.open(f"/dev/shm{name}", os.O_RDONLY)  # kept open: rank 0 unlinks the name once all joined
    try:
        allocated = [os.fstat(fd).st_blocks * 512]
        for rank in (1, 2):
            join(rank=rank)
            allocated.append(os.fstat(fd).st_blocks * 512)
    finally:
        os.close(fd)
        creator.join()
    assert allocated == ([share, 2 * share, 3 * share] if shared_out else [3 * share] * 3)


def test_places_travel_as_json():
    place = Place((0, 1), (2,), GpuLinks("abc", frozenset({"abc", "def"}), frozenset({"def"})))
    assert Place.from_json(place.to_json()) == place


def test_groups_option_names_and_environment():
    assert torch_hca.Options().groups == "auto" and torch_hca.Options(groups=None).groups == "auto"
    assert torch_hca.Options.from_env({"TORCH_HCA_GROUPS": "halves"}).groups == "halves"
    assert torch_hca.Options.from_env({"TORCH_HCA_GROUPS": "0,1;2"}).groups == ((0, 1), (2,))
    with pytest.raises(ValueError, match="groups: unknown rule 'sockets'"):
        torch_hca.Options(groups="sockets")


def test_explain_shows_the_groups_of_given_numa_nodes():
    plan = torch_hca.explain(4, num_packs=4, numa_nodes=[[0], [1], [0], [1]], numels=[64])
    assert plan.hierarchy.groups == [[0, 2], [1, 3]] and plan.hierarchy.basis == "NUMA node"
    assert "ranks 0,2 on NUMA node 0" in plan.text
    assert [sorted({s for step in p["steps"] for _, s, _ in step} | {d for step in p["steps"] for *_, d in step})
            for p in plan.packs] == [[0, 1, 2, 3]] * 4
    halves = torch_hca.explain(4, numels=[64])
    assert halves.hierarchy.basis == "halves"


LAYOUT_CASES = [  # links, each rank's GPU, the groups, the kind of the clique (None: none)
    ("nvswitch", list(range(8)), [list(range(8))], "nvlink"),
    ("pcie", list(range(4)), [[0, 1, 2, 3]], "pcie"),
    ("pcie-switches", list(range(4)), [[0, 1], [2, 3]], None),
    ("dgx1", list(range(8)), [[0, 1, 2, 3], [4, 5, 6, 7]], None),
    ("dgx1", [4, 0, 5, 1, 6, 2, 7, 3], [[0, 2, 4, 6], [1, 3, 5, 7]], None),
    ("nvswitch", [0, 0, 1, 1], [[0, 1], [2, 3]], None),  # two ranks a GPU: not a GPU each
]


@pytest.mark.parametrize("links,gpus,groups,kind", LAYOUT_CASES)
def test_named_link_layouts_give_their_groups(links, gpus, groups, kind):
    """An NVSwitch node or one PCIe switch, a GPU a rank: one group (not TF's halves); the DGX-1's
    cube mesh: its two quads (TF's hierarchy, what it was made for), however the ranks are ordered;
    two PCIe switches: one group per switch."""
    places = topology.layout_places([str(g) for g in gpus], links)
    h = topology.gpu_hierarchy(places)
    assert (h.groups, topology.clique_kind(places)) == (groups, kind), h.reason
    assert h.basis == ("halves" if links == "nvswitch" and kind is None else "GPU link domain"), h


def _leaders_and_steps(plan):
    return plan.leaders(), [len(p["steps"]) for p in plan.packs]


def test_explain_on_an_nvswitch_node_chooses_one_shot_then_two_shot_predicted():
    """8 GPUs on NVSwitch: direct (one-shot: one step, every rank sums all) for small all-reduces,
    a pack per rank led by its own rank in one group (two-shot: reduce a share, then copy it to all)
    for large; the choice comes from the link model and says it is predicted."""
    gpus = list(range(8))
    small = torch_hca.explain(8, device="cuda", gpus=gpus, links="nvswitch", numels=[256])
    large = torch_hca.explain(8, device="cuda", gpus=gpus, links="nvswitch", numels=[1 << 22])
    assert (small.chosen, large.chosen) == ("direct", "pack_per_rank")
    assert [len(step) for step in small.packs[0]["steps"]] == [8 * 7] and len(small.packs) == 1
    assert _leaders_and_steps(large) == (list(range(8)), [2] * 8)
    assert "(predicted, not measured)" in small.cost_model.origin and small.hierarchy.groups == [gpus]
    dgx1 = torch_hca.explain(8, device="cuda", gpus=gpus, links="dgx1", numels=[256])
    assert dgx1.chosen is None and _leaders_and_steps(dgx1) == ([0], [4])  # TF's: one pack over the quads
    with pytest.raises(ValueError, match="links: expected one of nvswitch, pcie, pcie-switches, dgx1, got 'ring'"):
        torch_hca.explain(4, device="cuda", gpus=[0, 1, 2, 3], links="ring")


# --- every collective under each detected hierarchy, on real ranks ---------------------------------

def _fake_machine(root, cpus, gpu_links, rank):
    """Runs in each rank before init: detection reads the fake machine."""
    links = None if gpu_links is None else gpu_links[rank]
    topology.MACHINE = lambda: Machine(root, frozenset(cpus[rank]), links)


def _collectives(rank, world, groups, basis, cuda_groups):
    """The hierarchy found, then allreduce (several packs), reduce and broadcast from every root,
    allgather and reduce_scatter, each checked against a float64 reference."""
    errors = []
    found = torch_hca.hierarchy()
    if (found["cpu"].groups, found["cpu"].basis) != (groups, basis):
        errors.append(f"world group: {found['cpu']}")
    if cuda_groups is not None and found["cuda"].groups != cuda_groups:
        errors.append(f"CUDA groups: {found['cuda']}")
    case = 0
    for options in (torch_hca.Options(num_packs=world + 1), torch_hca.Options("reduce_to_one_device", num_packs=2)):
        group = dist.new_group(backend="hca", pg_options=options)
        if torch_hca.hierarchy(group)["cpu"].groups != groups:
            errors.append(f"{options}: {torch_hca.hierarchy(group)['cpu']}")
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for numel in (1, 50_001):
                case += 1
                inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
                t = inputs[rank].clone()
                dist.all_reduce(t, group=group)
                errors.append(mismatch(f"all_reduce {dtype} {numel}", t, reduce_reference(inputs, "SUM"), world))
                for root in range(world):
                    t = inputs[rank].clone()
                    dist.reduce(t, dst=root, group=group)
                    want = reduce_reference(inputs, "SUM") if rank == root else inputs[rank]
                    errors.append(mismatch(f"reduce {dtype} {numel} dst={root}", t, want, world))
                    t = inputs[rank].clone()
                    dist.broadcast(t, src=root, group=group)
                    errors.append(mismatch(f"broadcast {dtype} {numel} src={root}", t, inputs[root], world))
                flat = torch.empty(numel * world, dtype=dtype)
                all_gather_single(flat, inputs[rank], group=group)
                errors.append(mismatch(f"all_gather {dtype} {numel}", flat, torch.cat(inputs), world))
                big = [make_input(case + 100, r, numel * world, dtype, "SUM") for r in range(world)]
                out = torch.empty(numel, dtype=dtype)
                reduce_scatter_single(out, big[rank], group=group)
                want = reduce_reference(big, "SUM")[rank * numel:(rank + 1) * numel]
                errors.append(mismatch(f"reduce_scatter {dtype} {numel}", out, want, world))
        dist.destroy_process_group(group)
    return [e for e in errors if e]


RANK_CASES = [c for c in CASES if c[0] in ("2 sockets x 2 nodes, ranks alternate sockets",
                                           "4 nodes of one socket, 8 ranks", "uneven nodes",
                                           "ranks pinned across two nodes", "some ranks unpinned")]


@pytest.mark.parametrize("name,machine,cpus,groups,basis", RANK_CASES, ids=[c[0] for c in RANK_CASES])
def test_every_collective_under_the_detected_hierarchy(tmp_path, name, machine, cpus, groups, basis):
    root = machine_root(tmp_path, machine)
    world = len(cpus)
    gpu_links = None
    cuda_groups = None
    if world == 8:  # and a GPU link table for CUDA tensors: the ranks interleaved on a DGX-1
        places = _gpu_places(_dgx1(), [0, 4, 1, 5, 2, 6, 3, 7])
        gpu_links, cuda_groups = [p.gpu for p in places], [[0, 2, 4, 6], [1, 3, 5, 7]]
    setup = functools.partial(_fake_machine, root, [list(c) for c in cpus], gpu_links)
    assert run_ranks(_collectives, world, groups, basis, cuda_groups, env=SMALL_CHUNKS, before_init=setup,
                     deadline_s=400) == [[]] * world


def _hierarchy_named(rank, world):
    found = torch_hca.hierarchy()
    return [str(found["cpu"].basis), found["places"], found["staging"]]


@pytest.mark.parametrize("env,basis", [({}, "halves"), ({"TORCH_HCA_GROUPS": "halves"}, "halves"),
                                       ({"TORCH_HCA_GROUPS": "0,2;1"}, "given")])
def test_this_machine_and_the_named_rules(env, basis):
    """On this machine (one NUMA node here) auto keeps the halves and says why."""
    got = run_ranks(_hierarchy_named, 3, env=env)
    assert [g[0] for g in got] == [basis] * 3
    assert (got[0][1] is None) == bool(env)
    # The shared-memory executor's staging is there from init; CUDA's waits for a CUDA collective.
    assert got[0][2] == {"cpu": "host shared memory (a POSIX segment every rank maps)", "cuda": None}, got[0][2]


def test_ranks_sharing_a_gpu_are_said_to_take_turns_or_run_under_mps(tmp_path):
    """Ranks whose places name one GPU share it: under MPS where its control daemon's pipe is in
    CUDA_MPS_PIPE_DIRECTORY (or /tmp/nvidia-mps), else taking turns; ranks on GPUs of their own
    share nothing."""
    places = topology.layout_places(["0", "0", "1", "1", "2"], "nvswitch")
    turns = topology.gpu_sharing(places, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert turns == (f"ranks 0,1 share GPU 0; ranks 2,3 share GPU 1, taking turns (time-slicing: no MPS control "
                     f"daemon's pipe in {tmp_path})"), turns
    (tmp_path / "control").touch()
    mps = topology.gpu_sharing(places, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert mps.endswith(f", under MPS (its control daemon's pipe is in {tmp_path})"), mps
    assert topology.gpu_sharing(topology.layout_places(["0", "1"], "nvswitch"), {}) is None
    assert topology.gpu_sharing([Place(), Place()], {}) is None


def on_gpus(gpus, rank):
    """Runs in each rank before init: its GPU is gpus[rank], all on one NVSwitch."""
    topology.MACHINE = lambda: Machine(gpu=topology.layout_places(gpus, "nvswitch")[rank].gpu)


def _gpu_sharing(rank, world):
    return torch_hca.hierarchy()["gpu_sharing"]


def test_a_group_says_which_of_its_ranks_share_a_gpu():
    gpus = ["0", "0", "1"]
    got = run_ranks(_gpu_sharing, 3, before_init=functools.partial(on_gpus, gpus),
                    env={"CUDA_MPS_PIPE_DIRECTORY": "/nonexistent"})
    assert got == ["ranks 0,1 share GPU 0, taking turns (time-slicing: no MPS control daemon's pipe in "
                   "/nonexistent)"] * 3, got
