"""The life of a group beyond its collectives: shutdown and abort (a group still referenced after
destroy_process_group lets go of everything), and children forked after init."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from harness import STREAMS_ENV, raises, run_ranks, shared_mappings
from reference import make_input, mismatch, reduce_reference

EXECUTORS = [pytest.param({}, id="shm"), pytest.param(STREAMS_ENV, id="streams")]
LAYOUTS = EXECUTORS + [pytest.param(dict(env_per_rank=[{"TORCH_HCA_NODE_ID": n} for n in "aab"]), id="nodes")]
PASSTHROUGH = pytest.param({"TORCH_HCA_ALGORITHM": "nccl"}, id="passthrough")  # agreeing through shared memory


def _layout(layout):
    """run_ranks keywords for a LAYOUTS entry (an executor's env, or nodes by rank)."""
    return layout if "env_per_rank" in layout else dict(env=layout)


def _threads():
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _checked_allreduce(rank, world, group, case):
    inputs = [make_input(case, r, 3000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t, group=group)
    return mismatch(f"allreduce {case}", t, reduce_reference(inputs, "SUM"), world)


def _used_group(rank, world, case):
    """A new group after an all-reduce and a send and receive on it: (group, what went wrong)."""
    group = dist.new_group(backend="hca")
    wrong = _checked_allreduce(rank, world, group, case)
    peer = (rank + 1) % world
    recv = dist.irecv(torch.empty(10), src=(rank - 1) % world, group=group)  # starts the mailbox's thread
    dist.send(torch.ones(10), dst=peer, group=group)
    recv.wait()
    del recv  # on the model of the device its stream's event keeps that stream (a thread) while it lives
    return group, wrong


def _kept_after_destroy(rank, world):
    """A group referenced after destroy_process_group (as a DDP model in scope keeps its group):
    threads and mappings before it, while it runs, after the destroy, and after a second group's
    life; what went wrong in either; and a later call's error."""
    dist.barrier()  # the world group's executor is set up at its first collective: before the count
    threads, mappings = [_threads()], [shared_mappings()]
    group, wrong = _used_group(rank, world, 1)
    threads.append(_threads())
    mappings.append(shared_mappings())
    dist.barrier()  # every rank is done with the group before any destroys it
    dist.destroy_process_group(group)
    threads.append(_threads())
    mappings.append(shared_mappings())
    message = raises(lambda: group.allreduce([torch.ones(4)]).wait(), dist.DistBackendError)
    second, wrong_second = _used_group(rank, world, 2)
    dist.barrier()
    dist.destroy_process_group(second)
    threads.append(_threads())
    mappings.append(shared_mappings())
    return threads, mappings, wrong or wrong_second, message


@pytest.mark.parametrize("layout", EXECUTORS)  # across nodes, gloo keeps its threads (it has no shutdown)
def test_a_group_kept_after_destroy_lets_go_of_its_threads_and_memory(layout):
    for threads, mappings, wrong, message in run_ranks(_kept_after_destroy, 3, **_layout(layout)):
        assert wrong is None, wrong
        assert threads[1] > threads[0] and mappings[1] > mappings[0], (threads, mappings)
        # The group's streams outlive it, for tensors that used them (on the model, a thread each:
        # its collectives' and its messages'), and serve the next group: the second adds nothing.
        kept_streams = 2 if layout == STREAMS_ENV else 0
        assert threads[2] <= threads[0] + kept_streams and mappings[2] == mappings[0], (threads, mappings)
        assert threads[3] <= threads[2] and mappings[3] == mappings[0], (threads, mappings)
        assert "this process group was shut down" in message or "the process group was shut down" in message, message


def _messages_on_four_groups(rank, world):
    """Threads before four groups' messages, after them, and after the groups are destroyed."""
    groups = [dist.new_group() for _ in range(4)]
    for group in groups:
        _checked_allreduce(rank, world, group, 3)  # each group's own threads (its collectives') started
    threads = [_threads()]
    for group in groups:
        recv = dist.irecv(torch.empty(10), src=(rank - 1) % world, group=group)
        dist.send(torch.ones(10), dst=(rank + 1) % world, group=group)
        recv.wait()
    threads.append(_threads())
    dist.barrier()
    for group in groups:
        dist.destroy_process_group(group)
    threads.append(_threads())
    return threads


def test_a_process_moves_the_messages_of_all_its_groups_on_one_thread():
    """DeviceMesh makes several groups: each used to start a message thread of its own."""
    for before, during, after in run_ranks(_messages_on_four_groups, 3):
        assert during == before + 1 and after < before, (before, during, after)


def _ended_with_work_pending(rank, world, how):
    """Rank 0 aborts a group with a receive and a collective pending, or destroys it; the others
    then call into it. What each rank's calls raised, and how long they took."""
    group = dist.new_group(backend="hca", timeout=timedelta(seconds=60))
    assert _checked_allreduce(rank, world, group, 2) is None
    got = []
    if rank == 0:
        start = time.monotonic()
        if how == "abort":
            pending = [group.recv([torch.empty(100)], 1, 7),
                       dist.all_reduce(torch.ones(1000), group=group, async_op=True)]  # the others never join
            time.sleep(0.2)
            start = time.monotonic()
            _abort_process_group(group)
            for work in pending:
                got.append(raises(lambda: work.wait(timeout=timedelta(seconds=10)), dist.DistBackendError))
        else:
            dist.destroy_process_group(group)
        got.append(time.monotonic() - start)
        dist.barrier()
    else:
        dist.barrier()  # rank 0 has ended the group
        start = time.monotonic()
        got.append(raises(lambda: dist.all_reduce(torch.ones(1000), group=group), dist.DistBackendError))
        got.append(time.monotonic() - start)
        dist.destroy_process_group(group)
    return got


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("world", [2, 3])
def test_abort_fails_pending_work_at_once_and_peers_learn_why(world, executor):
    results = run_ranks(_ended_with_work_pending, world, "abort", env=executor)
    recv, collective, seconds = results[0]
    assert "destroyed first" in recv, recv
    assert "rank 0 aborted its process group" in collective, collective
    assert seconds < 2
    for message, seconds in results[1:]:
        assert "rank 0 failed: rank 0 aborted its process group" in message, message
        assert seconds < 5


@pytest.mark.parametrize("executor", EXECUTORS)
def test_peers_of_a_rank_that_destroyed_the_group_learn_that_it_left(executor):
    results = run_ranks(_ended_with_work_pending, 3, "destroy", env=executor)
    for message, seconds in results[1:]:
        assert "rank 0 left: its process group was shut down" in message, message
        assert seconds < 5


ENDS_UNASKED = textwrap.dedent("""
    import sys, datetime, torch, torch.distributed as dist, torch_hca
    dist.init_process_group("hca", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    dist.all_reduce(torch.ones(3))
    if dist.get_rank() == 1:
        raise RuntimeError("a bug in the training loop")  # unhandled: the process ends, the group not destroyed
    try:
        dist.all_reduce(torch.ones(3))
    except RuntimeError as e:
        print(e)
""")


def test_a_peer_that_ended_without_destroying_its_group_is_not_said_to_have_destroyed_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ENDS_UNASKED)
    url = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([sys.executable, str(script), url, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    (out, err), _ = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 0 and procs[1].returncode == 1, err
    assert "rank 1 left: its process group ended without destroy_process_group" in out, out + err
    assert "shut down (destroy_process_group)" not in out, out


def _wait_for_child(pid, seconds):
    """The child's exit status, or None if it is still running after `seconds` (then killed)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _fork_after_init(rank, world):
    """Each rank forks a child that tries its parent's group, then destroys it; the parents go
    on. Returns the child's errors and exit status, and the parents' mismatches after it."""
    dist.all_reduce(torch.ones(8))
    pending = dist.all_reduce(torch.ones(8), async_op=True)  # the parent's: the child may not wait for it
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            calls = [lambda: dist.all_reduce(torch.ones(8)), lambda: dist.send(torch.ones(2), (rank + 1) % world),
                     lambda: dist.broadcast(torch.ones(2), 0), dist.barrier, backend.get_error, pending.wait]
            errors = [raises(call, dist.DistBackendError) for call in calls]
            dist.destroy_process_group()  # neither hangs nor ends the parent's group
            os.write(write, json.dumps(errors).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    pending.wait()
    status = _wait_for_child(child, 30)
    with os.fdopen(read) as f:
        errors = json.loads(f.read() or "[]")
    inputs = [make_input(77, r, 5000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    return errors, status, mismatch("allreduce after the fork", t, reduce_reference(inputs, "SUM"), world)


@pytest.mark.parametrize("layout", LAYOUTS + [PASSTHROUGH])
def test_a_child_forked_after_init_is_refused_and_leaves_the_group_alone(layout):
    for errors, status, wrong in run_ranks(_fork_after_init, 3, pg_timeout_s=20, **_layout(layout)):
        assert status == 0 and wrong is None, (status, wrong)
        assert len(errors) == 6
        for message in errors:
            assert "was forked from the one that created the process group" in message, message


def _parent_dies_with_a_child_alive(rank, world):
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        if os.fork() == 0:  # a DataLoader worker, say: it outlives its parent a while
            time.sleep(20)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    message = raises(lambda: [dist.all_reduce(torch.ones(100)) for _ in range(100)], dist.DistBackendError)
    return message, time.monotonic() - start


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_rank_dead_while_its_forked_child_lives_is_noticed(executor):
    for message, seconds in run_ranks(_parent_dies_with_a_child_alive, 3, pg_timeout_s=60, allow_missing=(1,),
                                      env=executor)[::2]:
        assert "rank 1 (pid" in message and "died" in message, message
        assert seconds < 10




def _ended_from_another_thread(rank, world, how, executor_tries):
    """Groups ended (abort, shutdown, or both at once from two threads) while another thread is
    inside a blocking all-reduce of 16 MiB: per try, how many of its calls gave the right sum and
    the error that stopped it (None: every call ended before the group did)."""
    import random
    import threading

    inputs = [make_input(5, r, 4 << 20, torch.float32, "SUM") for r in range(world)]
    expected = reduce_reference(inputs, "SUM")
    outcomes = []
    for attempt in range(executor_tries):
        group = dist.new_group(backend="hca")
        backend = group._get_backend(torch.device("cpu"))
        outcome = {"right": 0, "error": None}

        def calls():
            try:
                for _ in range(8):
                    t = inputs[rank].clone()
                    dist.all_reduce(t, group=group)
                    wrong = mismatch("allreduce", t, expected, world)
                    assert wrong is None, wrong
                    outcome["right"] += 1
            except dist.DistBackendError as e:
                outcome["error"] = str(e)

        caller = threading.Thread(target=calls)
        caller.start()
        time.sleep(random.Random(attempt * world + rank).uniform(0.0, 0.08))
        enders = {"abort": [backend.abort], "shutdown": [backend.shutdown],
                  "both": [backend.abort, backend.shutdown]}[how]
        threads = [threading.Thread(target=end) for end in enders]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        caller.join(60)
        outcome["hung"] = caller.is_alive()
        outcome["later"] = raises(lambda: dist.all_reduce(torch.ones(4), group=group), dist.DistBackendError)
        outcomes.append(outcome)
    return outcomes


@pytest.mark.parametrize("how", ["abort", "shutdown", "both"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_group_ended_while_another_thread_is_inside_a_call(how, world):
    """shutdown/abort (or both at once) from one thread while another is inside a blocking call:
    that call gives the right sum or a clear error, never a crash or a hang (c908507 crashed 1 try
    in 4 on abort, every try on shutdown; hung or crashed when both came at once)."""
    for rank_outcomes in run_ranks(_ended_from_another_thread, world, how, 4, deadline_s=200):
        for outcome in rank_outcomes:
            assert not outcome["hung"], outcome
            if outcome["error"] is not None:
                assert any(word in outcome["error"] for word in ("abort", "shut down", "left")), outcome
            assert "aborted" in outcome["later"] or "shut down" in outcome["later"], outcome


def _engine_group_ended(rank, world, how, algorithm):
    """A group that hands calls to stock engines (algorithm="nccl": gloo for CPU tensors; or a
    group across nodes), ended by shutdown, or by abort and shutdown at once from two threads,
    after a checked all-reduce: what a later call raises. (Not while a call is inside, as above:
    gloo cannot be interrupted, so a peer's call would wait for the timeout.)"""
    import torch_hca

    group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm))
    backend = group._get_backend(torch.device("cpu"))
    inputs = [make_input(6, r, 1000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t, group=group)
    wrong = mismatch("allreduce", t, reduce_reference(inputs, "SUM"), world)
    dist.barrier()
    enders = {"shutdown": [backend.shutdown], "both": [backend.abort, backend.shutdown]}[how]
    threads = [threading.Thread(target=end) for end in enders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    backend.shutdown()  # again: nothing more happens
    return wrong, type(backend).__name__, raises(lambda: dist.all_reduce(torch.ones(4), group=group),
                                                 dist.DistBackendError)


@pytest.mark.parametrize("how", ["shutdown", "both"])
@pytest.mark.parametrize("layout", ["passthrough", "nodes"])
def test_a_group_of_stock_engines_ends_once_and_refuses_later_calls(layout, how):
    """Ending runs once whoever asks (shutdown and abort at once from two threads, then shutdown
    again), and a later call raises hca's error. Before these groups' ending went through the
    group's life, a call after shutdown went through to gloo (which has no shutdown)."""
    env = [{"TORCH_HCA_NODE_ID": n} for n in "aab"] if layout == "nodes" else None
    algorithm = "hierarchical_copy" if layout == "nodes" else "nccl"
    for wrong, kind, later in run_ranks(_engine_group_ended, 3, how, algorithm, env_per_rank=env):
        assert wrong is None and kind == ("NodeBackend" if layout == "nodes" else "PassthroughBackend"), (wrong, kind)
        assert later.startswith("hca allreduce: this process group was ") and \
            ("shut down" in later or "aborted" in later), later


def _ended_from_its_own_callback(rank, world, how, kind):
    """A Future's callback ends its own group (shutdown, abort, destroy_process_group) on the
    thread that completed the Future: the group's worker (a collective) or its message thread (a
    receive). Rank 1 joins 0.3 s late, so that rank 0's callback is attached before completion.
    What the callback's end did, whether it ran off the main thread, and what a later call raises.
    Before a shutdown from a receive's callback, that callback sends rank 1 a message nobody waits
    on: shutting down delivers it (another thread moves it while the callback waits)."""
    group = dist.new_group()
    backend = group._get_backend(torch.device("cpu"))
    seen = []
    sends_first = kind == "message" and how == "shutdown"

    def end(_):
        seen.append(threading.current_thread() is not threading.main_thread())
        if sends_first:
            dist.isend(torch.arange(1000.0), 1, group=group)
        ends = {"shutdown": backend.shutdown, "abort": backend.abort,
                "destroy": lambda: dist.destroy_process_group(group)}
        seen.append(raises(ends[how], Exception))

    if rank == 1:
        time.sleep(0.3)
    if kind == "collective":
        fut = dist.all_reduce(torch.ones(1 << 20), group=group, async_op=True).get_future()
    elif rank == 0:
        fut = dist.irecv(torch.empty(1000), 1, group=group).get_future()
    else:
        dist.send(torch.ones(1000), 0, group=group)
        got = torch.empty(1000)
        if sends_first:
            dist.recv(got, 0, group=group)
        dist.barrier()
        return torch.equal(got, torch.arange(1000.0)) if sends_first else None
    fut.then(end).wait()
    later = raises(lambda: backend.allreduce([torch.ones(4)]).wait(), dist.DistBackendError)
    dist.barrier()
    return seen, later


@pytest.mark.parametrize("kind, how", [("collective", "shutdown"), ("collective", "abort"), ("collective", "destroy"),
                                       ("message", "shutdown"), ("message", "destroy")])
def test_a_group_ended_from_its_own_future_callback(kind, how):
    """It used to abort the process (a thread joining itself)."""
    results = run_ranks(_ended_from_its_own_callback, 2, how, kind)
    off_main, outcome = results[0][0]
    later = results[0][1]
    if kind == "message":
        assert results[1] is (how == "shutdown" or None), results[1]  # rank 1 got the callback's message
    assert off_main and outcome == "UNEXPECTED: no exception", results[0]
    assert "shut down" in later or "aborted" in later, later
