"""Bad input, mismatched calls, dead or missing peers: clear errors, no hang, nothing left in /dev/shm."""
import glob
import os
from datetime import timedelta
import signal
import shutil
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

import torch_hca
from torch_hca.options import shm_chunk_bytes, shm_slots
from harness import SMALL_CHUNKS, STREAMS_ENV, RankFailed, group_kind, raises, run_ranks, seeds
from netns import pid_namespaces_unavailable, run_in_pid_namespaces
from reference import all_gather_single, make_input, mismatch, rank_device, reduce_reference, reduce_scatter_single

# Failures must be found by both executors of CPU tensors: the shared-memory one, and the
# stream executor that CUDA tensors use (its watchdog releases the waiting streams).
EXECUTORS = [pytest.param({}, id="shm"), pytest.param(STREAMS_ENV, id="streams")]


def _shm_entries():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("torch_hca"))


@pytest.fixture(autouse=True)
def no_shm_left():
    before = _shm_entries()
    yield
    assert _shm_entries() == before


def _bad_input(rank, world):
    sparse = torch.eye(3).to_sparse()
    msgs = {
        "sparse max": raises(lambda: dist.all_reduce(sparse, op=dist.ReduceOp.MAX), ValueError),
        "float8": raises(lambda: dist.all_reduce(torch.ones(3).to(torch.float8_e4m3fn)), TypeError),
        "avg on int": raises(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG),
                              ValueError),
        "band on float": raises(lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND), ValueError),
        "bad src": raises(lambda: dist.broadcast(torch.ones(3), src=world + 5), ValueError),
        "gather size": raises(lambda: dist.all_gather([torch.ones(2) for _ in range(world)], torch.ones(3)),
                              ValueError),
        # torch checks list dtypes itself; hca checks the flat form.
        "gather dtype": raises(lambda: dist.all_gather([torch.ones(3)] * world, torch.ones(3, dtype=torch.int64)),
                                ValueError),
        "flat gather dtype": raises(lambda: all_gather_single(torch.ones(3 * world),
                                                                         torch.ones(3, dtype=torch.int64)), TypeError),
    }
    # The group still works after rejected calls: nothing was started.
    t = torch.ones(5) * (rank + 1)
    dist.all_reduce(t)
    msgs["still works"] = "" if torch.equal(t, torch.full((5,), world * (world + 1) / 2)) else f"UNEXPECTED {t}"
    # torch views complex tensors as real pairs for SUM.
    z = torch.full((4,), complex(1, rank), dtype=torch.complex64)
    dist.all_reduce(z)
    want = torch.full((4,), complex(world, world * (world - 1) / 2), dtype=torch.complex64)
    msgs["complex sum"] = "" if torch.equal(z, want) else f"UNEXPECTED {z}"
    return msgs


def test_bad_input_gives_clear_errors():
    results = run_ranks(_bad_input, 2)
    for msgs in results:
        assert not any(m.startswith("UNEXPECTED") for m in msgs.values()), msgs
        assert "hca allreduce: sparse tensors support ReduceOp.SUM only" in msgs["sparse max"], msgs
        assert "dtype Float8_e4m3fn is not supported" in msgs["float8"], msgs
        assert "ReduceOp.AVG is not supported for int32" in msgs["avg on int"], msgs
        assert "ReduceOp.BAND is not supported for float32 (integer and bool dtypes only)" in msgs["band on float"], msgs
        assert "src 7 is outside the group of 2 ranks" in msgs["bad src"], msgs
        assert "has 2 elements, expected 3" in msgs["gather size"], msgs
        assert "different dtypes" in msgs["gather dtype"], msgs
        assert "the output has dtype Float but the input has Long" in msgs["flat gather dtype"], msgs
        assert msgs["still works"] == "" and msgs["complex sum"] == "", msgs


def _misshapen_calls(rank, world):
    """The list forms with a tensor too few, or this rank's slot of another size than its tensor, a
    PREMUL_SUM of integers, all-to-alls whose splits do not fit, roots outside the group; then a
    call that must still work."""
    def empties(count, size=2, dtype=torch.float32):
        return [torch.empty(size, dtype=dtype) for _ in range(count)]

    msgs = {name: raises(call, ValueError) for name, call in {
        "all_gather, a tensor too few": lambda: dist.all_gather(empties(world - 1), torch.ones(2)),
        "all_gather, its slot": lambda: dist.all_gather(empties(world), torch.ones(3)),
        "reduce_scatter, a tensor too few": lambda: dist.reduce_scatter(torch.empty(2), empties(world - 1)),
        "reduce_scatter, its slot": lambda: dist.reduce_scatter(torch.empty(3), empties(world)),
        "reduce_scatter, PREMUL_SUM of int64": lambda: dist.reduce_scatter(
            torch.empty(2, dtype=torch.int64), empties(world, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0)),
        "all_to_all_single, rows that do not divide": lambda: dist.all_to_all_single(
            torch.empty(2 * world + 1), torch.ones(2 * world + 1)),
        "all_to_all_single, splits that do not add up": lambda: dist.all_to_all_single(
            torch.empty(2 * world), torch.ones(2 * world), output_split_sizes=[1] * world),
        "all_to_all_single of 0-dim tensors": lambda: dist.all_to_all_single(torch.tensor(1.0), torch.tensor(2.0)),
        "all_to_all, a tensor too few": lambda: dist.all_to_all(empties(world), empties(world - 1)),
        "broadcast from outside": lambda: dist.broadcast(torch.ones(2), src=world + 3),
        "reduce to outside": lambda: dist.reduce(torch.ones(2), dst=world + 3),
    }.items()}
    t = torch.ones(2)
    dist.all_reduce(t)
    return msgs, t.tolist()


@pytest.mark.parametrize("where", ["default", "nccl", "2 nodes"])
def test_misshapen_calls_are_value_errors_at_the_call(where):
    """As hca's own algorithms name them, where gloo carries the call too (the pass-through, and
    across nodes): before, gloo's own check failed there, or the ranks reported mismatched calls,
    and an all_to_all_single whose rows did not divide among the ranks reached gloo, which wrote
    garbage without an error."""
    world = 4 if where == "2 nodes" else 3
    want = {"all_gather, a tensor too few": f"hca allgather: the output list has {world - 1} tensors, expected one "
                                            f"per rank ({world})",
            "all_gather, its slot": "hca allgather: this rank's output tensor has 2 elements, expected 3",
            "reduce_scatter, a tensor too few": f"hca reduce_scatter: the input list has {world - 1} tensors, "
                                                f"expected one per rank ({world})",
            "reduce_scatter, its slot": "hca reduce_scatter: this rank's input tensor has 2 elements, expected 3",
            "reduce_scatter, PREMUL_SUM of int64": "hca reduce_scatter: ReduceOp.PREMUL_SUM is not supported for "
                                                   "int64 (floating dtypes only)",
            "all_to_all_single, rows that do not divide": f"hca alltoall_base: the input's first dimension "
                                                          f"({2 * world + 1}) does not divide into {world} equal "
                                                          "splits",
            "all_to_all_single, splits that do not add up": f"hca alltoall_base: the output splits add up to {world} "
                                                             f"rows, but its first dimension is {2 * world}",
            "all_to_all_single of 0-dim tensors": "hca alltoall_base: the input must have at least one dimension",
            "all_to_all, a tensor too few": f"hca alltoall: expects one input and one output tensor per rank "
                                            f"({world}), got {world - 1} and {world}",
            "broadcast from outside": f"hca broadcast: src {world + 3} is outside the group of {world} ranks",
            "reduce to outside": f"hca reduce: dst {world + 3} is outside the group of {world} ranks"}
    for msgs, after in run_ranks(_misshapen_calls, world, **group_kind(where)):
        assert {name: msgs[name] for name in want} == want
        assert after == [world, world]


def _aliasing(rank, world, device):
    """Tensors of one call sharing memory: a ValueError, except the in-place forms torch and NCCL
    define, which must give the reference result (over many staging rounds, two packs). (List forms
    whose inputs are among their outputs read copies of them: test_collectives.)"""
    dev = rank_device(device, rank)
    group = dist.new_group(pg_options=torch_hca.Options(num_packs=2))
    x = torch.ones(40, device=dev)
    refused = {
        "same tensor twice": lambda: dist.all_reduce_coalesced([x, x], group=group),
        "overlapping views": lambda: dist.all_reduce_coalesced([x[0:20], x[10:30]], group=group),
        "gather input in another rank's chunk": lambda: all_gather_single(
            x[:10 * world], x[10 * ((rank + 1) % world):][:10], group=group),
        "scatter output in another rank's chunk": lambda: reduce_scatter_single(
            x[10 * ((rank + 1) % world):][:10], x[:10 * world], group=group),
    }
    msgs = {name: raises(call, ValueError) for name, call in refused.items()}
    errors = []
    n = 50_001
    for case, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64]):
        inputs = [make_input(500 + case, r, n, dtype, "SUM") for r in range(world)]
        out = torch.zeros(n * world, dtype=dtype, device=dev)
        out[rank * n:(rank + 1) * n] = inputs[rank].to(dev)
        all_gather_single(out, out[rank * n:(rank + 1) * n], group=group)
        errors.append(mismatch(f"in-place all_gather_into_tensor {dtype}", out, torch.cat(inputs), world))
        outs = [torch.zeros(n, dtype=dtype, device=dev) for _ in range(world)]
        outs[rank].copy_(inputs[rank])
        dist.all_gather(outs, outs[rank], group=group)
        errors.append(mismatch(f"in-place all_gather {dtype}", torch.cat(outs), torch.cat(inputs), world))
        big = [make_input(600 + case, r, n * world, dtype, "SUM") for r in range(world)]
        t = big[rank].to(dev, copy=True)
        reduce_scatter_single(t[rank * n:(rank + 1) * n], t, group=group)
        want = reduce_reference(big, "SUM")[rank * n:(rank + 1) * n]
        errors.append(mismatch(f"in-place reduce_scatter_tensor {dtype}", t[rank * n:(rank + 1) * n], want, world))
    return msgs, [e for e in errors if e]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("world", [2, 3])
def test_tensors_sharing_memory_are_refused_or_in_place(world, executor):
    for msgs, errors in run_ranks(_aliasing, world, "cpu", env={**SMALL_CHUNKS, **executor}):
        for name, msg in msgs.items():
            assert "share memory" in msg and "of the call" in msg, (name, msg)
        assert errors == [], errors


def _mismatched(rank, world, kind):
    if kind == "numel":
        call = lambda: dist.all_reduce(torch.ones(10 + rank))  # noqa: E731
    elif kind == "dtype":
        call = lambda: dist.all_reduce(torch.ones(10, dtype=torch.float32 if rank else torch.float64))  # noqa: E731
    elif kind == "op":
        call = lambda: dist.all_reduce(torch.ones(10), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM)  # noqa: E731
    elif kind == "src":
        call = lambda: dist.broadcast(torch.ones(10), src=rank)  # noqa: E731
    else:
        call = (lambda: dist.all_reduce(torch.ones(10))) if rank else (lambda: dist.broadcast(torch.ones(10), 0))
    inputs = [[make_input(980 + i, r, 20_000, torch.float32, "SUM") for r in range(world)] for i in range(4)]
    before = [inputs[i][rank].clone() for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in before]  # still under way at the mismatch
    start = time.monotonic()
    msg = raises(call, dist.DistBackendError)
    elapsed = time.monotonic() - start
    after = inputs[3][rank].clone()
    ended = ""  # on device streams the ranks may have issued later calls already: a mismatch ends the group
    try:
        dist.all_reduce(after)
    except dist.DistBackendError as e:
        ended = str(e)
    for work in works:
        work.wait()
    errors = [mismatch(f"all_reduce #{i}", t, reduce_reference(inputs[i], "SUM"), world)
              for i, t in enumerate(before + ([] if ended else [after]))]
    return msg, elapsed, ended, [e for e in errors if e]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("kind", ["numel", "dtype", "op", "src", "collective"])
@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_calls_fail_on_every_rank(world, kind, executor):
    """Every rank raises, before any byte of the call moves; the calls before finish right. On
    shared memory the group goes on; on device streams (the ranks issue ahead of each other) the
    next call raises that the group ended at the mismatch."""
    results = run_ranks(_mismatched, world, kind, pg_timeout_s=20, env=executor)
    for msg, elapsed, ended, errors in results:
        assert "mismatched calls" in msg, msg
        assert elapsed < 5
        assert errors == [], errors
        if executor:
            assert "mismatched calls" in ended and ("the group ends" in ended or "ends at an earlier" in ended), ended
        else:
            assert ended == "", ended


def _random_mismatch(rank, world, seed):
    """A group of random options; up to three async all-reduces under way; then one rank (`victim`) calls
    something else than its peers, in one of many ways; then an all-reduce that all agree on."""
    import random

    from test_random_sequences import _random_options

    rnd = random.Random(seed)  # every rank draws the same
    options = _random_options(rnd, world, nccl=True)
    victim, n = rnd.randrange(world), rnd.choice([1, 10, 1000, 70_001])
    group = dist.new_group(timeout=timedelta(seconds=15), pg_options=torch_hca.Options(**options))
    bad = rank == victim
    m = n + bad
    splits = [2 if bad and peer == (rank + 1) % world else 1 for peer in range(world)]
    dst = (victim + 1) % world if bad else victim
    calls = {
        "numel": lambda: dist.all_reduce(torch.ones(m), group=group),
        "dtype": lambda: dist.all_reduce(torch.ones(n, dtype=torch.float64 if bad else torch.float32), group=group),
        "op": lambda: dist.all_reduce(torch.ones(n), op=dist.ReduceOp.MAX if bad else dist.ReduceOp.SUM, group=group),
        "src": lambda: dist.broadcast(torch.ones(n), src=dst, group=group),
        "collective": lambda: (dist.broadcast(torch.ones(n), 0, group=group) if bad
                               else dist.all_reduce(torch.ones(n), group=group)),
        "all_gather numel": lambda: dist.all_gather_into_tensor(torch.empty(m * world), torch.ones(m), group=group),
        "reduce_scatter numel": lambda: dist.reduce_scatter_tensor(torch.empty(m), torch.ones(m * world), group=group),
        "all_to_all splits": lambda: dist.all_to_all_single(torch.empty(world), torch.ones(sum(splits)),
                                                            [1] * world, splits, group=group),
        "gather dst": lambda: dist.gather(torch.ones(n), [torch.empty(n) for _ in range(world)] if rank == dst else None,
                                          dst=dst, group=group),
        "barrier": lambda: dist.barrier(group=group) if bad else dist.all_reduce(torch.ones(n), group=group),
    }
    kind = rnd.choice(sorted(calls))
    inputs = [[make_input(seed * 10 + i, r, 5000, torch.float32, "SUM") for r in range(world)] for i in range(4)]
    before = [inputs[i][rank].clone() for i in range(rnd.randrange(4))]
    works = [dist.all_reduce(t, async_op=True, group=group) for t in before]
    start = time.monotonic()
    try:
        calls[kind]()
        msg = "UNEXPECTED: no exception"
    except (dist.DistBackendError, ValueError) as e:
        msg = str(e)
    elapsed = time.monotonic() - start
    for work in works:
        work.wait()
    after = inputs[3][rank].clone()
    try:
        dist.all_reduce(after, group=group)
        errors = [mismatch("after", after, reduce_reference(inputs[3], "SUM"), world)]
    except dist.DistBackendError as e:  # on device streams a mismatch may end the group
        errors = [] if "mismatched calls" in str(e) and os.environ.get("TORCH_HCA_CPU_EXECUTOR") else [str(e)]
    errors += [mismatch(f"all_reduce #{i}", t, reduce_reference(inputs[i], "SUM"), world) for i, t in enumerate(before)]
    return f"{kind} on rank {victim}, options {options}", msg, elapsed, [e for e in errors if e]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("seed", seeds(3))
def test_random_mismatches_fail_on_every_rank_and_the_group_goes_on(seed, executor):
    """Ten ways for one rank to call something else, on one node's groups of random options (the
    pass-through included), 2-4 ranks: every rank raises within seconds naming the mismatch, the calls
    before finish right, and so does the next call (on device streams, it may raise that the
    mismatch ended the group instead). (Across nodes a mismatch that one node finds
    mid-call ends the group, and reaches the other nodes as their engine's error or at the timeout:
    troubleshooting.md.) HCA_TEST_SEEDS=N runs N seeds."""
    world = 2 + seed % 3
    for what, msg, elapsed, errors in run_ranks(_random_mismatch, world, seed, env={**SMALL_CHUNKS, **executor},
                                                pg_timeout_s=20):
        assert "mismatched calls" in msg or "sends" in msg, (what, msg)
        assert elapsed < 10, (what, elapsed)
        assert errors == [], (what, errors)


# One rank's call is refused at the call (bad input) while its peers make theirs as it should be:
# the refused rank's own error, then what its peers raise.
ONE_RANK_REFUSES = {
    "a dtype hca does not reduce": (TypeError, "hca allreduce: dtype Float8_e4m3fn is not supported in reductions"),
    "BAND on floats": (ValueError, "hca allreduce: ReduceOp.BAND is not supported for float32"),
    "all_gather_into_tensor's output too long": (ValueError, "the output has"),
    "the gather root's list a tensor short": (ValueError, "the dst rank needs a gather_list of one tensor per rank"),
    "all_to_all_single's splits one too many": (ValueError, "input splits for"),
}


def _one_rank_refuses(rank, world, timeout_s, algorithm=None, after=True):
    bad = rank == 1
    calls = {
        "a dtype hca does not reduce": lambda g: dist.all_reduce(
            torch.ones(4).to(torch.float8_e4m3fn if bad else torch.float32), group=g),
        "BAND on floats": lambda g: dist.all_reduce(
            torch.ones(4), op=dist.ReduceOp.BAND if bad else dist.ReduceOp.SUM, group=g),
        "all_gather_into_tensor's output too long": lambda g: dist.all_gather_into_tensor(
            torch.empty(2 * world + bad), torch.ones(2), group=g),
        "the gather root's list a tensor short": lambda g: dist.gather(
            torch.ones(2), [torch.empty(2) for _ in range(world - 1)] if bad else None, dst=1, group=g),
        "all_to_all_single's splits one too many": lambda g: dist.all_to_all_single(
            torch.empty(world), torch.ones(world), input_split_sizes=[1] * (world + 1) if bad else None, group=g),
    }
    seen = {}
    for name, call in calls.items():
        options = torch_hca.Options(algorithm) if algorithm else None
        group = dist.new_group(timeout=timedelta(seconds=timeout_s), pg_options=options)
        start = time.monotonic()
        try:
            call(group)
            seen[name] = ("no error", "", 0.0, "")
        except Exception as e:  # noqa: BLE001
            seen[name] = (type(e).__name__, str(e), time.monotonic() - start, "")
        dist.barrier()  # the default group, untouched
        if after:  # the group goes on
            t = torch.full((3,), float(rank))
            try:
                dist.all_reduce(t, group=group)
                went_on = "" if t.tolist() == [world * (world - 1) / 2] * 3 else f"wrong: {t.tolist()}"
            except Exception as e:  # noqa: BLE001
                went_on = f"{type(e).__name__}: {e}"
            seen[name] = seen[name][:3] + (went_on,)
    return seen


@pytest.mark.parametrize("where", ["default", "nccl", "streams"])
def test_a_call_refused_on_one_rank_fails_its_peers_at_once(where):
    """Before, the refused rank raised at once and its peers waited for it until the timeout (as
    NCCL's and gloo's do); now the refusal takes the call's turn, and they raise at once, naming it,
    and the group goes on (on device streams, where the peers may have issued the call already, a
    refused collective of hca's own ends the group, every rank naming the refusal).
    (Every rank refusing alike leaves the group usable: test_misshapen_calls_are_value_errors_at_the_call.)"""
    world, timeout_s = 3, 60
    kw = {"env": STREAMS_ENV} if where == "streams" else group_kind(where)
    results = run_ranks(_one_rank_refuses, world, timeout_s, "nccl" if where == "nccl" else None, **kw)
    for rank, seen in enumerate(results):
        for name, (error, reason) in ONE_RANK_REFUSES.items():
            kind, msg, elapsed, went_on = seen[name]
            if where == "streams" and went_on:  # peers had issued the call on their device streams
                # "... so the group ends at collective #n", or, before the watchdog ended it, "this
                # process group ends at an earlier mismatch: ..."
                assert "refused at the call" in went_on and "group ends at" in went_on, (name, went_on)
            else:
                assert went_on == "", (name, went_on)
            if rank == 1:
                assert kind == error.__name__ and reason in msg, (name, kind, msg)
            else:
                assert kind == "DistBackendError" and "refused at the call" in msg and reason in msg, (name, msg)
                assert elapsed < timeout_s / 3, (name, elapsed)


def test_across_nodes_a_refusal_reaches_the_refused_ranks_node():
    """Across nodes, the node's own group carries the refusal: rank 1's node-mate (rank 3) raises
    naming it; the other node's ranks are not told, and raise by the timeout, as for any failure of
    another node's stages."""
    results = run_ranks(_one_rank_refuses, 4, 4, None, False,
                        env_per_rank=[{"TORCH_HCA_NODE_ID": node} for node in "abab"])
    for name, (error, reason) in ONE_RANK_REFUSES.items():
        if name in ("the gather root's list a tensor short", "all_to_all_single's splits one too many"):
            continue  # over every rank through gloo, agreed on: test_a_call_refused_on_one_rank_fails_its_peers_at_once
        assert results[1][name][0] == error.__name__, (name, results[1][name])
        kind, msg, _, _ = results[3][name]
        assert kind == "DistBackendError" and "refused at the call" in msg and reason in msg, (name, msg)
        for rank in (0, 2):
            assert results[rank][name][0] == "DistBackendError", (name, results[rank][name])


def _rank_1_lost_mid_collective(rank, world, signum):
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        dist.all_reduce(torch.ones(1 << 22), async_op=True)
        time.sleep(0.05)
        os.kill(os.getpid(), signum)
    start = time.monotonic()
    msg = raises(lambda: [dist.all_reduce(torch.ones(1 << 22)) for _ in range(50)], dist.DistBackendError)
    elapsed = time.monotonic() - start
    try:
        os.kill(pids[1], signal.SIGKILL)  # a stopped rank 1 ends with the test
    except ProcessLookupError:
        pass  # killed already
    return msg, elapsed


def _never_arrives(rank, world):
    if rank == 1:
        time.sleep(6)
        return "", 0.0
    start = time.monotonic()
    msg = raises(lambda: dist.all_reduce(torch.ones(100)), dist.DistBackendError)
    return msg, time.monotonic() - start


# How rank 1 is lost mid-collective, and what the others must say and when. A killed rank is
# noticed by liveness long before the timeout: the cause is the death, not a timeout. A stopped
# one has joined the collective and is alive as far as liveness can tell: only the deadline finds
# it, and the stream executor's watchdog names the peer whose progress word is furthest behind.
LOST = {
    "killed": (signal.SIGKILL, "rank 1 (pid", "died during the collective", 0.0),
    "stopped": (signal.SIGSTOP, "Timed out after 3000 ms", "waiting for rank 1", 2.5),
}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("lost", LOST)
def test_a_lost_rank_is_named_within_the_timeout(lost, world, executor):
    signum, first, second, at_least = LOST[lost]
    results = run_ranks(_rank_1_lost_mid_collective, world, signum, pg_timeout_s=3, allow_missing=(1,), env=executor)
    for rank, result in enumerate(results):
        if rank == 1:
            continue
        msg, elapsed = result
        assert "allreduce" in msg and first in msg and second in msg, msg
        assert at_least < elapsed < 3 + 5


PIDNS = pid_namespaces_unavailable()
needs_pidns = pytest.mark.skipif(PIDNS is not None, reason=f"pid namespaces: {PIDNS}")


@needs_pidns
@pytest.mark.parametrize("executor", EXECUTORS)
def test_ranks_in_other_pid_namespaces_are_alive_while_they_live(executor):
    """Rank 1 in a pid namespace of its own (containers sharing /dev/shm): waiting for a late
    rank 0, whose pid means nothing there, it must not take rank 0 for dead."""
    assert run_in_pid_namespaces("late_ranks", 3, [1], args=[[0]], env=executor) == [[]] * 3


@needs_pidns
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_rank_dying_in_another_pid_namespace_is_noticed_before_the_timeout(executor):
    got = run_in_pid_namespaces("node_dies", 3, [1], args=[[1]], timeout_s=60, allow_missing=(1,), env=executor)
    for kind, message, seconds in (got[0], got[2]):
        assert kind == "DistBackendError" and "rank 1 (pid" in message and "died" in message, message
        assert seconds < 10


@pytest.mark.parametrize("executor", EXECUTORS)
def test_missing_rank_times_out_with_its_name(executor):
    msg, elapsed = run_ranks(_never_arrives, 2, pg_timeout_s=3, env=executor)[0]
    assert "allreduce" in msg and "rank 1" in msg and "Timed out" in msg, msg
    assert 2.5 < elapsed < 3 + 5


def _allreduce_twice(rank, world):
    t = torch.full((100_000,), float(rank + 1))
    dist.all_reduce(t)
    dist.all_reduce(t, group=dist.new_group())
    return t[0].item()


# Users pass huge timeouts to mean "never"; 30 days in ms overflowed an int (a negative deadline).
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("days", [30, 10**6])
def test_huge_timeouts_mean_never(days, executor):
    world = 2
    want = float(world * (world + 1) / 2 * world)
    assert run_ranks(_allreduce_twice, world, pg_timeout_s=days * 86400, env=executor) == [want] * world


def _hostile_peer(rank, world, seeds):
    """For each seed, rank 1 scribbles over its words in a fresh group's control block and over its
    side of every channel; then every rank tries point-to-point with rank 1 and a collective.
    Errors are expected; a crash, a hang or a huge allocation is not."""
    outcomes = []
    for seed in seeds:
        group = dist.new_group(timeout=timedelta(seconds=2))  # the default group's is longer
        dist.all_reduce(torch.ones(1), group=group)  # set up and healthy
        # Every rank is out of it before rank 1 scribbles: with direct (small calls on 3 ranks) a rank
        # leaves an all-reduce as soon as it has summed, while its peers may still be reading.
        dist.barrier()
        if rank == 1:
            group._get_backend(torch.device("cpu"))._scribble_for_test(seed)
        dist.barrier()  # the default group, untouched: the scribbling is done
        peers = [r for r in range(world) if r != rank] if rank == 1 else [1]
        calls = {
            "point-to-point": lambda: [w.wait() for w in
                                       [dist.isend(torch.ones(100), p, group=group) for p in peers] +
                                       [dist.irecv(torch.empty(100), p, group=group) for p in peers]],
            "allreduce": lambda: dist.all_reduce(torch.ones(1000), group=group),
        }
        for name, call in calls.items():
            try:
                call()
                outcomes.append((seed, name, "ok"))
            except (dist.DistBackendError, ValueError, RuntimeError) as e:
                outcomes.append((seed, name, type(e).__name__))
        dist.barrier()
    return outcomes


def test_a_peers_text_keeps_whole_utf8_characters_and_always_decodes():
    """gloo's messages end in an emoji ("GLHF! 🏖️"), which ranks reading a peer's failure from shared
    memory showed as "GLHF! ???????". Whole characters are kept now; control bytes, cut characters and
    malformed sequences still become '?', so that the exception's message decodes."""
    import random

    show = torch_hca._C._peer_text
    assert show("GLHF! 🏖️".encode(), 64) == "GLHF! 🏖️"
    assert show(b"a\x01b\x7fc", 64) == "a?b?c"
    assert show("é€𝄞".encode()[:-1], 64) == "é€???"  # the last character cut
    # An overlong form, a surrogate, a code point past U+10FFFF, a byte no character starts with.
    assert show(b"\xc0\x80 \xed\xa0\x80 \xf4\x90\x80\x80 \xff", 64) == "?? ??? ???? ?"
    assert show(b"abcdef", 3) == "abc"
    rnd = random.Random(0)
    whole = 0
    for _ in range(3000):
        raw = bytes(rnd.choice([rnd.randrange(0x20, 0x7f), rnd.randrange(0x80, 0x100)])
                    for _ in range(rnd.randrange(12)))
        shown = show(raw, 64)  # a str: it decoded
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            assert "?" in shown and len(shown) <= len(raw), (raw, shown)
            continue
        assert shown == text, (raw, shown)
        whole += 1
    assert whole > 300, whole  # enough valid text among the draws


@pytest.mark.parametrize("world", [2, 3])
def test_a_hostile_peer_gives_errors_not_crashes(world):
    results = run_ranks(_hostile_peer, world, list(range(12)), pg_timeout_s=60)
    assert all(len(r) == 24 for r in results), results
    # Most seeds break something at the victims (rank 0): the fuzz reaches the checks.
    assert sum(outcome != "ok" for _, _, outcome in results[0]) >= 12, results[0]


def _first_allreduce(rank, world):
    t = torch.ones(4)
    dist.all_reduce(t)
    return t.tolist()


# Rank 1's staging differs from rank 0's: in size, or only in how the same bytes are cut
# into slots (which a size check alone would let through, to corrupt results silently).
_DEFAULT_CHUNK, _DEFAULT_SLOTS = shm_chunk_bytes({}), shm_slots({})
STAGING_MISMATCHES = {
    "chunk size": {"TORCH_HCA_SHM_CHUNK_BYTES": str(_DEFAULT_CHUNK // 2)},
    "same bytes, other slots": {"TORCH_HCA_SHM_CHUNK_BYTES": str(_DEFAULT_CHUNK // 2),
                                "TORCH_HCA_SHM_SLOTS": str(_DEFAULT_SLOTS * 2)},
}


@pytest.mark.parametrize("mismatch", STAGING_MISMATCHES)
def test_different_staging_across_ranks_fails_at_init(mismatch):
    # Rank 1 refuses rank 0's staging segment and publishes why; rank 0, waiting for it to
    # attach, raises that cause at once instead of after the 30 s timeout.
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_first_allreduce, 2, env_per_rank=[{}, STAGING_MISMATCHES[mismatch]], pg_timeout_s=30)
    text = str(failed.value)
    assert text.count("TORCH_HCA_SHM_CHUNK_BYTES and TORCH_HCA_SHM_SLOTS must be the same on every rank") == 2, text
    assert f"{_DEFAULT_SLOTS} slots of {_DEFAULT_CHUNK} bytes per rank" in text, text
    assert "rank 0:" in text and "rank 1 failed to set up the process group" in text, text
    assert time.monotonic() - start < 20


# Whoever can write the store (a TCPStore takes any client) could name another segment to attach.
SEGMENTS = {
    "ours": ("torch_hca_test_{}", 0o600, None, None),
    "readable by others": ("torch_hca_test_{}", 0o644, None, "mode 0644: refusing"),
    "another prefix": ("other_test_{}", 0o600, None, "refusing"),
    "another owner": ("torch_hca_test_{}", 0o600, 65534, "owned by uid 65534"),
}


@pytest.mark.parametrize("case", SEGMENTS)
def test_only_our_own_segments_are_attached(case):
    pattern, mode, owner, refused = SEGMENTS[case]
    if owner is not None and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    name = pattern.format(os.getpid())
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.ftruncate(fd, 4096)
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, owner, -1)
        store = dist.HashStore()
        store.set("seg", f"{torch_hca._C.shared_memory_identity()}\n/{name}\ntest layout")
        attach = lambda: torch_hca._C._join_shared_segment(store, "seg", 1, 2, 4096, "test layout", 1000)  # noqa: E731
        if refused is None:
            attach()
        else:
            with pytest.raises(RuntimeError, match=refused):
                attach()
        assert store.add("seg_attached", 0) == 1  # rank 0 is never left waiting
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


def test_segments_left_by_a_creator_that_died_are_swept_at_init():
    # Rank 0 killed between creating a segment and every rank attaching leaves it named in
    # /dev/shm; the next group created on this machine removes it (and only it).
    dead = subprocess.Popen(["true"])
    dead.wait()
    namespace = os.readlink("/proc/self/ns/pid")[len("pid:["):-1]
    stale = f"/dev/shm/torch_hca_{namespace}_{dead.pid}_00000000deadbeef"
    live = f"/dev/shm/torch_hca_{namespace}_{os.getpid()}_00000000cafecafe"
    try:
        for path in (stale, live):
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        assert run_ranks(_first_allreduce, 2) == [[2.0] * 4] * 2
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


_NO_PID_NAMESPACE_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>
ssize_t readlink(const char* path, char* buf, size_t size) {
  static ssize_t (*real)(const char*, char*, size_t);
  if (strcmp(path, "/proc/self/ns/pid") == 0) {
    errno = EACCES;
    return -1;
  }
  if (!real) real = (ssize_t (*)(const char*, char*, size_t))dlsym(RTLD_NEXT, "readlink");
  return real(path, buf, size);
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the LD_PRELOAD shim")
def test_a_rank_that_cannot_read_its_pid_namespace_sweeps_nothing(tmp_path, monkeypatch):
    # Ranks whose /proc/self/ns/pid is unreadable (a sandbox): their namespace is unknown, and
    # unknown matches nothing. Before, it read as "0", the namespace of every other such process,
    # and a segment such a process (in another container) had made was swept as its pid is not
    # alive here.
    source = tmp_path / "no_pid_ns.c"
    source.write_text(_NO_PID_NAMESPACE_SHIM)
    shim = tmp_path / "no_pid_ns.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"], check=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    theirs = f"/dev/shm/torch_hca_0_{dead.pid}_00000000deadbeef"
    before = set(glob.glob("/dev/shm/torch_hca_unknown_*"))
    try:
        os.close(os.open(theirs, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        monkeypatch.setenv("LD_PRELOAD", str(shim))  # the spawned ranks load it (a fork would not)
        assert run_ranks(_first_allreduce, 2, fresh_interpreter=True) == [[2.0] * 4] * 2
        assert os.path.exists(theirs)
    finally:
        if os.path.exists(theirs):
            os.unlink(theirs)
    assert set(glob.glob("/dev/shm/torch_hca_unknown_*")) == before  # the group's own are gone again


def test_too_little_shared_memory_is_named_at_init():
    # A staging ring four times the size of /dev/shm: tmpfs refuses it at once, before any page is used.
    stat = os.statvfs("/dev/shm")
    room = stat.f_blocks * stat.f_frsize
    if room == 0:
        pytest.skip("/dev/shm has no size limit here")
    chunk = (4 * room // (2 * _DEFAULT_SLOTS) // 4096 + 1) * 4096
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_first_allreduce, 2, env={"TORCH_HCA_SHM_CHUNK_BYTES": str(chunk)}, pg_timeout_s=30)
    text = str(failed.value)
    assert "in /dev/shm for the hca_shm_staging segment" in text and "No space left on device" in text, text
    assert f"{_DEFAULT_SLOTS} slots of {chunk} bytes per rank" in text and "TORCH_HCA_SHM_CHUNK_BYTES" in text, text
    assert time.monotonic() - start < 20


def test_unknown_cpu_executor_is_named_at_init():
    with pytest.raises(RankFailed) as failed:
        run_ranks(_first_allreduce, 1, env={"TORCH_HCA_CPU_EXECUTOR": "gpu"})
    assert "TORCH_HCA_CPU_EXECUTOR='gpu': expected 'shm' (the default) or 'streams'" in str(failed.value)


def _first_allreduce_error(rank, world):
    start = time.monotonic()
    msg = raises(lambda: dist.all_reduce(torch.ones(4)), dist.DistBackendError)
    after = raises(lambda: dist.all_reduce(torch.ones(4)), dist.DistBackendError)
    return msg, after, time.monotonic() - start


def test_different_stream_staging_fails_at_the_first_collective():
    # The stream executor sets its staging up at the first collective (CUDA: on its device; the
    # self-test's, which runs first), so a mismatch surfaces there, on both ranks, and leaves the
    # group unusable. Rank 0's streams are released by rank 1's poison: its collective must fail
    # too, not pass with rank 1's garbage.
    envs = [STREAMS_ENV, {**STREAMS_ENV, **STAGING_MISMATCHES["chunk size"]}]
    for msg, after, elapsed in run_ranks(_first_allreduce_error, 2, env_per_rank=envs, pg_timeout_s=30):
        assert "allreduce, the group's first collective on cpu tensors, failed in the self-test" in msg, msg
        assert "self-test hierarchical_copy " in msg and "setting up its executor" in msg, msg
        assert "TORCH_HCA_SHM_CHUNK_BYTES and TORCH_HCA_SHM_SLOTS must be" in msg, msg
        assert "collective #1" in after and "unusable" in after, after
        assert elapsed < 20


def _faulting_device(rank, world):
    """Rank 0's model of the device faults at its 40th data operation (TORCH_HCA_MODEL_FAULT_AT)."""
    start = time.monotonic()
    msg = raises(lambda: [dist.all_reduce(torch.ones(100_000)) for _ in range(50)], dist.DistBackendError)
    return msg, time.monotonic() - start


def test_a_faulted_device_fails_its_rank_and_its_peers_at_once():
    # A faulted GPU context never passes its events: the faulted rank must not report success,
    # and its peers must hear the cause instead of waiting the whole timeout.
    untested = {**STREAMS_ENV, "TORCH_HCA_SELF_TEST": "0"}  # the 40th operation is the test's
    envs = [{**untested, "TORCH_HCA_MODEL_FAULT_AT": "40"}, untested, untested]
    results = run_ranks(_faulting_device, 3, env_per_rank=envs, pg_timeout_s=30)
    faulted, elapsed = results[0]
    assert "faulted" in faulted and "injected fault at data operation 40" in faulted, faulted
    for msg, elapsed in results:
        assert "injected fault" in msg, msg
        assert elapsed < 10, elapsed
    for msg, _ in results[1:]:
        assert "rank 0 failed" in msg, msg


def _issuing_while_a_peer_dies(rank, world):
    """Rank 1 dies while rank 0 keeps issuing async calls: every call rank 0 made either raises
    or holds the right sum, never a wrong value reported as success."""
    if rank == 1:
        dist.all_reduce(torch.ones(10))
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(10))
    works = []
    for i in range(300):
        t = torch.full((50_000,), float(i))
        works.append((dist.all_reduce(t, async_op=True), t, i))
        time.sleep(0.002)
    wrong, raised, right = [], 0, 0
    for work, t, i in works:
        try:
            work.wait()
        except dist.DistBackendError:
            raised += 1
            continue
        if torch.equal(t, torch.full((50_000,), float(i * world))):
            right += 1
        else:
            wrong.append(i)
    return wrong, raised, right


@pytest.mark.parametrize("executor", EXECUTORS)
def test_calls_issued_around_a_failure_raise_or_are_right(executor):
    wrong, raised, right = run_ranks(_issuing_while_a_peer_dies, 2, pg_timeout_s=10, allow_missing=(1,),
                                     env=executor)[0]
    assert wrong == [] and raised > 0, (wrong, raised, right)


def _survivors_go_on(rank, world, device):
    """Rank 2 dies mid-collective; ranks 0 and 1 hear it, then go on in a group of their own."""
    dev = rank_device(device, rank)
    survivors = dist.new_group([0, 1])
    if rank == 2:  # dies with collectives under way, its peers' streams waiting on it
        works = [dist.all_reduce(torch.ones(1 << 20, device=dev), async_op=True) for _ in range(20)]
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    msg = raises(lambda: [dist.all_reduce(torch.ones(1 << 20, device=dev)) for _ in range(50)], dist.DistBackendError)
    inputs = [make_input(9, r, 300_000, torch.float32, "SUM") for r in (0, 1)]
    t = inputs[rank].to(dev, copy=True)
    dist.all_reduce(t, group=survivors)
    dist.destroy_process_group(survivors)
    return msg, mismatch("survivors' allreduce", t, reduce_reference(inputs, "SUM"), 2)


# Once released, the survivors' streams must not touch the dead rank's staging: on a GPU a fault
# there would break every group of the process (the model's device faults as a whole, too).
@pytest.mark.parametrize("device,executor", [
    ("cpu", {}), ("cpu", STREAMS_ENV),
    pytest.param("cuda", {}, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
], ids=["shm", "streams", "cuda"])
def test_survivors_of_a_dead_peer_go_on_in_a_group_without_it(device, executor):
    for msg, wrong in run_ranks(_survivors_go_on, 3, device, pg_timeout_s=10, allow_missing=(2,), env=executor)[:2]:
        assert "rank 2 (pid" in msg and "died" in msg, msg
        assert wrong is None, wrong
