"""The rest of what a gloo user calls on CPU: monitored_barrier, sequence numbers, sparse
allreduce, groups created again on one store, profiler traces, TORCH_DISTRIBUTED_DEBUG=DETAIL, and
the newer front ends (DeviceMesh, DTensor redistribution, the functional collectives that
torch.compile emits), each against an independent reference."""
import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT

import torch_hca
from harness import STREAMS_ENV, RankFailed, group_kind, raises, run_ranks
from reference import all_gather_single, make_input, mismatch, reduce_reference, reduce_scatter_single

WORLD_SIZES = [1, 2, 3, 4]


def _monitored(rank, world, late):
    torch_hca.monitored_barrier(timeout=timedelta(seconds=5))  # everyone arrives
    if rank in late:
        time.sleep(3)
        return "late"
    start = time.monotonic()
    msg = raises(lambda: torch_hca.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True),
                  RuntimeError)
    return msg, time.monotonic() - start


@pytest.mark.parametrize("algorithm", ["hierarchical_copy", "nccl"])  # nccl: gloo's own, forwarded
def test_monitored_barrier_names_every_missing_rank(algorithm):
    results = run_ranks(_monitored, 4, (1, 3), pg_timeout_s=20, pg_options=torch_hca.Options(algorithm))
    msg, elapsed = results[0]
    assert "Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms" in msg, msg
    assert elapsed < 4
    msg, _ = results[2]  # waits for rank 0, which gives up (gloo's cause may be rank 0's exit instead)
    assert "Rank 2 successfully reached monitoredBarrier, but received errors while waiting for send/recv from " \
           "rank 0" in msg and ("Timed out" in msg or algorithm == "nccl"), msg


def _monitored_first(rank, world):
    if rank == 2:
        time.sleep(2)
        return None
    return raises(lambda: dist.group.WORLD.monitored_barrier(timedelta(seconds=1)), RuntimeError)


def test_monitored_barrier_names_the_first_missing_rank():
    msg = run_ranks(_monitored_first, 3, pg_timeout_s=20)[0]
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in msg, msg


def _monitored_after_a_death(rank, world):
    """Rank 2 dies; rank 0's monitored barrier then names it as dead, at once, not as late."""
    dist.barrier()
    if rank == 2:
        os._exit(0)
    time.sleep(0.3)
    start = time.monotonic()
    msg = raises(lambda: torch_hca.monitored_barrier(timeout=timedelta(seconds=5), wait_all_ranks=True),
                 RuntimeError)
    return msg, time.monotonic() - start


def test_monitored_barrier_names_a_dead_rank_as_dead():
    results = run_ranks(_monitored_after_a_death, 3, pg_timeout_s=20, allow_missing=(2,))
    msg, elapsed = results[0]
    assert "Rank 2 failed to pass monitoredBarrier; rank 2 (pid" in msg and "died" in msg, msg
    assert "in 5000 ms" not in msg and elapsed < 4, (msg, elapsed)


def _monitored_after_async_calls(rank, world):
    """An async all-reduce and all-to-all (across nodes, gloo over every rank carries the latter),
    then a monitored barrier before their waits; rank 0 lets its queue get to them first, the
    others call the barrier at once. The results' errors."""
    errors = []
    for i in range(3):
        inputs = [make_input(40 + i, r, 1000 * world, torch.float32, "SUM") for r in range(world)]
        mine, exchanged = inputs[rank].clone(), torch.empty(1000 * world)
        works = [dist.all_reduce(mine, async_op=True), dist.all_to_all_single(exchanged, inputs[rank], async_op=True)]
        if rank == 0:
            time.sleep(0.1)
        torch_hca.monitored_barrier(timeout=timedelta(seconds=10))
        for work in works:
            work.wait()
        errors.append(mismatch(f"all_reduce, round {i}", mine, reduce_reference(inputs, "SUM"), world))
        want = torch.cat([inputs[r][1000 * rank:1000 * (rank + 1)] for r in range(world)])
        errors.append(None if torch.equal(exchanged, want) else f"all_to_all_single, round {i}")
    return [e for e in errors if e]


@pytest.mark.parametrize("world, where", [(2, "nccl"), (3, "nccl"), (4, "2 nodes"), (3, "default")])
def test_a_monitored_barrier_after_async_calls_takes_its_turn(world, where):
    """Where gloo carries the calls (the pass-through, the calls across nodes), gloo numbers its
    collectives as they reach it, its monitored barrier included: the barrier goes after the calls
    queued before it. From the caller's thread it came before them on one rank, after on another,
    and both waited until the barrier's timeout."""
    assert run_ranks(_monitored_after_async_calls, world, pg_timeout_s=30, **group_kind(where)) == [[]] * world


def _sequence(rank, world):
    # torch's ProcessGroup wrapper answers only for gloo/nccl/ucc/xccl; split_group and
    # debugging tools call the backend, as here.
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    pg._set_sequence_number_for_group()
    start = pg._get_sequence_number_for_group()
    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    dist.barrier()
    return start, pg._get_sequence_number_for_group()


@pytest.mark.parametrize("algorithm", ["hierarchical_copy", "nccl"])
@pytest.mark.parametrize("world", [1, 3])
def test_sequence_numbers_count_collectives(world, algorithm):
    assert run_ranks(_sequence, world, pg_options=torch_hca.Options(algorithm)) == [(0, 4)] * world


def _debug_detail(rank):
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # TORCH_DISTRIBUTED_DEBUG=DETAIL, read before the group


def _under_debug_detail(rank, world):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps the backend in its ProcessGroupWrapper, which
    checks each call's shapes across the ranks through a gloo group of its own, then calls hca's."""
    wrapped = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    inputs = [make_input(970, r, 1000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    errors = [mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), world)]
    out = torch.empty(1000 * world)
    all_gather_single(out, inputs[rank])
    errors.append(mismatch("all_gather_into_tensor", out, torch.cat(inputs), world))
    model = torch.nn.Linear(8, 4)
    torch.manual_seed(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(5, 8)).sum().backward()
    grads = [torch.empty_like(model.weight.grad) for _ in range(world)]
    dist.all_gather(grads, model.weight.grad)
    errors.append("" if all(torch.equal(g, grads[0]) for g in grads) else "DDP's gradients differ across ranks")
    mismatched = raises(lambda: dist.all_reduce(torch.ones(10 + rank)), RuntimeError) if world > 1 else ""
    return wrapped, [e for e in errors if e], mismatched


@pytest.mark.parametrize("where", ["default", "nccl"])
def test_under_torch_distributed_debug_detail(where):
    """(Stock gloo, on torch 2.13, crashed the ranks there with a segmentation fault in DDP's setup.)"""
    world = 3
    for wrapped, errors, mismatched in run_ranks(_under_debug_detail, world, before_init=_debug_detail,
                                                 **group_kind(where)):
        assert wrapped == "_ProcessGroupWrapper" and errors == [], (wrapped, errors)
        assert "Detected mismatch between collectives on ranks" in mismatched, mismatched


def _objects(rank, world):
    """The object collectives ride on gather, scatter, allgather and broadcast."""
    mine = {"rank": rank, "payload": list(range(rank * 3))}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    got = [None]
    dist.scatter_object_list(got, [{"to": j, "blob": "x" * (j * 100)} for j in range(world)] if rank == world - 1 else None,
                             src=world - 1)
    box = [mine] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    want = [{"rank": r, "payload": list(range(r * 3))} for r in range(world)]
    return ((gathered == want) if rank == 0 else True, everyone == want, got[0] == {"to": rank, "blob": "x" * (rank * 100)},
            box[0] == want[0])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_object_collectives(world):
    assert run_ranks(_objects, world) == [(True, True, True, True)] * world


def _sparse_input(rank, world, dtype):
    g = torch.Generator().manual_seed(rank)
    nnz = 3 + 2 * rank  # different counts per rank, indices overlapping across ranks
    indices = torch.randint(0, 6, (2, nnz), generator=g)
    values = make_input(rank, rank, nnz * 4, dtype, "SUM").reshape(nnz, 4)
    return torch.sparse_coo_tensor(indices, values, (6, 6, 4))


def _sparse(rank, world):
    errors = []
    for dtype in (torch.float32, torch.float64, torch.int64):
        t = _sparse_input(rank, world, dtype)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        want = sum(_sparse_input(r, world, dtype).to(torch.float64).to_dense() for r in range(world))
        got = t.to_dense().to(torch.float64)
        if not t.is_sparse or not torch.allclose(got, want, rtol=1e-6, atol=1e-5):
            errors.append(f"{dtype}: max error {(got - want).abs().max().item()}")
    return errors


@pytest.mark.parametrize("algorithm", ["hierarchical_copy", "nccl"])  # nccl: gloo's own, forwarded
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sparse_allreduce_sums_like_gloo(world, algorithm):
    for errors in run_ranks(_sparse, world, pg_options=torch_hca.Options(algorithm)):
        assert errors == []


def _dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    errors = []
    mesh = init_device_mesh("cpu", (world,))
    if mesh.get_group()._get_backend(torch.device("cpu")).name() != "hca":
        errors.append("the mesh's group is not hca")
    full = make_input(7, 0, world * 6 * 10, torch.float32, "SUM").reshape(world * 6, 10)
    sharded = distribute_tensor(full, mesh, [Shard(0)])  # every rank holds `full`: the same seed
    replicated = sharded.redistribute(mesh, [Replicate()])  # all_gather
    if not torch.equal(replicated.to_local(), full):
        errors.append("Shard(0) -> Replicate")
    by_columns = sharded.redistribute(mesh, [Shard(1)])  # all_to_all
    if not torch.equal(by_columns.full_tensor(), full):
        errors.append("Shard(0) -> Shard(1)")
    mine = make_input(8, rank, world * 6 * 10, torch.float64, "SUM").reshape(world * 6, 10)
    want = sum(make_input(8, r, world * 6 * 10, torch.float64, "SUM").reshape(world * 6, 10) for r in range(world))
    partial = torch.distributed.tensor.DTensor.from_local(mine, mesh, [Partial()])
    if not torch.allclose(partial.redistribute(mesh, [Replicate()]).to_local(), want):  # all_reduce
        errors.append("Partial -> Replicate")
    shard = partial.redistribute(mesh, [Shard(0)]).to_local()  # reduce_scatter
    if not torch.allclose(shard, want[rank * 6:(rank + 1) * 6]):
        errors.append("Partial -> Shard(0)")
    if world % 2 == 0:
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        t = torch.full((4,), float(rank))
        dist.all_reduce(t, group=mesh2.get_group("tp"))
        members = [r for r in range(world) if r // (world // 2) == rank // (world // 2)]
        if not torch.equal(t, torch.full((4,), float(sum(members)))):
            errors.append(f"2-D mesh tp group: {t}")
    return errors


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_device_mesh_and_dtensor_redistribute(world):
    for errors in run_ranks(_dtensor, world):
        assert errors == []


def _functional(rank, world):
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    errors = []
    x = make_input(9, rank, world * 8, torch.float32, "SUM")
    everyone = [make_input(9, r, world * 8, torch.float32, "SUM") for r in range(world)]
    total = torch.stack([e.double() for e in everyone]).sum(0).float()

    def step(t):
        reduced = funcol.all_reduce(t, "sum", group)
        gathered = funcol.all_gather_tensor(t, 0, group)
        scattered = funcol.reduce_scatter_tensor(t, "sum", 0, group)
        swapped = funcol.all_to_all_single(t, None, None, group)
        sent = funcol.broadcast(t, 0, group)
        return reduced, gathered, scattered, swapped, sent

    for name, fn in (("eager", step), ("compiled", torch.compile(step, backend="aot_eager", fullgraph=True))):
        reduced, gathered, scattered, swapped, sent = (r.wait() if hasattr(r, "wait") else r for r in fn(x))
        want_swap = torch.cat([e[rank * 8:(rank + 1) * 8] for e in everyone])
        checks = {
            "all_reduce": torch.allclose(reduced, total, atol=1e-5),
            "all_gather_tensor": torch.equal(gathered, torch.cat(everyone)),
            "reduce_scatter_tensor": torch.allclose(scattered, total[rank * 8:(rank + 1) * 8], atol=1e-5),
            "all_to_all_single": torch.equal(swapped, want_swap),
            "broadcast": torch.equal(sent, everyone[0]),
        }
        errors += [f"{name} {k}" for k, ok in checks.items() if not ok]
    return errors


@pytest.mark.parametrize("world", [1, 2, 3])
def test_functional_collectives_eager_and_compiled(world):
    for errors in run_ranks(_functional, world, env={"TORCHINDUCTOR_CACHE_DIR": os.path.join("/tmp", "hca-inductor")}):
        assert errors == []


def _created_again(rank, world, store_path, algorithm):
    """init, use, destroy, init again on one store (as tests and elastic restarts do)."""
    store = dist.FileStore(store_path, world)
    errors = []
    for round_ in range(3):
        dist.destroy_process_group()
        dist.init_process_group("hca", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=20),
                                pg_options=torch_hca.Options(algorithm=algorithm))
        inputs = [make_input(700 + round_, r, 20_000, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errors.append(mismatch(f"round {round_}", t, reduce_reference(inputs, "SUM"), world))
        t = inputs[rank].clone()
        dist.all_reduce(t, group=dist.new_group())
        errors.append(mismatch(f"round {round_}, new group", t, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("algorithm, env", [("hierarchical_copy", {}), ("hierarchical_copy", STREAMS_ENV),
                                            ("nccl", {})], ids=["shm", "streams", "nccl"])
@pytest.mark.parametrize("world", [2, 3])
def test_groups_created_again_on_one_store(world, algorithm, env, tmp_path):
    assert run_ranks(_created_again, world, str(tmp_path / "store"), algorithm, env=env) == [[]] * world


def _profiled(rank, world, trace_path):
    """The operations of a training job under torch.profiler: the backend's event names, as a
    profile lists them and as the exported Chrome trace has them."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = torch.ones(50_000)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0)
        dist.all_gather([torch.empty(10) for _ in range(world)], torch.ones(10))
        all_gather_single(torch.empty(10 * world), torch.ones(10))
        reduce_scatter_single(torch.empty(10), torch.ones(10 * world))
        dist.all_to_all_single(torch.empty(2 * world), torch.ones(2 * world))
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
        dist.barrier()
    prof.export_chrome_trace(f"{trace_path}.{rank}.json")
    with open(f"{trace_path}.{rank}.json") as f:
        traced = {e["name"] for e in json.load(f)["traceEvents"] if ":" in e.get("name", "")}
    listed = {e.name for e in prof.events()}
    backend = dist.get_backend()
    return sorted(n.split(":", 1)[1] for n in listed if n.startswith(backend + ":")), \
        sorted(n.split(":", 1)[1] for n in traced if n.startswith(backend + ":"))


def test_profiler_traces_name_every_operation_as_gloo_does(tmp_path):
    hca = run_ranks(_profiled, 2, str(tmp_path / "hca"))
    gloo = run_ranks(_profiled, 2, str(tmp_path / "gloo"), backend="gloo")
    for rank in range(2):
        listed, traced = hca[rank]
        assert listed == traced, hca[rank]
        # gloo names no event for reduce_scatter_tensor; hca does.
        assert set(listed) == set(gloo[rank][0]) | {"reduce_scatter"}, (listed, gloo[rank][0])
        assert {"all_reduce", "broadcast", "barrier", "send" if rank == 0 else "recv"} <= set(listed), listed


def _uneven_all_to_all_then_mismatch(rank, world):
    """An all_to_all with uneven splits (hca exchanges the counts first) under the profiler, then
    a mismatched all_reduce: what the profile and the mismatch report call each."""
    from torch.profiler import ProfilerActivity, profile
    sends = list(range(1, world + 1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_to_all_single(torch.empty(world * (rank + 1)), torch.ones(sum(sends)), [rank + 1] * world, sends)
    names = sorted({e.name for e in prof.events() if e.name.startswith("hca:")})
    error = str(pytest.raises(dist.DistBackendError, dist.all_reduce, torch.ones(4 + rank)).value)
    return names, error


def test_the_count_exchange_is_named_internal_not_a_users_all_gather():
    for names, error in run_ranks(_uneven_all_to_all_then_mismatch, 2, pg_timeout_s=20):
        assert names == ["hca:all_to_all", "hca:internal_count_exchange"], names
        assert "collective #2: mismatched calls" in error, error  # the all_to_all is #1


def _comms_metadata(rank, world, trace_path):
    """The metadata a Chrome trace carries for each call (what trace-analysis tools read), for
    calls on the world and on the group of ranks [0, 2]."""
    from torch.profiler import ProfilerActivity, profile
    pair = dist.new_group([0, 2])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(500, dtype=torch.bfloat16))
        if rank != 1:
            dist.broadcast(torch.ones(7), 2, group=pair, async_op=True).wait()
        all_gather_single(torch.empty(10 * world), torch.ones(10))
        reduce_scatter_single(torch.empty(3, dtype=torch.int64), torch.ones(3 * world, dtype=torch.int64))
        sends = list(range(1, world + 1))  # j + 1 elements to rank j
        dist.all_to_all_single(torch.empty(world * (rank + 1)), torch.ones(sum(sends)), [rank + 1] * world, sends)
        if rank == 0:
            dist.send(torch.ones(9), 1)
        elif rank == 1:
            dist.recv(torch.empty(9), 0)
        dist.barrier()
    prof.export_chrome_trace(f"{trace_path}.{rank}.json")
    with open(f"{trace_path}.{rank}.json") as f:
        events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "record_param_comms"]
    keys = ("Collective name", "dtype", "In msg nelems", "Out msg nelems", "In split size", "Out split size",
            "Group size", "Process Group Ranks", "Rank", "Seq", "Is asynchronized op")
    return [{k: e.get(k) for k in keys} for e in events], dist.get_rank(pair) if rank != 1 else None


def test_profiler_traces_carry_the_calls_metadata(tmp_path):
    """As ProcessGroupNCCL records it (ParamCommsUtils.hpp): name, sizes, dtype, the group's size
    and ranks in the world, the rank (for a message: its peer, and always async, as NCCL's), a
    sequence number per group, and whether the caller waits in the call."""
    world = 3
    for rank, (events, pair_rank) in enumerate(run_ranks(_comms_metadata, world, str(tmp_path / "trace"))):
        def call(name, dtype, n_in, n_out, splits=("[]", "[]"), size=world, ranks="[0, 1, 2]", who=rank, seq=None,
                 async_op=False):
            return {"Collective name": name, "dtype": dtype, "In msg nelems": n_in, "Out msg nelems": n_out,
                    "In split size": splits[0], "Out split size": splits[1], "Group size": size,
                    "Process Group Ranks": ranks, "Rank": who, "Seq": seq, "Is asynchronized op": int(async_op)}
        want = [call("allreduce", "BFloat16", 500, 500)]
        if rank != 1:
            want.append(call("broadcast", "Float", 7, 7, size=2, ranks="[0, 2]", who=pair_rank, seq=1, async_op=True))
        want += [call("allgather_into_tensor_coalesced", "Float", 10, 10 * world),
                 call("reduce_scatter_tensor_coalesced", "Long", 3 * world, 3),
                 call("all_to_all", "Float", 6, world * (rank + 1), ("[1, 2, 3]", str([rank + 1] * world)))]
        if rank < 2:
            want.append(call("send" if rank == 0 else "recv", "Float", 9, 9, who=0 if rank == 1 else 1, async_op=True))
        want.append(call("barrier", "Byte", 0, 0))
        seqs = iter(range(1, 10))
        for w in want:
            if w["Seq"] is None:
                w["Seq"] = next(seqs)  # the world's calls, numbered in order
        assert events == want, (rank, events)


def _shrunk(rank, world, gone, abort):
    """The ranks in `gone` leave without a word (as a crashed rank would); the others shrink the
    world to themselves (with SHRINK_ABORT: while a collective waits on the ones gone) and all-reduce
    on the shrunk group, now the default one."""
    dist.barrier()
    if rank in gone:
        time.sleep(3 if abort else 0)  # alive and silent: only the abort can end what waits on it
        os._exit(0)
    pending = dist.all_reduce(torch.ones(4), async_op=True) if abort else None
    start = time.monotonic()
    shrunk = dist.shrink_group(gone, shrink_flags=SHRINK_ABORT if abort else SHRINK_DEFAULT)
    kept = [r for r in range(world) if r not in gone]
    inputs = [make_input(13, r, 20_001, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    error = mismatch("allreduce", t, reduce_reference([inputs[r] for r in kept], "SUM"), len(kept))
    failed = raises(pending.wait, RuntimeError) if abort else None
    return (shrunk.rank(), shrunk.size(), dist.get_world_size(), error, torch_hca.hierarchy(shrunk)["cpu"].basis,
            failed, time.monotonic() - start)


@pytest.mark.parametrize("world, gone, abort", [(3, [1], False), (4, [0], False), (4, [1, 3], False),
                                                (3, [2], True)])
def test_shrink_group_leaves_out_ranks_that_are_gone(world, gone, abort):
    """As NCCL's shrink (gloo has none): the staying ranks renumbered in order, the parent's
    options kept; with SHRINK_ABORT, what waited on the parent fails at once."""
    results = run_ranks(_shrunk, world, gone, abort, allow_missing=tuple(gone), pg_timeout_s=60)
    kept = [r for r in range(world) if r not in gone]
    for rank in kept:
        new_rank, size, world_size, error, basis, failed, seconds = results[rank]
        assert (new_rank, size, world_size, error, basis) == (kept.index(rank), len(kept), len(kept), None, "shrink")
        assert seconds < 10, seconds
        if abort:
            assert "aborted its process group" in failed, failed


def _errors(rank, world, trouble):
    """Backend.get_error after a good call, then after rank 1 stays silent past the timeout,
    dies, or rank 0 aborts the group."""
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    dist.all_reduce(torch.ones(3))
    good = pg.get_error().name
    if rank == 1:
        if trouble == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3)
        return good, None
    if trouble == "abort":
        pg.abort()
    raises(lambda: dist.all_reduce(torch.ones(3)), RuntimeError)
    return good, pg.get_error().name


@pytest.mark.parametrize("where", ["default", "nccl"])  # the pass-through: its agreements' failures
@pytest.mark.parametrize("trouble, kind", [("silent", "TIMEOUT"), ("dies", "REMOTE_ERROR"), ("abort", "COMM_ERROR")])
def test_get_error_names_the_kind_of_failure(trouble, kind, where):
    results = run_ranks(_errors, 2, trouble, pg_timeout_s=1, allow_missing=(1,), **group_kind(where))
    assert results[0] == ("SUCCESS", kind), results


def _gloo_shrinks(rank, world):
    return raises(lambda: dist.shrink_group([1]), TypeError)


def test_gloo_has_no_shrink():
    """What the comparison above stands on: gloo refuses shrink_group."""
    assert "does not support shrinking" in run_ranks(_gloo_shrinks, 2, backend="gloo")[0]


def _negative_timeouts(rank, world, where):
    """A negative timeout given to new_group or set_timeout: a ValueError naming it, where it is
    given (gloo refuses it there too), and the groups go on."""
    kind = group_kind(where)
    options = kind.get("pg_options")
    msgs = {"new_group": raises(lambda: dist.new_group(timeout=timedelta(seconds=-5), pg_options=options),
                                ValueError)}
    group = dist.new_group(pg_options=options)
    backend = group._get_backend(torch.device("cpu"))
    msgs["set_timeout"] = raises(lambda: backend.set_timeout(timedelta(seconds=-5)), ValueError)
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    return msgs, t.tolist()


@pytest.mark.parametrize("where", ["default", "nccl", "2 nodes"])
def test_a_negative_timeout_is_a_value_error_where_it_is_given(where):
    world = 4 if where == "2 nodes" else 2
    for msgs, summed in run_ranks(_negative_timeouts, world, where, **group_kind(where)):
        assert "hca: the group's timeout is negative (-5.0 s)" in msgs["new_group"], msgs
        assert "hca: setTimeout: the timeout is negative (-5000 ms)" in msgs["set_timeout"], msgs
        assert summed == [float(world)] * 3


def _nothing(rank, world):
    pass


def test_init_with_a_negative_timeout_is_a_value_error():
    with pytest.raises(RankFailed, match=r"ValueError: hca: the group's timeout is negative \(-5.0 s\)"):
        run_ranks(_nothing, 1, pg_timeout_s=-5)


@pytest.mark.parametrize("backend", ["gloo", "hca"])
def test_a_zero_timeout_times_out_at_once_as_gloo(backend):
    """set_timeout(0) is taken; a call whose peer comes 1 s late times out at once, as gloo's does."""
    message, seconds = run_ranks(_timeout_set_later, 2, backend, 0, 1, allow_missing=(1,))[0]
    assert seconds < 0.5 and not message.startswith("UNEXPECTED"), (message, seconds)
    if backend == "hca":
        assert "Timed out after 0 ms" in message, message


def _timeout_set_later(rank, world, backend, timeout_s=1, late_s=4):
    """A group created with a 60 s timeout, then set to `timeout_s` through its backend (as
    `_set_pg_timeout` does for gloo); rank 1 comes `late_s` late to a collective. How long the
    others waited, and what they raised."""
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=60))
    group._get_backend(torch.device("cpu")).set_timeout(timedelta(seconds=timeout_s))
    if timeout_s:
        dist.all_reduce(torch.ones(4), group=group)  # the new timeout does not break what arrives
    dist.barrier()  # on the default group: every rank has made the group (gloo's connects would time out at 0)
    if rank == 1:
        time.sleep(late_s)
        return None
    start = time.monotonic()
    message = raises(lambda: dist.all_reduce(torch.ones(4), group=group), RuntimeError)
    return message, time.monotonic() - start


@pytest.mark.parametrize("backend, env", [("gloo", {}), ("hca", {}), ("hca", STREAMS_ENV), ("nodes", None)])
def test_set_timeout_applies_to_later_calls_as_gloo(backend, env):
    env_per_rank = [{"TORCH_HCA_NODE_ID": n} for n in "aab"] if backend == "nodes" else None
    results = run_ranks(_timeout_set_later, 3, "hca" if backend == "nodes" else backend, env=env,
                        env_per_rank=env_per_rank, pg_timeout_s=60)
    for rank in (0, 2):
        message, seconds = results[rank]
        assert 0.8 < seconds < 10, (message, seconds)
        if backend != "gloo":
            assert "Timed out after 1000 ms" in message or "across nodes failed" in message, message


def _split(rank, world, backend, options):
    """ProcessGroup.split_group (what dist.split_group calls; dist.split_group itself wants an
    accelerator): the world split by parity, then [0, 1] with the other ranks left out. Returns
    what each child is (rank, size, hierarchy) and the errors of its collectives."""
    parent = dist.new_group(backend=backend, pg_options=options)
    mine = [r for r in range(world) if r % 2 == rank % 2]
    child = parent.split_group(mine, timeout=timedelta(seconds=30), group_name=f"parity{rank % 2}_{backend}")
    errors = []
    inputs = [make_input(7, r, 1001, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    child.allreduce([t]).wait()
    errors.append(mismatch("allreduce", t, reduce_reference([inputs[r] for r in mine], "SUM"), world))
    t = inputs[rank].clone()
    child.broadcast([t], dist.BroadcastOptions()).wait()  # from the child's rank 0
    errors.append(mismatch("broadcast", t, inputs[mine[0]], world))
    pair = parent.split_group([0, 1], timeout=timedelta(seconds=30), group_name=f"pair_{backend}")
    if pair is not None:
        t = inputs[rank].to(torch.int64)
        pair.allreduce([t]).wait()
        errors.append(mismatch("pair allreduce", t, reduce_reference([inputs[0].long(), inputs[1].long()], "SUM"), world))
    hierarchy = torch_hca.hierarchy(child)["cpu"] if backend == "hca" else None
    return (child.rank(), child.size(), pair is None, [e for e in errors if e],
            hierarchy and (hierarchy.groups, hierarchy.basis), child._get_backend(torch.device("cpu"))._global_ranks)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_group_gives_each_rank_its_child(world):
    """As gloo's split defines it: the child's rank is the position among the sorted ranks, a rank
    outside them gets None. gloo itself is not run beside it: in torch 2.13 its split is asked
    twice on one store (once per device type of the one gloo backend) and hung 2 of 3 runs here."""
    for rank, (child_rank, size, left_out, errors, groups, global_ranks) in enumerate(
            run_ranks(_split, world, "hca", None)):
        assert (child_rank, size, left_out, errors) == (rank // 2, (world - rank % 2 + 1) // 2, rank > 1, [])
        mine = [r for r in range(world) if r % 2 == rank % 2]
        assert global_ranks == mine  # what profiler traces name as the child's ranks
        kept = [[mine.index(r) for r in g if r in mine] for g in torch_hca._C.default_groups(world)]
        assert groups == ([g for g in kept if g], "split"), groups  # the parent's halves, kept for its ranks


def _as_on_an_accelerator_machine(rank):
    """torch's route where an accelerator is present, on CPU tensors: there `dist.split_group` and
    a DeviceMesh of several dimensions split the world group when it has a device (`device_id`)."""
    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")


def _split_by_torch(rank, world):
    # What init_process_group(device_id=...) sets (its eager connect is a no-op for hca); the
    # tensors stay on the CPU.
    dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
    inputs = [make_input(11, r, 1001, torch.float32, "SUM") for r in range(world)]
    errors = []
    # new_group asks the ranks it leaves out to take part in a split, as NCCL's needs; those
    # ranks then know one group fewer, which dist.split_group hashes into its children's names.
    pair = dist.new_group(ranks=[0, world - 1])
    if rank in (0, world - 1):
        t = inputs[rank].clone()
        dist.all_reduce(t, group=pair)
        errors.append(mismatch("new_group all_reduce", t, reduce_reference([inputs[0], inputs[world - 1]], "SUM"), world))
    elif pair is not dist.GroupMember.NON_GROUP_MEMBER:
        errors.append(f"rank {rank} is in the pair")
    halves = [list(range((world + 1) // 2)), list(range((world + 1) // 2, world))]
    mine = halves[rank >= (world + 1) // 2]
    child = dist.split_group(split_ranks=halves, timeout=timedelta(seconds=45))
    backend = child._get_backend(torch.device("cpu"))
    t = inputs[rank].clone()
    dist.all_reduce(t, group=child)
    errors.append(mismatch("split_group all_reduce", t, reduce_reference([inputs[r] for r in mine], "SUM"), world))
    if world % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        t = inputs[rank].clone()
        dist.all_reduce(t, group=mesh.get_group("tp"))
        members = [r for r in range(world) if r // (world // 2) == rank // (world // 2)]
        errors.append(mismatch("2-D mesh tp all_reduce", t, reduce_reference([inputs[r] for r in members], "SUM"), world))
    return (dist.get_backend(child), child.size(), backend.algorithm, backend.options._timeout,
            [e for e in errors if e])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_group_new_group_and_a_2d_mesh_on_a_world_group_with_a_device(world):
    """torch's route where an accelerator is present and init_process_group had a `device_id`:
    new_group asks the ranks it leaves out for a split of their own; dist.split_group deep-copies
    the parent's `options` (torch's options, which torch cannot copy: hca gives a copyable
    subclass) and names each child's store differently on ranks that know different numbers of
    groups (hca's children meet on the parent's store). The children keep the parent's
    algorithm and get the timeout split_group was given."""
    results = run_ranks(_split_by_torch, world, pg_options=torch_hca.Options("reduce_to_one_device"),
                        before_init=_as_on_an_accelerator_machine)
    for rank, result in enumerate(results):
        size = (world + 1) // 2 if rank < (world + 1) // 2 else world // 2
        assert result == ("hca", size, "reduce_to_one_device", timedelta(seconds=45), []), result


def test_a_split_keeps_the_parents_groups_for_its_ranks():
    results = run_ranks(_split, 4, "hca", torch_hca.Options(groups=[[0, 3], [1, 2]], num_packs=2))
    assert [r[3] for r in results] == [[]] * 4
    # evens [0, 2]: 0 from group [0, 3], 2 from [1, 2]; odds [1, 3]: the same, the other way round
    assert [r[4] for r in results] == [([[0], [1]], "split"), ([[1], [0]], "split")] * 2
