"""hca across nodes: the node level of the plan, then real runs, first with nodes named by
TORCH_HCA_NODE_ID on this host, then with each node in its own network and UTS namespace and
/dev/shm, then as containers of one host that do or do not share /dev/shm."""
import re
import socket
import time

import pytest
import torch
import torch.distributed as dist

import node_cases
import torch_hca
from harness import NCCL_SHARED_GPU_ENV, STREAMS_ENV, nccl_fits, raises, run_ranks
from netns import TwoHosts, mount_namespaces_unavailable, run_in_containers, unavailable
from reference import make_input, mismatch, reduce_reference
from torch_hca.backend import check_gloo_can_leave_this_host

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# ---------------------------------------------------------------- the plan's node level


def test_nodes_are_numbered_by_their_lowest_rank():
    members, leaders = torch_hca._C.nodes(["b", "a", "b", "a", "c"])
    assert members == [[0, 2], [1, 3], [4]]
    assert leaders == [[0, 1, 4], [2, 3, 4]]  # position p: local rank p % size on every node


def test_uneven_nodes_lead_from_every_rank_of_the_largest():
    _, leaders = torch_hca._C.nodes(["x", "x", "x", "y"])
    assert leaders == [[0, 3], [1, 3], [2, 3]]


def test_packs_rotate_over_leader_positions():
    plan = torch_hca.explain(4, num_packs=4, numels=(4000,), nodes=["a", "a", "b", "b"])
    assert plan.nodes == [[0, 1], [2, 3]]
    assert [p["leaders"] for p in plan.packs] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert sum(p["numel"] for p in plan.packs) == 4000
    assert "between nodes: all-reduce among ranks 1, 3" in plan.text
    assert "step 1: reduce 0->1" in plan.text  # the reduction inside node 0 for pack 1, in global ranks


def test_reduce_to_one_device_keeps_the_position_of_its_device():
    plan = torch_hca.explain(5, "reduce_to_one_device", num_packs=3, reduce_to_device=4, numels=(99,),
                             nodes=["a", "b", "a", "b", "b"])
    assert [p["leaders"] for p in plan.packs] == [[0, 4]] * 3  # rank 4 is local rank 2: rank 0 on the node of two


def test_one_node_is_the_plain_plan():
    plan = torch_hca.explain(4, nodes=["a"] * 4)
    assert isinstance(plan, torch_hca.Plan)


@pytest.mark.parametrize("call, message", [
    (lambda: torch_hca._C.nodes([]), "nodes: a group needs at least one rank"),
    (lambda: torch_hca._C.nodes(["a", ""]), "nodes: rank 1 has an empty node id"),
    (lambda: torch_hca.explain(3, nodes=["a", "b"]), "nodes: 2 node ids for a world of 3 ranks"),
    (lambda: torch_hca.explain(4, groups=[[0, 1], [2, 3]], nodes=["a", "a", "b", "b"]),
     "groups: explicit groups cannot span 2 nodes"),
    (lambda: torch_hca.Options(inter_node_backend="mpi"), "inter_node_backend: unknown engine 'mpi'"),
])
def test_bad_node_options_are_value_errors(call, message):
    assert raises(call, ValueError).startswith(message)


# ---------------------------------------------------------------- nodes named by TORCH_HCA_NODE_ID

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "3+1": ["a", "a", "a", "b"],
    "interleaved": ["a", "b", "a", "b"],
    "1+1+1": ["a", "b", "c"],
    "3+2": ["a", "a", "a", "b", "b"],
}


def _node_env(ids, extra=None):
    """Each rank's environment: its node's identity, and `extra` (the same for every rank)."""
    return [{"TORCH_HCA_NODE_ID": i, **(extra or {})} for i in ids]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_collective_across_named_nodes(name):
    ids = LAYOUTS[name]
    world = len(ids)
    layouts = run_ranks(node_cases.layout, world, env_per_rank=_node_env(ids))
    members = [[r for r in range(world) if ids[r] == node] for node in dict.fromkeys(ids)]
    assert layouts == [("NodeBackend", members)] * world
    assert run_ranks(node_cases.allreduce_matrix, world, env_per_rank=_node_env(ids)) == [[]] * world
    assert run_ranks(node_cases.rooted_and_gathers, world, env_per_rank=_node_env(ids)) == [[]] * world


def test_reduce_to_one_device_across_named_nodes():
    ids = LAYOUTS["3+1"]
    got = run_ranks(node_cases.allreduce_matrix, 4, "reduce_to_one_device", (0, 2), env_per_rank=_node_env(ids))
    assert got == [[]] * 4


def test_the_coalescing_manager_across_named_nodes():
    """The window's Work (startCoalescing/endCoalescing) stands for the calls in it."""
    from test_collectives import _coalescing_manager
    assert run_ranks(_coalescing_manager, 4, "cpu", env_per_rank=_node_env(LAYOUTS["3+1"])) == [[]] * 4


def test_one_named_node_is_todays_group():
    assert run_ranks(node_cases.layout, 3, env=dict(TORCH_HCA_NODE_ID="n")) == [("ProcessGroupHCA", None)] * 3


def _refused(rank, world, options):
    return raises(lambda: dist.new_group(backend="hca", pg_options=torch_hca.Options(**options)), ValueError)


NCCL_USABLE = torch_hca._C.has_cuda and torch.cuda.is_available() and dist.is_nccl_available()


@pytest.mark.parametrize("options, message", [
    (dict(groups=[[0, 1], [2, 3]]), "groups: explicit groups cannot span 2 nodes"),
    (dict(algorithm="direct"), "algorithm: 'direct' reads every peer's memory, so it serves the ranks of one node"),
    pytest.param(dict(inter_node_backend="nccl"), "inter_node_backend: 'nccl' needs torch_hca built with CUDA, a GPU",
                 marks=pytest.mark.skipif(NCCL_USABLE, reason="NCCL is usable here")),
])
def test_options_that_cannot_span_nodes_fail_on_every_rank(options, message):
    got = run_ranks(_refused, 4, options, env_per_rank=_node_env(LAYOUTS["2x2"]))
    assert all(message in text for text in got), got


def _lists_of_several_sizes(rank, world):
    """A slot per rank of its own size, as NCCL takes them: they go whole to gloo over every rank
    (all_gather as a broadcast from each rank in turn), NaNs winning MAX; then calls of one size
    take the stages again."""
    sizes = [1 + 2 * r for r in range(world)]
    errors = []
    for dtype in (torch.float32, torch.int64):
        inputs = [make_input(7, r, sizes[r], dtype, "SUM") for r in range(world)]
        outs = [torch.zeros(n, dtype=dtype) for n in sizes]
        dist.all_gather(outs, inputs[rank].clone())
        errors += [mismatch(f"all_gather {dtype}, rank {r}'s slot", outs[r], inputs[r], 1) for r in range(world)]
        for case, op in enumerate(("SUM", "MAX", "PREMUL_SUM" if dtype.is_floating_point else "MIN")):
            lists = [[make_input(100 + 10 * case + r, j, sizes[j], dtype, "MAX" if op == "MAX" else "SUM")
                      for j in range(world)] for r in range(world)]
            if op == "MAX" and dtype.is_floating_point:
                for slot in lists[world - 1]:
                    slot[0] = float("nan")  # the last rank's NaNs win, in every slot
            reduce_op = dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
            out = torch.empty(sizes[rank], dtype=dtype)
            dist.reduce_scatter(out, [t.clone() for t in lists[rank]], op=reduce_op)
            mine = [lists[r][rank] for r in range(world)]
            want = (reduce_reference([t * 0.5 for t in mine], "SUM") if op == "PREMUL_SUM"
                    else reduce_reference(mine, op))
            if op == "MAX" and dtype.is_floating_point:
                errors.append(None if out[0].isnan() else f"reduce_scatter MAX: got {out[0].item()} for a NaN")
                out, want = out[1:], want[1:]
            errors.append(mismatch(f"reduce_scatter {op} {dtype}", out, want, world))
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    errors += [mismatch(f"all_gather of one size, rank {r}'s slot", outs[r], torch.full((2,), float(r)), 1)
               for r in range(world)]
    return [e for e in errors if e]


@pytest.mark.parametrize("layout", [["a", "b"], ["a", "b", "a", "b"], ["a", "a", "b"]], ids=["ab", "abab", "aab"])
def test_list_forms_with_a_size_per_rank_across_nodes(layout):
    assert run_ranks(_lists_of_several_sizes, len(layout), env_per_rank=_node_env(layout)) == [[]] * len(layout)


def _meta_tensor_refused(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return raises(lambda: backend.allreduce([torch.empty(4, device="meta")], dist.AllreduceOptions()),
                  NotImplementedError)


def test_a_device_this_build_cannot_carry_across_nodes_is_named():
    for message in run_ranks(_meta_tensor_refused, 2, env_per_rank=_node_env(["a", "b"])):
        assert message.startswith("hca allreduce: tensors on meta are not supported across nodes by this build "
                                  f"(CPU tensors are{', and CUDA tensors' if torch_hca._C.has_cuda else ''}"), message


@needs_cuda
@pytest.mark.parametrize("engine", ["gloo", "nccl"])
@pytest.mark.parametrize("name", ["2x2", "3+1"])
def test_cuda_tensors_across_named_nodes(name, engine):
    """hca's CUDA path inside each node, the named engine among the leaders (gloo through host
    copies), every result against float64 references; several ranks share the GPU."""
    ids = LAYOUTS[name]
    world = len(ids)
    if engine == "nccl" and not (NCCL_USABLE and nccl_fits(world)):
        pytest.skip("NCCL here cannot put several leaders on one GPU")
    env = _node_env(ids, NCCL_SHARED_GPU_ENV)
    assert run_ranks(node_cases.allreduce_matrix, world, "hierarchical_copy", (0, 2), "cuda", engine,
                     env_per_rank=env) == [[]] * world
    assert run_ranks(node_cases.rooted_and_gathers, world, "hierarchical_copy", "cuda", engine,
                     env_per_rank=env) == [[]] * world


def _stream_rules(rank, world):
    """test_model_device's checks of a device's stream rules on the world group across nodes, then
    the caller's kernel writing the inputs 0.15 s late before calls whose stages read them on the
    host: packing several tensors, and gloo among the leaders (a broadcast from the last rank)."""
    from test_model_device import _late_peer_calls, _user_kernel_before_the_call
    model = torch_hca._C._model
    wrong = _late_peer_calls(rank, world) + _user_kernel_before_the_call(rank, world)
    inputs = [[make_input(60 + i, r, 5_000 + i, torch.float32, "SUM") for i in range(3)] for r in range(world)]
    mine = [torch.zeros(5_000 + i) for i in range(3)]
    for t, given in zip(mine, inputs[rank]):
        model.enqueue_copy(t, given, 150)
    dist.all_reduce_coalesced(mine)
    for i, t in enumerate(mine):
        wrong.append(mismatch(f"all_reduce_coalesced after a kernel, tensor {i}", t,
                              reduce_reference([inputs[r][i] for r in range(world)], "SUM"), world))
    t = torch.zeros(5_000)
    model.enqueue_copy(t, inputs[rank][0], 150)
    dist.broadcast(t, src=world - 1)
    wrong.append(mismatch("broadcast after a kernel", t, inputs[world - 1][0], world))
    return [w for w in wrong if w] + _forwarded_after_a_kernel(rank, world)


def _forwarded_after_a_kernel(rank, world):
    """The operations a group across nodes hands whole to the engine over every rank (NCCL for
    CUDA tensors, which waits for the caller's stream; gloo on the model), each after the caller's
    kernel writes its inputs 0.15 s late."""
    model = torch_hca._C._model
    data = [make_input(70, r, 8 * world, torch.float32, "SUM") for r in range(world)]

    def late(r):
        t = torch.zeros(8 * world)
        model.enqueue_copy(t, data[r], 150)
        return t

    wrong = []
    gathered = [torch.zeros(8 * world) for _ in range(world)] if rank == 0 else None
    dist.gather(late(rank), gathered, dst=0)
    if rank == 0:
        wrong.append(mismatch("gather after a kernel", torch.cat(gathered), torch.cat(data), world))
    out = torch.zeros(8 * world)
    dist.scatter(out, [late(r) for r in range(world)] if rank == world - 1 else None, src=world - 1)
    wrong.append(mismatch("scatter after a kernel", out, data[rank], world))
    out = torch.zeros(8 * world)
    dist.all_to_all_single(out, late(rank))
    want = torch.cat([data[r][rank * 8:(rank + 1) * 8] for r in range(world)])
    wrong.append(mismatch("all_to_all_single after a kernel", out, want, world))
    got = torch.zeros(8 * world)
    ops = [dist.P2POp(dist.isend, late(rank), (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    wrong.append(mismatch("send/recv ring after a kernel", got, data[(rank - 1) % world], world))
    return [w for w in wrong if w]


@pytest.mark.parametrize("name, own_devices", [("2x2", False), ("3+2", False), ("2x2", True)])
def test_across_named_nodes_on_the_model_of_the_device(name, own_devices):
    """The CPU model of the device, the CUDA path's check, runs the node's group and the call's own
    stages (packing, the exchange among the leaders through gloo, the copies back): on the call's
    stream, in its turn, the host standing for that stream while gloo reads it, as the CUDA path
    stages its tensors in host memory. Every result against references; the caller's kernel
    before a call (one with stages, or one handed whole to the engine), and a peer 0.2 s late. The ranks share one device, or each has its own and
    never makes it current."""
    ids = LAYOUTS[name]
    world = len(ids)
    own = [{"TORCH_HCA_MODEL_DEVICES": str(world), "TORCH_HCA_MODEL_DEVICE": str(r)} if own_devices else {}
           for r in range(world)]
    env = [{**e, **own[r]} for r, e in enumerate(_node_env(ids, STREAMS_ENV))]
    assert run_ranks(node_cases.allreduce_matrix, world, "hierarchical_copy", (0, 2), env_per_rank=env) == [[]] * world
    assert run_ranks(node_cases.rooted_and_gathers, world, env_per_rank=env) == [[]] * world
    assert run_ranks(_stream_rules, world, env_per_rank=env) == [[]] * world


@pytest.mark.parametrize("name, env", [("2x2", {}), ("3+2", STREAMS_ENV)])
def test_views_that_are_not_contiguous_across_named_nodes(name, env):
    """The operations handed whole to the engine over every rank take them as dense copies, as the
    stages do; on the CPU model of the device too."""
    ids = LAYOUTS[name]
    assert run_ranks(node_cases.strided_engine_ops, len(ids), env_per_rank=_node_env(ids, env)) == [[]] * len(ids)


@pytest.mark.parametrize("name, env", [("2x2", {}), ("3+2", STREAMS_ENV), ("3+1", {})])
def test_empty_tensors_across_named_nodes(name, env):
    """Tensors of no elements in every operation; the group goes on after them. A reduce_scatter's
    scatter inside the node failed on them (reshaping no elements into rows of 0) and broke the group."""
    ids = LAYOUTS[name]
    assert run_ranks(node_cases.empty_tensors, len(ids), env_per_rank=_node_env(ids, env)) == [[]] * len(ids)


@pytest.mark.parametrize("name, env", [("2x2", {}), ("3+2", STREAMS_ENV)])
def test_nodes_that_disagree_on_a_call_all_raise(name, env):
    """The last node's ranks call other sizes (or another call) than the others': their own node's
    group cannot see it, and gloo among the leaders or over every rank would abort the process.
    Every rank raises "mismatched calls" within seconds; after one that the leaders find mid-call
    the group stays broken, as after any failure between nodes, and says so at once."""
    ids = LAYOUTS[name]
    last_node = [r for r, i in enumerate(ids) if i == ids[-1]]
    assert run_ranks(node_cases.mismatched_calls, len(ids), last_node, node_cases.STAGED_ACROSS_NODES,
                     env_per_rank=_node_env(ids, env), pg_timeout_s=30) == [[]] * len(ids)


@pytest.mark.parametrize("name", ["2x2", "interleaved"])
def test_receives_posted_ahead_and_misfit_across_named_nodes(name):
    """Messages to other ranks go through gloo over every rank, whether the peer is on another
    node ("interleaved": ranks 0 and 1) or on the same one ("2x2"): receives posted ahead get their
    own messages, misfits raise."""
    ids = LAYOUTS[name]
    assert run_ranks(node_cases.messages_through_gloo, len(ids), env_per_rank=_node_env(ids), pg_timeout_s=30) == \
        [[]] * len(ids)


def _training_by_value(rank, world):
    """DDP's and FSDP2's parameters after the same steps over hca and over gloo, as arrays (tensors
    travel to the test as file descriptors, which end with the rank)."""
    runs = (node_cases.ddp_hca_and_gloo(rank, world), node_cases.fsdp2_hca_and_gloo(rank, world))
    return [[[p.numpy() for p in params] for params in run] for run in runs]


def test_training_across_named_nodes_on_the_model_of_the_device_matches_gloo():
    ids = LAYOUTS["2x2"]
    env = _node_env(ids, STREAMS_ENV)
    for rank, runs in enumerate(run_ranks(_training_by_value, len(ids), env_per_rank=env)):
        for wrapper, (hca, gloo) in zip(("DDP", "FSDP2"), runs):
            for a, b in zip(hca, gloo, strict=True):
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, w=wrapper, r=rank: f"{w}, rank {r}: {m}")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda), "cpu-streams", "cpu"])
def test_stages_across_nodes_issue_in_their_calls_turn(device):
    """On one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), an async call across nodes and a
    call on another group made after it, rank 0 late: the stages take the first call's turn, so
    every rank's device gets them first. Else the ranks queue them in different orders and wait
    for each other until the timeout: on the CPU model of the device every rank timed out so.
    On CPU tensors, which queue nowhere, the same results."""
    ids = LAYOUTS["2x2"]
    # gloo among the leaders: NCCL refuses two leaders on one GPU.
    env = _node_env(ids, {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_HCA_INTER_NODE_BACKEND": "gloo",
                          **(STREAMS_ENV if device == "cpu-streams" else {})})
    assert run_ranks(node_cases.calls_in_turn_with_another_group, len(ids), "cuda" if device == "cuda" else "cpu",
                     env_per_rank=env, pg_timeout_s=20.0) == [[]] * len(ids)


@pytest.mark.parametrize("model", [False, True], ids=["host", "model-of-the-device"])
def test_a_dead_named_node_is_reported_by_the_others(model):
    env = _node_env(LAYOUTS["2x2"], STREAMS_ENV if model else None)
    got = run_ranks(node_cases.node_dies, 4, [2, 3], env_per_rank=env, pg_timeout_s=20, allow_missing=(2, 3))
    for kind, message, seconds in got[:2]:
        assert kind == "DistBackendError", message
        assert "across nodes failed" in message and "node 0 of 2 (ranks 0, 1)" in message
        assert seconds < 20
    # The leader raises gloo's words; its node's other rank reads them from shared memory: the same words,
    # the emoji they end with included (on device streams, where that rank's node-local call had already
    # been issued, followed by what became of it).
    released = " (this call was released unfinished: its outputs are undefined)"
    # Each rank's message ends naming its own Flight Recorder dump.
    own_dump = r"\s*\(Flight Recorder dump of this rank: [^)]*\)$"
    gloo_words = [re.search(r"\[[^\]]*gloo[^\]]*\].*", re.sub(own_dump, "", message).removesuffix(released), re.S)
                  for _, message, _ in got[:2]]
    assert all(gloo_words) and gloo_words[0].group(0) == gloo_words[1].group(0), got[:2]


# ---------------------------------------------------------------- separate hosts: network namespaces

NETNS = unavailable()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"simulated hosts: {NETNS}")


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts() as two:
        yield two


@needs_netns
@pytest.mark.parametrize("sizes", [[2, 2], [3, 3], [3, 1]], ids=["2x2", "2x3", "3+1"])
def test_every_collective_between_hosts(hosts, sizes):
    world = sum(sizes)
    layouts = hosts.run("layout", sizes)
    assert layouts == [["NodeBackend", [list(range(sizes[0])), list(range(sizes[0], world))]]] * world
    assert hosts.run("allreduce_matrix", sizes) == [[]] * world
    assert hosts.run("rooted_and_gathers", sizes) == [[]] * world


@needs_netns
@pytest.mark.parametrize("sizes", [[2, 2], [3, 1]], ids=["2x2", "3+1"])
@pytest.mark.parametrize("case", ["ddp_hca_and_gloo", "fsdp2_hca_and_gloo"])
def test_training_between_hosts_matches_gloo(hosts, sizes, case):
    got = hosts.run(case, sizes)
    for hca, gloo in got:
        for a, b in zip(hca, gloo):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
    assert all(params[0] == got[0][0] for params in got)  # replicas identical


@needs_netns
@pytest.mark.parametrize("sizes, dying", [([2, 2], [2, 3]), ([3, 1], [3])], ids=["2x2", "3+1"])
def test_a_dead_host_is_reported_by_the_others(hosts, sizes, dying):
    world = sum(sizes)
    got = hosts.run("node_dies", sizes, args=[dying], timeout_s=20, allow_missing=dying)
    for rank in range(world):
        if rank in dying:
            continue
        kind, message, seconds = got[rank]
        assert kind == "DistBackendError", message
        assert "across nodes failed" in message and "node 0 of 2" in message
        assert seconds < 20


def _resolver(addresses):
    def resolve(name):
        if addresses is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return addresses
    return resolve


# Between hosts gloo listens on what the hostname resolves to: loopback only (or nothing) strands
# the other hosts after a long wait; it must be named at init with the fix.
@pytest.mark.parametrize("addresses, env, networks, refused", [
    (["127.0.1.1"], {}, ["net-a", "net-b"], "resolves to 127.0.1.1"),
    (["127.0.0.1", "::1"], {}, ["net-a", "net-b"], "resolves to 127.0.0.1, ::1"),
    (None, {}, ["net-a", "net-b"], "resolves to nothing"),
    (["10.0.0.7", "127.0.1.1"], {}, ["net-a", "net-b"], None),
    (["127.0.1.1"], {"GLOO_SOCKET_IFNAME": "eth0"}, ["net-a", "net-b"], None),
    (["127.0.1.1"], {}, ["net-a", "net-a"], None),  # nodes of one kernel and network: loopback reaches them
])
def test_hosts_gloo_cannot_leave_are_named_at_init(addresses, env, networks, refused):
    check = lambda: check_gloo_can_leave_this_host(networks, environ=env, hostname="host-a",  # noqa: E731
                                                   resolve=_resolver(addresses))
    if refused is None:
        check()
    else:
        with pytest.raises(ValueError, match=f"'host-a' {refused}.*GLOO_SOCKET_IFNAME"):
            check()


# ---------------------------------------------------------------- containers of one host: who shares /dev/shm

MOUNTNS = mount_namespaces_unavailable()
needs_mountns = pytest.mark.skipif(MOUNTNS is not None, reason=f"containers: {MOUNTNS}")


def test_a_node_is_one_kernel_and_one_dev_shm_not_a_hostname():
    identity = torch_hca.node_identity()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert identity.startswith(f"boot {f.read().strip()}, /dev/shm ")
    assert torch_hca.backend.node_identity() == identity
    assert torch_hca.node.node_identity({"TORCH_HCA_NODE_ID": " rack3 "}) == "rack3"  # the override stays


@needs_mountns
def test_containers_sharing_dev_shm_under_other_hostnames_are_one_node():
    """--ipc=host containers, each with a hostname of its own: shared memory, not gloo."""
    got = run_in_containers("layout", [None] * 3, ["box-a", "box-b", "box-c"])
    assert got == [["ProcessGroupHCA", None]] * 3
    assert run_in_containers("rooted_and_gathers", [None] * 3, ["box-a", "box-b", "box-c"]) == [[]] * 3


@needs_mountns
def test_containers_with_a_dev_shm_each_under_one_hostname_are_separate_nodes():
    """Two pairs of ranks, each pair sharing a tmpfs on /dev/shm, all named alike: two nodes."""
    shm, names = [0, 0, 1, 1], ["box"] * 4
    assert run_in_containers("layout", shm, names) == [["NodeBackend", [[0, 1], [2, 3]]]] * 4
    assert run_in_containers("allreduce_matrix", shm, names, args=["hierarchical_copy", [2]]) == [[]] * 4


@needs_mountns
def test_a_dev_shm_too_small_for_the_staging_fails_at_init_with_the_numbers_and_the_fix():
    """Containers sharing a 4 MiB /dev/shm (Docker's default is 64 MiB): 3 ranks need 6 MiB of
    staging (2 MiB each by default). Every rank fails at init, the cause naming the bytes, the
    layout, /dev/shm's free and total space and --shm-size."""
    with pytest.raises(AssertionError) as failed:
        run_in_containers("layout", [0, 0, 0], [None] * 3, shm_size="4m")
    message = str(failed.value)
    for rank in range(3):
        assert f"rank {rank}:" in message
    assert "reserving 2097152 bytes in /dev/shm for the hca_shm_staging segment (16 slots of 131072 bytes per rank" \
        in message, message
    assert "/dev/shm: " in message and " of 4.0 MiB free; " in message and "docker run --shm-size" in message, message


@needs_mountns
def test_host_staging_of_device_tensors_fits_a_64_mib_dev_shm():
    """4 ranks, one visible model device each (host staging), asking 4 slots of 8 MiB a rank
    (128 MiB in all) in Docker's default 64 MiB /dev/shm: the ring shrinks to what fits, the
    same on every rank, says so in the staging's description and in a warning on rank 0's
    stderr, and every element of every all-reduce is right."""
    envs = [{**STREAMS_ENV, "TORCH_HCA_MODEL_VISIBLE": str(r), "TORCH_HCA_SHM_CHUNK_BYTES": str(8 << 20),
             "TORCH_HCA_SHM_SLOTS": "4"} for r in range(4)]
    got = run_in_containers("staged_in_a_small_dev_shm", [0] * 4, [None] * 4, shm_size="64m", env_per_rank=envs,
                            timeout_s=60, deadline_s=300)
    for rank, (wrong, staging, slot_bytes) in enumerate(got):
        assert wrong == [] and staging.startswith("host shared memory"), (rank, wrong, staging)
        assert (f"2 slots of {4 << 20} bytes a rank, not the 4 slots of {8 << 20} bytes asked: 4 ranks' rings of "
                "those take 128.0 MiB and /dev/shm has ") in staging and "docker run --shm-size" in staging, staging
        assert slot_bytes == 4 << 20 and staging == got[0][1], (rank, slot_bytes)


def test_host_staging_takes_fewer_slots_then_smaller_ones_and_fails_only_where_none_fits():
    fit = torch_hca._C._fit_host_ring
    assert fit(8 << 20, 4, 4, 1 << 30) == (8 << 20, 4, "")
    assert fit(8 << 20, 4, 4, 100 << 20)[:2] == (8 << 20, 3)
    assert fit(8 << 20, 4, 4, 60 << 20)[:2] == (4 << 20, 2)
    assert fit(8 << 20, 4, 4, 20 << 20) == (2 << 20, 2, f"2 slots of {2 << 20} bytes a rank, not the 4 slots of "
                                         f"{8 << 20} bytes asked: 4 ranks' rings of those take 128.0 MiB and "
                                         "/dev/shm has 20.0 MiB free (docker run --shm-size enlarges it)")
    assert fit(5000, 16, 3, 3 * 2 * 4096)[:2] == (4096, 2)
    with pytest.raises(RuntimeError, match=r"the host staging does not fit in /dev/shm: 3 ranks need at least 2 "
                                           r"slots of 4096 bytes each \(0.0 MiB\), and /dev/shm has 0.0 MiB free"):
        fit(8 << 20, 4, 3, 3 * 2 * 4096 - 1)


@needs_mountns
def test_a_ring_that_dev_shm_cannot_hold_fails_the_messages_with_the_numbers():
    """Rings are reserved when their pair first talks: a /dev/shm filled after init makes that
    send and its receive raise, naming the ring, /dev/shm's space and the fix; not SIGBUS."""
    errors = run_in_containers("p2p_on_a_full_dev_shm", [0, 0], [None] * 2, shm_size="8m",
                               env={"TORCH_HCA_SHM_SLOTS": "2"}, timeout_s=10)
    sender, receiver = errors
    assert "reserving 65536 bytes in /dev/shm for the point-to-point ring from rank 0 to rank 1; /dev/shm: " \
        in sender and " of 8.0 MiB free; " in sender and "docker run --shm-size" in sender, sender
    # The cause as rank 0 published it, whole: the numbers and the fix.
    assert "hca recv from rank 0 (tag 0, 1000 x float32): rank 0 failed: the point-to-point" in receiver \
        and " of 8.0 MiB free; " in receiver and "docker run --shm-size" in receiver, receiver


def test_mailbox_rings_shrink_beyond_16_ranks_to_stay_within_16_mib():
    ring = torch_hca._C._mailbox_ring_bytes
    assert [ring(w) for w in (1, 2, 3, 16)] == [64 << 10] * 4
    assert [ring(w) for w in (17, 32, 64, 1000)] == [56 << 10, 16 << 10, 4 << 10, 4 << 10]
    assert all(w * w * ring(w) <= 16 << 20 for w in range(16, 64))


@needs_mountns
def test_one_node_id_over_separate_dev_shms_fails_at_init_on_every_rank():
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_in_containers("layout", [None, 0, None], [None] * 3, env={"TORCH_HCA_NODE_ID": "one-node"})
    message = str(failed.value)
    for rank in range(3):
        assert f"rank {rank}:" in message
    assert message.count("ValueError: hca: ranks announce one node ('one-node') but do not share /dev/shm: rank 0 "
                         "cannot see the files of rank 1 there (and 2 more ranks are as blind)") == 3, message
    assert "--ipc=host" in message and time.monotonic() - started < 60
