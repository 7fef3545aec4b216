"""What the CPU model of the device (TORCH_HCA_CPU_EXECUTOR=streams) checks that a GPU would:
several devices, each thread's current device, the caller's own current stream, exclusive
devices, peers' memory that goes with them, faults. A rank here stands on device `rank` of
`world` model devices and never sets a current device, as a script that only moves its tensors
to cuda:rank does; every test fails where the code ignores one of CUDA's rules."""
import os
import re
import signal
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import SMALL_CHUNKS, STREAMS_ENV, WaitingFinalizer, run_ranks, watch_until
from reference import make_input, mismatch, reduce_reference
from test_in_flight import _ddp, _fsdp2

import torch_hca
from torch_hca import _C
from torch_hca.options import shm_chunk_bytes, shm_slots

model = _C._model


def own_devices(world, exclusive=None, **extra):
    """Each rank's environment: `world` model devices, rank r's tensors on device r; with
    `exclusive` (a folder), a device takes one process's context only (EXCLUSIVE_PROCESS)."""
    envs = []
    for r in range(world):
        env = {**STREAMS_ENV, "TORCH_HCA_MODEL_DEVICES": str(world), "TORCH_HCA_MODEL_DEVICE": str(r), **extra}
        if exclusive:
            env["TORCH_HCA_MODEL_EXCLUSIVE"] = exclusive
        envs.append(env)
    return envs


def one_visible_device(world, exclusive=None, **extra):
    """Each rank sees only its own physical device, as device 0: the launch of SLURM's
    --gpus-per-task=1 or Kubernetes (CUDA_VISIBLE_DEVICES=<its GPU>); `exclusive` as own_devices'."""
    envs = [{**STREAMS_ENV, "TORCH_HCA_MODEL_VISIBLE": str(r), **extra} for r in range(world)]
    return [{**env, "TORCH_HCA_MODEL_EXCLUSIVE": exclusive} if exclusive else env for env in envs]


def _late_peer_calls(rank, world):
    """Async collectives that rank 0 joins 0.2 s late, waited at once: wait() must order the
    caller's stream of the tensors' device (not of the thread's current device) after them."""
    wrong = []
    for case, name in enumerate(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"]):
        inputs = [make_input(case, r, 6_000 * world, torch.float32, "SUM") for r in range(world)]
        mine = inputs[rank].clone()
        if rank == 0:
            time.sleep(0.2)
        if name == "all_reduce":
            want = reduce_reference(inputs, "SUM")
            work = dist.all_reduce(mine, async_op=True)
            got = mine
        elif name == "broadcast":
            want, got = inputs[world - 1], mine
            work = dist.broadcast(mine, src=world - 1, async_op=True)
        elif name == "all_gather":
            want, got = torch.cat(inputs), torch.empty(6_000 * world * world)
            work = dist.all_gather_into_tensor(got, mine, async_op=True)
        elif name == "reduce_scatter":
            want, got = reduce_reference(inputs, "SUM").chunk(world)[rank], torch.empty(6_000)
            work = dist.reduce_scatter_tensor(got, mine, async_op=True)
        else:
            want = torch.cat([t.chunk(world)[rank] for t in inputs])
            got = torch.empty_like(mine)
            work = dist.all_to_all_single(got, mine, async_op=True)
        work.wait()
        wrong.append(mismatch(name, got, want, world))
    return wrong


def _user_kernel_before_the_call(rank, world):
    """The caller's last kernel on its current stream (the default one, then a side stream)
    writes the input 0.15 s later: the collective must read it after that kernel, not before."""
    wrong = []
    for side in (False, True):
        model.use_side_stream(side)
        inputs = [make_input(10 + side, r, 20_000, torch.float32, "SUM") for r in range(world)]
        t = torch.zeros(20_000)
        model.enqueue_copy(t, inputs[rank], 150)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        model.synchronize()
        wrong.append(mismatch(f"all_reduce after a kernel (side stream: {side})", t, reduce_reference(inputs, "SUM"),
                              world))
    model.use_side_stream(False)
    return wrong


def _on_own_device(rank, world):
    wrong = _late_peer_calls(rank, world) + _user_kernel_before_the_call(rank, world)
    return [w for w in wrong if w], model.tensor_device(), model.contexts()


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_on_its_own_device_never_made_current(world, tmp_path):
    # EXCLUSIVE_PROCESS devices: a context on device 0 from rank 1 or 2 fails one of them.
    results = run_ranks(_on_own_device, world, env_per_rank=own_devices(world, exclusive=str(tmp_path)))
    for rank, (wrong, device, contexts) in enumerate(results):
        assert wrong == [], wrong
        assert device == rank and contexts == [rank], (rank, device, contexts)


def _staged_where(rank, world):
    """Where the staging lives and its slot before and after the first collectives (each checked),
    and the line explain adds for a running group."""
    before = torch_hca.hierarchy()
    wrong = _late_peer_calls(rank, world)
    line = torch_hca.explain(group=dist.group.WORLD, numels=[1000]).text.splitlines()[-1]
    after = torch_hca.hierarchy()
    return ([w for w in wrong if w], [before["staging"]["cpu"], before["staging_slot_bytes"]["cpu"]],
            after["staging"]["cpu"], after["staging_slot_bytes"]["cpu"], line, model.contexts())


def _launch(name, world, folder):
    """Each rank's environment for a launch: who sees which physical devices."""
    if name == "one_visible":
        return one_visible_device(world, folder)
    if name == "shared_and_hidden":  # ranks 0 and 1 share physical device 0; the last sees only device 1
        return [{**STREAMS_ENV, "TORCH_HCA_MODEL_VISIBLE": "0" if r < world - 1 else "1"} for r in range(world)]
    envs = own_devices(world, exclusive=folder)
    if name == "host_asked_by_rank_0":
        envs[0]["TORCH_HCA_CUDA_STAGING"] = "host"
    if name == "ipc_fails_on_the_last":  # every device a peer, yet the last rank's mapping fails
        envs = [{**env, "TORCH_HCA_MODEL_IPC_FAIL": str(world - 1)} for env in envs]
    return envs


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("launch,staged", [("all_visible", "device memory"), ("one_visible", "host shared memory"),
                                           ("shared_and_hidden", "host shared memory"),
                                           ("host_asked_by_rank_0", "host shared memory"),
                                           ("ipc_fails_on_the_last", "host shared memory")])
def test_the_staging_follows_what_each_rank_sees(world, launch, staged, tmp_path):
    """Device memory (CUDA IPC on a GPU) only where every rank can map every peer's device: one
    rank that cannot, or that asks for host memory, makes every rank stage in host shared memory;
    so does one whose mapping fails although the devices are peers (a container without the
    right namespaces), and every rank says which and why. The model faults a stream that touches
    the device memory of a device its process does not see, so a wrong choice fails here.
    explain names the place for a running group."""
    for rank, (wrong, before, after, slot_bytes, line, contexts) in enumerate(
            run_ranks(_staged_where, world, env_per_rank=_launch(launch, world, str(tmp_path)))):
        assert wrong == [] and before == [None, None] and after.startswith(staged), (rank, wrong, before, after)
        if launch == "ipc_fails_on_the_last":
            assert (f"(the CPU model's; rank {world - 1} could not map the staging of rank 0 by CUDA IPC (injected by "
                    "TORCH_HCA_MODEL_IPC_FAIL), so every rank stages in host memory)") in after, after
        assert after.endswith(f"; {shm_slots()} slots of {shm_chunk_bytes()} bytes per rank"), after
        assert slot_bytes == shm_chunk_bytes()
        assert line == f"staging of cpu tensors: {after}", line
        assert len(contexts) == 1, contexts


def _messages_in_stream_order(rank, world):
    """Each rank sends to the next what a kernel of its own writes 0.15 s later on its current
    stream (the default one, then a side stream), and drops the send's Work and tensor at once;
    it receives from the previous rank into a buffer that a kernel it queues after wait() reads.
    The send must carry what the kernel wrote, the kernel after wait() must read the message."""
    wrong = []
    dst, src = (rank + 1) % world, (rank - 1) % world
    for side in (False, True):
        model.use_side_stream(side)
        data = [make_input(20 + side, r, 50_000, torch.float32, "SUM") for r in range(world)]
        t = torch.zeros(50_000)
        model.enqueue_copy(t, data[rank], 150)
        dist.isend(t, dst, tag=side)
        del t  # neither the tensor nor its Work is kept: hca must keep what it reads
        got, seen = torch.zeros(50_000), torch.zeros(50_000)
        dist.irecv(got, src, tag=side).wait()
        model.enqueue_copy(seen, got, 0)
        model.synchronize()
        wrong.append(mismatch(f"message after a kernel (side stream: {side})", seen, data[src], world))
    model.use_side_stream(False)
    return [w for w in wrong if w], model.contexts()


@pytest.mark.parametrize("world", [2, 3])
def test_messages_follow_the_callers_stream_on_own_devices(world, tmp_path):
    for rank, (wrong, contexts) in enumerate(run_ranks(_messages_in_stream_order, world,
                                                       env_per_rank=own_devices(world, exclusive=str(tmp_path)))):
        assert wrong == [] and contexts == [rank], (rank, wrong, contexts)


def _training_on_own_device(rank, world, loop, set_device):
    """A training loop (DDP's buckets, or FSDP2's prefetched gathers and scatters) by a rank whose
    tensors are on its own device, with or without making that device current first."""
    if set_device:
        model.set_device(model.tensor_device())
    params = _ddp(rank, world, "cpu", "hca") if loop == "ddp" else _fsdp2(rank, world, "cpu")
    return params, model.contexts(), model.current_device(), model.tensor_device(), torch_hca.hierarchy()["staging"]


@pytest.mark.parametrize("loop,set_device,world,launch", [
    ("ddp", False, 2, "all_visible"), ("ddp", True, 2, "all_visible"), ("fsdp2", False, 2, "all_visible"),
    ("ddp", True, 2, "one_visible"), ("ddp", False, 3, "one_visible"), ("fsdp2", False, 3, "one_visible")])
def test_training_loops_on_own_devices_match_gloo(loop, set_device, world, launch, tmp_path):
    """What a script does on 2 or 3 GPUs, each process seeing every GPU (its tensors on cuda:rank)
    or only its own (as cuda:0): the parameters after the loop match gloo's, no rank touched a
    device but its own (EXCLUSIVE_PROCESS) or changed its thread's current device, and the
    staging is device memory where every rank sees every device, host shared memory otherwise."""
    envs = (own_devices(world, exclusive=str(tmp_path), **SMALL_CHUNKS) if launch == "all_visible"
            else one_visible_device(world, str(tmp_path), **SMALL_CHUNKS))
    hca = run_ranks(_training_on_own_device, world, loop, set_device, env_per_rank=envs)
    gloo = run_ranks(_ddp, world, "cpu", "gloo", backend="gloo") if loop == "ddp" else run_ranks(
        _fsdp2, world, "cpu", backend="gloo")
    staged = "device memory" if launch == "all_visible" else "host shared memory"
    for rank, (params, contexts, current, device, staging) in enumerate(hca):
        assert device == (rank if launch == "all_visible" else 0), (rank, device)
        assert contexts == [device] and current == (device if set_device else 0), (rank, contexts, current)
        assert staging["cpu"].startswith(staged) and staging["cuda"] is None, (rank, staging)
        for got, want in zip(params, gloo[0]):
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-4, atol=1e-5)


def _python_runs_when_a_call_lets_go(rank, world):
    """The executor lets go of a call's tensors on its watchdog thread once the device is done
    with them. Freeing one may run Python (here a numpy array's finalizer) that waits for
    something else the group must do: never while the executor's lock is held."""
    array = np.ones(200_000, dtype=np.float32)
    finalizer = WaitingFinalizer(array)
    t = torch.from_numpy(array)
    del array
    if rank == 0:
        time.sleep(0.2)  # the call is still running when its only holder is the executor
    dist.all_reduce(t, async_op=True)
    del t
    return finalizer.completes_meanwhile(), finalizer.seen


def test_python_run_by_freeing_a_finished_calls_tensors_may_wait_for_the_group():
    for completed, seen in run_ranks(_python_runs_when_a_call_lets_go, 2, env=STREAMS_ENV):
        assert completed, "a call issued while a freed tensor's finalizer waited never finished"
        assert seen == {"thread": True, "released": True}, seen


def _rank_0_leaves_first(rank, world, port, slow_env, rank_0_destroys):
    """Rank 0 hosts the store; it exits while rank 1's stream (slowed down) still reads rank 0's
    staging, after destroying its group or without (its process ends; the store goes with it).
    Rank 1 must finish and shut down cleanly, without the store."""
    os.environ.update({**STREAMS_ENV, "TORCH_HCA_SHM_CHUNK_BYTES": "65536", **(slow_env if rank == 1 else {})})
    import torch_hca  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("hca", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    inputs = [make_input(20, r, 400_000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    wrong = mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), world)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is gone by now, when it does not destroy its group
    start = time.monotonic()
    if rank == 1 or rank_0_destroys:
        dist.destroy_process_group()
    return wrong, time.monotonic() - start


def _store_host_entry(rank, world, port, slow_env, rank_0_destroys, results):
    try:
        results.put((rank, "ok", _rank_0_leaves_first(rank, world, port, slow_env, rank_0_destroys)))
    except BaseException as e:  # noqa: BLE001
        results.put((rank, "error", repr(e)))
    if rank == 0:
        results.close()
        results.join_thread()  # what was put reaches the test before the process goes
        os._exit(0)  # at once: its store goes with it


@pytest.mark.parametrize("rank_0_destroys", [True, False])
def test_the_rank_hosting_the_store_may_leave_first(rank_0_destroys):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    slow = {"TORCH_HCA_MODEL_OP_DELAY_MS": "5"}
    procs = [ctx.Process(target=_store_host_entry, args=(r, 2, port, slow, rank_0_destroys, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = dict()
    for _ in range(2):
        rank, status, value = results.get(timeout=120)
        got[rank] = (status, value)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    for rank in (0, 1):
        status, value = got[rank]
        assert status == "ok", (rank, value)
        wrong, seconds = value
        assert wrong is None, (rank, wrong)
        assert seconds < 10, (rank, seconds)


def _faulted_call(rank, world):
    """Rank 1's device faults during an async call: the call completes (with an error) and
    wait() raises the fault at once; rank 0 hears that rank 1 failed."""
    t = torch.ones(300_000)
    work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 20
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    completed = work.is_completed()
    return (completed, *_raised_and_seconds(work.wait))


def _raised_and_seconds(fn):
    """The message of the DistBackendError fn() raised (None if it returned), and how long it took."""
    start = time.monotonic()
    try:
        fn()
        raised = None
    except dist.DistBackendError as e:
        raised = str(e)
    return raised, time.monotonic() - start


def test_a_call_on_a_faulted_device_completes_and_wait_raises_the_fault():
    small = {**STREAMS_ENV, "TORCH_HCA_SHM_CHUNK_BYTES": "65536", "TORCH_HCA_SELF_TEST": "0"}  # faults the 3rd op
    envs = [small, {**small, "TORCH_HCA_MODEL_FAULT_AT": "3"}]
    results = run_ranks(_faulted_call, 2, env_per_rank=envs, pg_timeout_s=30)
    for rank, (completed, raised, seconds) in enumerate(results):
        assert completed, rank
        assert raised is not None and seconds < 2, (rank, raised, seconds)
    assert "injected fault at data operation 3" in results[1][1], results[1][1]
    assert "rank 1 failed" in results[0][1], results[0][1]


def _peer_fails_alive(rank, world, how):
    """Rank 2 fails while its peers' streams have work queued that reads its staging, and stays
    alive a while: it aborts its group, or its device faults (its executor then poisons every
    progress word, which lets the peers' waiting streams through at once). The survivors must be
    told rank 2 failed, never touch its staging (which a failed rank may free any moment), and
    go on in a group without it."""
    survivors = dist.new_group([0, 1])
    # One pack, not the cost model's choice: the fault's place counts this plan's data operations.
    group = dist.new_group([0, 1, 2], pg_options=torch_hca.Options(num_packs=1))
    dist.all_reduce(torch.ones(1 << 18), group=group)
    if rank == 2 and how == "abort":
        time.sleep(0.05)
        dist.distributed_c10d._abort_process_group(group)
        time.sleep(2)
        return None
    works = [dist.all_reduce(torch.ones(1 << 18), group=group, async_op=True) for _ in range(30)]
    messages = []
    for w in works:
        try:
            w.wait()
        except dist.DistBackendError as e:
            messages.append(str(e))
    if rank == 2:
        time.sleep(2)
        return None
    inputs = [make_input(30, r, 100_000, torch.float32, "SUM") for r in (0, 1)]
    t = inputs[rank].clone()
    dist.all_reduce(t, group=survivors)
    return messages, mismatch("survivors' all_reduce", t, reduce_reference(inputs, "SUM"), 2)


@pytest.mark.parametrize("how", ["abort", "device fault"])
def test_survivors_of_a_failed_peer_do_not_touch_its_staging(how):
    env = {**STREAMS_ENV, "TORCH_HCA_SHM_CHUNK_BYTES": "65536", "TORCH_HCA_SELF_TEST": "0"}
    # Rank 2's 40th data operation: in the async calls (each is 16 of them, one pack of 1 MiB).
    fault = {"TORCH_HCA_MODEL_FAULT_AT": "40"} if how == "device fault" else {}
    envs = [env, env, {**env, **fault}]
    for messages, wrong in run_ranks(_peer_fails_alive, 3, how, env_per_rank=envs, pg_timeout_s=30)[:2]:
        assert messages, "rank 2 failed: the calls it did not finish must raise"
        for msg in messages:
            assert "rank 2" in msg and "illegal memory access" not in msg, msg
        assert wrong is None, wrong


@pytest.mark.parametrize("seed", range(4))
def test_copies_are_cut_into_the_widest_units_both_pointers_share(seed):
    rng = np.random.default_rng(seed)
    for _ in range(2000):
        dst, src = int(rng.integers(1 << 20)) * 64 + int(rng.integers(64)), int(rng.integers(1 << 20)) * 64
        src += int(rng.integers(64))
        size = int(rng.integers(0, 300))
        head, unit, units, tail = _C._aligned_span(dst, src, size)
        assert head + unit * units + tail == size
        shared = next(u for u in (16, 8, 4, 2, 1) if dst % u == src % u)
        if unit > 1:
            assert (dst + head) % unit == 0 and (src + head) % unit == 0 and head < unit and tail < unit
            assert units > 0
        if size >= 2 * shared:  # room for the widest shared unit after its head
            assert unit == shared, (dst, src, size, unit)


def _first_calls(rank, world):
    """The first all-reduce's outcome (its error, or whether its sum is right), then a second's;
    and the group's sequence number after them."""
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    outcomes = []
    for case in (40, 41):
        inputs = [make_input(case, r, 5_000, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        try:
            dist.all_reduce(t)
            outcomes.append(mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), world) or "right")
        except dist.DistBackendError as e:
            outcomes.append(str(e))
    return outcomes, pg._get_sequence_number_for_group()


@pytest.mark.parametrize("world", [1, 3])
def test_the_self_test_passes_unseen(world):
    for outcomes, sequence in run_ranks(_first_calls, world, env=STREAMS_ENV):
        assert outcomes == ["right", "right"] and sequence == 2, (outcomes, sequence)


def _mismatched_first_call(rank, world):
    return str(pytest.raises(dist.DistBackendError, dist.all_reduce, torch.ones(4 + rank)).value)


def test_the_self_test_leaves_the_users_collectives_numbered_from_one():
    for msg in run_ranks(_mismatched_first_call, 2, env=STREAMS_ENV, pg_timeout_s=20):
        assert "collective #1: mismatched calls" in msg and "called allreduce(Float[4]" in msg, msg


@pytest.mark.parametrize("world", [2, 3])
def test_a_wrong_result_in_the_self_test_fails_every_rank_at_the_first_call(world):
    # The leader's device (rank 0 reduces the one pack) flips a bit in its first reduce
    # (TORCH_HCA_MODEL_CORRUPT_AT), no fault.
    envs = [{**STREAMS_ENV, "TORCH_HCA_MODEL_CORRUPT_AT": "1"}] + [STREAMS_ENV] * (world - 1)
    for outcomes, _ in run_ranks(_first_calls, world, env_per_rank=envs, pg_timeout_s=30):
        first, second = outcomes
        assert "self-test" in first and "found wrong results" in first, first
        assert "hierarchical_copy" in first and 'algorithm="nccl"' in first and "rank " in first, first
        assert "differs at" in first, first
        assert "unusable" in second or "self-test" in second, second


def test_without_the_self_test_the_injected_corruption_goes_unnoticed():
    # What the self-test guards against: the same corruption, skipped test, a wrong sum reported as success.
    envs = [{**STREAMS_ENV, "TORCH_HCA_SELF_TEST": "0", "TORCH_HCA_MODEL_CORRUPT_AT": "1"},
            {**STREAMS_ENV, "TORCH_HCA_SELF_TEST": "0"}]
    outcomes = [o for o, _ in run_ranks(_first_calls, 2, env_per_rank=envs)]
    assert any("all_reduce" in o[0] for o in outcomes), outcomes


def _capture_refused_on_model(rank, world, warmed):
    """As tests/test_cuda.py's graph-capture case, on the model: a collective on a capturing stream
    (the group's first, while the self-test is pending, or a later one) is refused before the
    device is touched, and the group works after the capture."""
    inputs = [make_input(42, r, 3_000, torch.float32, "SUM") for r in range(world)]
    if warmed:
        dist.all_reduce(torch.ones(8))
    t = inputs[rank].clone()
    _C._model.use_side_stream(True)
    _C._model.capture(True)
    try:
        message = str(pytest.raises(RuntimeError, dist.all_reduce, t).value)
    finally:
        _C._model.capture(False)
        _C._model.use_side_stream(False)
    dist.all_reduce(t)
    return message, mismatch("after the refusal", t, reduce_reference(inputs, "SUM"), world)


@pytest.mark.parametrize("world,warmed", [(1, False), (2, False), (3, True)])
def test_a_capturing_stream_is_refused_before_the_device_is_touched(world, warmed):
    for message, error in run_ranks(_capture_refused_on_model, world, warmed, env=STREAMS_ENV):
        assert "hca: collectives cannot be captured in a CUDA graph yet" in message, message
        assert error is None, error


def _barrier_after_unwaited_work(rank, world):
    """An async all-reduce nobody waits on and, on the last rank, a slow kernel on the caller's
    stream, then a barrier: when each finished on this rank's device (threads watch them), and
    when the barrier returned here."""
    t = torch.full((200_000,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    flag, one = torch.zeros(1), torch.ones(1)
    if rank == world - 1:
        model.enqueue_copy(flag, one, 300)
    watchers = [watch_until(work.is_completed)]
    if rank == world - 1:
        watchers.append(watch_until(lambda: flag.item() == 1))
    dist.barrier()
    returned = time.monotonic()
    done = max(join(60) for join in watchers)
    work.wait()
    return done, returned, bool((t == world * (world + 1) / 2).all())


@pytest.mark.parametrize("world", [2, 3])
def test_a_barrier_returns_once_every_ranks_earlier_device_work_has_finished(world):
    """ProcessGroupNCCL's barrier is a collective on the device that the host then waits for: when
    it returns on any rank, every rank's device work issued before it has finished, the group's
    calls and the caller's stream alike. The last rank's device is slow here (each operation waits
    100 ms, and a kernel of its own 300 ms), so a barrier that only meets the hosts, or waits for
    the rank's own device alone, returns on the others while it still works."""
    envs = [{**STREAMS_ENV, "TORCH_HCA_SHM_CHUNK_BYTES": "65536", "TORCH_HCA_SELF_TEST": "0"} for _ in range(world)]
    envs[-1]["TORCH_HCA_MODEL_OP_DELAY_MS"] = "100"
    results = run_ranks(_barrier_after_unwaited_work, world, env_per_rank=envs)
    last_done = max(done for done, _, _ in results)
    for rank, (_, returned, right) in enumerate(results):
        assert right, rank
        # The watchers poll every millisecond: their times are late by up to that, and a little more.
        assert returned >= last_done - 0.02, (rank, last_done - returned)


def _barrier_beside_a_stuck_kernel(rank, world):
    """The last rank's caller stream runs a kernel far longer than the group's timeout: its barrier
    raises once the timeout has passed, naming its device work, and the others' barriers raise too."""
    dist.all_reduce(torch.ones(8))  # the group has used the device: its barrier drains it first
    if rank == world - 1:
        flag, one = torch.zeros(1), torch.ones(1)
        model.enqueue_copy(flag, one, 6000)
    return _raised_and_seconds(dist.barrier)


def test_a_barrier_gives_up_on_device_work_that_outlasts_the_timeout():
    envs = [{**STREAMS_ENV, "TORCH_HCA_SELF_TEST": "0"} for _ in range(3)]
    results = run_ranks(_barrier_beside_a_stuck_kernel, 3, env_per_rank=envs, pg_timeout_s=1.5)
    raised, seconds = results[-1]
    assert raised and "this rank's device work issued before the barrier" in raised, raised
    assert "did not finish within 1500 ms" in raised, raised
    for rank, (raised, seconds) in enumerate(results):
        assert raised, rank
        assert seconds < 5, (rank, seconds)  # not the kernel's 6 s


def _barrier_after_a_faulted_call(rank, world):
    """Rank 1's device faults inside an async all-reduce nobody waits on; then a barrier."""
    t = torch.ones(300_000)
    dist.all_reduce(t, async_op=True)
    try:
        dist.barrier()
        return None
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return type(e).__name__, str(e)


def test_a_barrier_after_a_device_fault_raises_it_as_a_backend_error():
    """The barrier's wait for the device sees the fault and raises it as DistBackendError on the
    faulted rank; the other rank's barrier raises too (its peer failed), within the timeout."""
    small = {**STREAMS_ENV, "TORCH_HCA_SHM_CHUNK_BYTES": "65536", "TORCH_HCA_SELF_TEST": "0"}
    results = run_ranks(_barrier_after_a_faulted_call, 2, env_per_rank=[small, {**small, "TORCH_HCA_MODEL_FAULT_AT": "3"}],
                        pg_timeout_s=30)
    for rank, raised in enumerate(results):
        assert raised is not None, rank
        kind, message = raised
        assert kind == "DistBackendError", (rank, kind, message)
    assert "TORCH_HCA_MODEL_FAULT_AT" in results[1][1] or "fault" in results[1][1].lower(), results[1][1]


def _behind_a_busy_callers_stream(rank, world):
    """Rank 0's caller stream runs a 4 s kernel before its all-reduce, under a 1.5 s timeout; the
    peers call 0.5 s later, so that rank 0's deadline comes first."""
    dist.all_reduce(torch.ones(4))  # the group's set-up and self-test, before the short deadline matters
    t = torch.zeros(50_000)
    if rank == 0:
        model.enqueue_copy(t, torch.ones(50_000), 4000)
    else:
        time.sleep(0.5)
    return _raised_and_seconds(lambda: dist.all_reduce(t))


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_whose_stream_never_began_names_its_own_rank(world):
    """Rank 0's stream never begins the call (it follows the caller's stream, still busy): each
    rank's timeout names rank 0, whose peers wait for it, never one of those peers."""
    results = run_ranks(_behind_a_busy_callers_stream, world, env=STREAMS_ENV, pg_timeout_s=1.5)
    own, _ = results[0]
    assert own and "rank 0's stream had not begun the collective" in own, own
    for rank, (raised, seconds) in enumerate(results):
        assert raised and re.search(r"waiting for rank 0 |rank 0's stream had not begun", raised), (rank, raised)
        assert not re.search(r"waiting for rank [1-9]", raised), (rank, raised)
        # The peers within the timeout; rank 0's host follows its stream here, kernel included.
        assert rank == 0 or seconds < 3.5, (rank, seconds)


def _two_groups_in_opposite_orders(rank, world):
    """An async all-reduce on each of two groups (3 s timeouts), issued in one order on rank 0 and in
    the other on the rest, then waited: (the errors raised, the wrong results, seconds)."""
    groups = [dist.new_group(backend="hca", timeout=timedelta(seconds=3)) for _ in range(2)]
    for group in groups:  # set-up and self-test, in one order everywhere
        dist.all_reduce(torch.ones(4), group=group)
    inputs = [[make_input(k, r, 5_000, torch.float32, "SUM") for r in range(world)] for k in range(2)]
    mine = [inputs[k][rank].clone() for k in range(2)]
    start = time.monotonic()
    order = [0, 1] if rank == 0 else [1, 0]
    works = {k: dist.all_reduce(mine[k], group=groups[k], async_op=True) for k in order}
    errors, wrong = [], []
    for k in order:
        try:
            works[k].wait()
            wrong.append(mismatch(f"group {k}", mine[k], reduce_reference(inputs[k], "SUM"), world))
        except dist.DistBackendError as e:
            errors.append(str(e))
    return errors, [w for w in wrong if w], time.monotonic() - start


def test_calls_to_two_groups_in_opposite_orders_end_in_a_timeout_not_a_hang():
    """hca puts every group's calls on a device in the order they were made (a GPU runs streams on
    a few hardware queues in issue order: on one, Megatron-LM's setting, calls issued as each
    group's worker got to them could queue in different orders on different ranks). So, as with
    NCCL, calls to two groups must come in the same order on every rank: in opposite orders each
    rank's first call waits for a peer whose first call waits the other way. The groups' timeouts
    end that with an error within seconds."""
    results = run_ranks(_two_groups_in_opposite_orders, 2, env={**STREAMS_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    for rank, (errors, wrong, seconds) in enumerate(results):
        assert not wrong, (rank, wrong)
        assert errors and all("Timed out" in e for e in errors), (rank, errors)
        assert seconds < 20, (rank, seconds)


def _a_call_made_in_a_held_turn(rank, world):
    """An async all-reduce on group 1 made inside a turn of the device (model.in_device_turn, as a
    call across nodes makes its stages), and one on group 2 from another thread. Rank 0 makes the
    group 2 call first, while the turn is held, the other ranks after the group 1 call. Both must
    reach the device in the turn's order on every rank: (the errors raised, the wrong results)."""
    groups = [dist.new_group(backend="hca", timeout=timedelta(seconds=3)) for _ in range(2)]
    for group in groups:  # set-up and self-test, in one order everywhere
        dist.all_reduce(torch.ones(4), group=group)
    inputs = [[make_input(20 + k, r, 5_000, torch.float32, "SUM") for r in range(world)] for k in range(2)]
    mine = [inputs[k][rank].clone() for k in range(2)]
    works, errors = {}, []

    def call_group_2():
        works[2] = dist.all_reduce(mine[1], group=groups[1], async_op=True)

    second = threading.Thread(target=call_group_2)

    def stages():
        if rank == 0:
            second.start()
            second.join()  # its ticket comes after the held turn
        works[1] = dist.all_reduce(mine[0], group=groups[0], async_op=True)
        if rank != 0:
            second.start()
            second.join()

    model.in_device_turn(stages)
    wrong = []
    for k in (1, 2):
        try:
            works[k].wait()
            wrong.append(mismatch(f"group {k}", mine[k - 1], reduce_reference(inputs[k - 1], "SUM"), world))
        except dist.DistBackendError as e:
            errors.append(str(e))
    return errors, [w for w in wrong if w]


@pytest.mark.parametrize("world", [2, 3])
def test_calls_made_in_a_held_turn_issue_in_it(world):
    """A call across nodes issues its stages (calls to its node's group, to the engines among the
    leaders) on its worker when it gets to them, maybe after calls made since. They issue in the
    turn the call took when it was made, and the turn ends once they have. Otherwise, on one
    hardware queue, rank 0 would issue group 2's call first and the others group 1's: each waits
    for the other, until the timeout."""
    results = run_ranks(_a_call_made_in_a_held_turn, world, env={**STREAMS_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert results == [([], [])] * world


def _waits_against_explain(rank, world):
    """For each algorithm and a one-round and a several-round size: the waits on peers' words this
    rank's stream issued for one call, after enough calls to have used every slot, and what explain
    says of it; every result checked."""
    out, wrong = [], []
    for algorithm, num_packs in (("reduce_to_one_device", 1), ("hierarchical_copy", 1), ("hierarchical_copy", world),
                                 ("direct", 1), ("hierarchical_copy", 2 * world + 1)):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, num_packs))
        backend = group._get_backend(torch.device("cpu"))
        for case, numel in enumerate((1000, 100_003)):
            inputs = [make_input(case, r, numel, torch.float32, "SUM") for r in range(world)]
            for _ in range(shm_slots() + 1):  # every slot of the ring used
                t = inputs[rank].clone()
                dist.all_reduce(t, group=group)
            before = backend._peer_waits(cuda=False)
            t = inputs[rank].clone()
            dist.all_reduce(t, group=group)
            issued = backend._peer_waits(cuda=False) - before
            wrong.append(mismatch(f"{algorithm} {num_packs} {numel}", t, reduce_reference(inputs, "SUM"), world))
            plan = torch_hca.explain(group=group, algorithm=algorithm, num_packs=num_packs, numels=[numel])
            out.append((algorithm, num_packs, numel, issued, plan.peer_waits[rank], len(plan.rounds)))
        dist.destroy_process_group(group)
    return out, [w for w in wrong if w]


@pytest.mark.parametrize("world", [3, 4])
def test_the_waits_a_call_issues_are_those_explain_counts(world):
    """Ranks sharing one model device, where every wait on a peer may cost a switch between their
    processes: the waits each rank's stream issues for a call (none that an earlier wait on the
    group's stream covers, of this call or the one before; a slot's reuse waiting for its readers
    alone) are exactly what explain counts by running the plan's rounds dry, rank by rank. The star
    (reduce_to_one_device) waits the fewest: its leader once for each peer, every other rank once, in
    each round of a staging slot."""
    envs = [{**STREAMS_ENV, "TORCH_HCA_MODEL_VISIBLE": "0"} for _ in range(world)]
    for rank, (counts, wrong) in enumerate(run_ranks(_waits_against_explain, world, env_per_rank=envs,
                                                     deadline_s=400)):
        assert wrong == [], (rank, wrong)
        for algorithm, num_packs, numel, issued, said, rounds in counts:
            assert issued == said and issued > 0, (rank, algorithm, num_packs, numel, issued, said)
            if algorithm == "reduce_to_one_device":  # in each round of a staging slot
                assert issued == rounds * (world - 1 if rank == 0 else 1), (rank, numel, rounds, issued)
