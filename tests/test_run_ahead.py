"""Calls on device tensors never hold the caller's thread for a late peer: on the CPU model of the
device with its host running ahead of its streams (TORCH_HCA_MODEL_RUN_AHEAD=1), as a GPU's host
does, a blocking all-reduce returns once its work is on the streams, the peers meet on the device,
and the results are right once the host synchronizes. Every test here fails where a call waits on
the host for its peers' hosts (each call's census before issuing, as hca did before)."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import STREAMS_ENV, run_ranks
from reference import make_input, mismatch, reduce_reference

from torch_hca import _C

RUN_AHEAD = {**STREAMS_ENV, "TORCH_HCA_MODEL_RUN_AHEAD": "1"}
CALLS, LATE_S = 20, 0.2


def _late_rank(rank, world, mismatch_at):
    """The last rank comes LATE_S late to CALLS blocking all-reduces; with `mismatch_at`, rank 1's
    call of that index has one element more. Returns the host seconds of the CALLS calls, the
    errors raised (by the calls, and by one more call after synchronizing), and wrong results."""
    warm = torch.ones(4)
    dist.all_reduce(warm)  # the self-test and the device's set-up, on the host
    _C._model.synchronize()
    dist.barrier()
    inputs = [[make_input(700 + i, r, 3000 + 7 * i, torch.float32, "SUM") for r in range(world)] for i in range(CALLS)]
    mine = [inputs[i][rank].clone() for i in range(CALLS)]
    if rank == 1 and mismatch_at is not None:
        mine[mismatch_at] = torch.cat([mine[mismatch_at], torch.ones(1)])
    if rank == world - 1:
        time.sleep(LATE_S)
    errors = []
    start = time.perf_counter()
    for t in mine:
        try:
            dist.all_reduce(t)
        except dist.DistBackendError as e:
            errors.append(str(e))
    host_s = time.perf_counter() - start
    _C._model.synchronize()
    if mismatch_at is not None:
        try:
            dist.all_reduce(torch.ones(4))
        except dist.DistBackendError as e:
            errors.append(str(e))
        _C._model.synchronize()
    last = CALLS if mismatch_at is None else mismatch_at
    wrong = [mismatch(f"all_reduce #{i}", mine[i], reduce_reference(inputs[i], "SUM"), world) for i in range(last)]
    return host_s, errors, [w for w in wrong if w]


@pytest.mark.parametrize("world", [2, 3])
def test_a_late_peer_never_holds_the_host_of_a_blocking_call(world):
    """The early ranks' hosts return from the 20 calls in far less than the late rank's 0.2 s
    (each call waited the 0.2 s out on the host before); every element right after synchronizing."""
    results = run_ranks(_late_rank, world, None, env=RUN_AHEAD, pg_timeout_s=30)
    for rank, (host_s, errors, wrong) in enumerate(results):
        assert errors == [] and wrong == [], (rank, errors, wrong)
        if rank < world - 1:
            assert host_s < LATE_S / 2, (rank, host_s)


@pytest.mark.parametrize("world", [2, 3])
def test_a_mismatch_among_calls_run_ahead_is_named_on_every_rank(world):
    """Call #10 differs on rank 1 while the others have run ahead: every rank raises naming the
    mismatch (at the call on a rank that compares there, else at its next call once the streams
    drained); the calls before it are right, and the group ends there (the ranks issued later
    calls on their streams already)."""
    at = 10
    results = run_ranks(_late_rank, world, at, env=RUN_AHEAD, pg_timeout_s=30)
    for rank, (host_s, errors, wrong) in enumerate(results):
        assert wrong == [], (rank, wrong)
        assert errors, rank
        named = [e for e in errors if "mismatched calls" in e and f"collective #{at + 3}" in e]
        assert named, (rank, errors)
        assert "the group ends" in errors[-1] or "ends at an earlier mismatch" in errors[-1], (rank, errors[-1])


def _two_groups(rank, world):
    """Group A is ranks 0 and 1, group B ranks 0 and 2; rank 1 comes LATE_S late to A. Rank 0 makes
    its A call (async, not waited) and then B's calls; rank 2 makes B's calls only. Returns rank 0's
    host seconds for all its calls, the seconds until B's results were on rank 2's host, and wrong results."""
    a = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    b = dist.new_group([0, 2], timeout=timedelta(seconds=30))
    for group in (a, b):
        if rank in dist.get_process_group_ranks(group):
            dist.all_reduce(torch.ones(4), group=group)  # self-tests, set-ups
    _C._model.synchronize()
    dist.barrier()
    inputs = [[make_input(800 + i, r, 5000, torch.float32, "SUM") for r in range(2)] for i in range(6)]
    mine = [inputs[i][min(rank, 1)].clone() for i in range(6)]
    wrong, host_s, b_done_s = [], 0.0, 0.0
    start = time.perf_counter()
    if rank == 1:
        time.sleep(LATE_S)
        dist.all_reduce(mine[0], group=a)
    if rank == 0:
        work = dist.all_reduce(mine[0], group=a, async_op=True)
    if rank != 1:
        for t in mine[1:]:
            dist.all_reduce(t, group=b)
        host_s = time.perf_counter() - start
        _C._model.synchronize()
        b_done_s = time.perf_counter() - start
        wrong += [mismatch(f"B's all_reduce #{i}", mine[i], reduce_reference(inputs[i], "SUM"), 2) for i in range(1, 6)]
    if rank == 0:
        work.wait()
    _C._model.synchronize()
    if rank != 2:
        wrong.append(mismatch("A's all_reduce", mine[0], reduce_reference(inputs[0], "SUM"), 2))
    dist.barrier()
    return host_s, b_done_s, [w for w in wrong if w]


def test_a_late_peer_of_one_group_never_holds_another_groups_calls():
    """Before, rank 0's B calls waited on its host for A's late peer (A's call held the device's
    issue order while it waited for rank 1), and so did rank 2's B results."""
    results = run_ranks(_two_groups, 3, env=RUN_AHEAD, pg_timeout_s=30)
    (host0, _, wrong0), (_, b_done2, wrong2) = results[0], results[2]
    assert wrong0 == [] and wrong2 == [], (wrong0, wrong2)
    assert host0 < LATE_S / 2, host0
    assert b_done2 < LATE_S / 2, b_done2
