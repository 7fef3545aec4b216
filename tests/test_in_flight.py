"""Several collectives in flight at once (DDP's buckets, FSDP2's prefetch, async calls waited
late or never): on the CPU model of the device ("cpu-streams": every stream a thread of its own,
freed buffers poisoned) these are the CUDA path's check; on "cpu" the shared-memory executor's."""
import contextlib
import os
import random
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_hca
from harness import SMALL_CHUNKS, WaitingFinalizer, run_ranks, seeds
from node_cases import fsdp2_training
from reference import all_gather_single, make_input, mismatch, rank_device, reduce_reference, reduce_scatter_single

WORLD_SIZES = [1, 2, 3, 4]


def _issue_mixed(rank, world, dev, group, case):
    """Issues allreduce (two sizes, two ops), broadcast, all_gather_into_tensor and
    reduce_scatter_tensor async; returns [(work, name, tensor, reference)] in issue order."""
    calls = []
    for i, (numel, op) in enumerate([(70_001, "SUM"), (13, "MAX"), (40_000, "AVG")]):
        inputs = [make_input(case + i, r, numel, torch.float32, op) for r in range(world)]
        t = inputs[rank].to(dev, copy=True)
        work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group, async_op=True)
        calls.append((work, f"allreduce {numel} {op}", t, reduce_reference(inputs, op)))
    inputs = [make_input(case + 5, r, 30_000, torch.float64, "SUM") for r in range(world)]
    t = inputs[rank].to(dev, copy=True)
    calls.append((dist.broadcast(t, src=world - 1, group=group, async_op=True), "broadcast", t, inputs[world - 1]))
    inputs = [make_input(case + 6, r, 20_000, torch.bfloat16, "SUM") for r in range(world)]
    out = torch.empty(20_000 * world, dtype=torch.bfloat16, device=dev)
    work = all_gather_single(out, inputs[rank].to(dev), group=group, async_op=True)
    calls.append((work, "all_gather_into_tensor", out, torch.cat(inputs)))
    inputs = [make_input(case + 7, r, 25_000 * world, torch.float32, "SUM") for r in range(world)]
    out = torch.empty(25_000, dtype=torch.float32, device=dev)
    work = reduce_scatter_single(out, inputs[rank].to(dev), group=group, async_op=True)
    want = reduce_reference(inputs, "SUM")[rank * 25_000:(rank + 1) * 25_000]
    calls.append((work, "reduce_scatter_tensor", out, want))
    return calls


def _mixed_in_flight(rank, world, device):
    dev = rank_device(device, rank)
    errors = []
    for num_packs in (1, 2):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(num_packs=num_packs))
        # Waited in reverse order.
        calls = _issue_mixed(rank, world, dev, group, 100 * num_packs)
        for work, name, t, want in reversed(calls):
            work.wait()
            errors.append(mismatch(f"num_packs={num_packs} reversed: {name}", t, want, world))
        # Only through their futures, the Works dropped at once.
        calls = _issue_mixed(rank, world, dev, group, 100 * num_packs + 10)
        futures = [work.get_future() for work, *_ in calls]
        calls = [(None, name, t, want) for _, name, t, want in calls]
        torch.futures.wait_all(futures)
        for _, name, t, want in calls:
            errors.append(mismatch(f"num_packs={num_packs} futures: {name}", t, want, world))
        # Never waited: a later blocking call orders the caller after them (one stream).
        calls = _issue_mixed(rank, world, dev, group, 100 * num_packs + 20)
        calls = [(None, name, t, want) for _, name, t, want in calls]
        last = torch.ones(5, device=dev)
        dist.all_reduce(last, group=group)
        errors.append(mismatch("the blocking call after them", last, torch.full((5,), float(world)), world))
        for _, name, t, want in calls:
            errors.append(mismatch(f"num_packs={num_packs} never waited: {name}", t, want, world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mixed_collectives_in_flight_waited_late_or_never(world, device):
    assert run_ranks(_mixed_in_flight, world, device, env=SMALL_CHUNKS) == [[]] * world


def _on_the_model():
    """Whether this rank's CPU tensors run on the CPU model of the device."""
    return os.environ.get("TORCH_HCA_CPU_EXECUTOR") == "streams"


@contextlib.contextmanager
def _stream_of_its_own(dev):
    """The calling thread's device work on a stream of its own. On the default stream, which every
    thread of a process shares, a thread's wait() and its host copies (`.to(dev)`, `.cpu()`) would
    wait for the other threads' calls too."""
    if dev.type == "cuda":
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            yield
    else:
        if _on_the_model():
            torch_hca._C._model.use_side_stream(True)
        yield


class _Turns:
    """Turns taken in one order on every rank: thread k of n takes turns k, k + n, k + 2n, ..."""

    def __init__(self):
        self._changed = threading.Condition()
        self._now = 0

    @contextlib.contextmanager
    def turn(self, number):
        with self._changed:
            self._changed.wait_for(lambda: self._now == number)
        try:
            yield
        finally:
            with self._changed:
                self._now += 1
                self._changed.notify_all()


def _groups_driven_by_threads(rank, world, device, seed=None):
    """Background work (DCP's async save, a metrics thread) drives a group of its own from a thread
    beside the training's: four groups (one per algorithm), each driven by a thread of its own, on a
    stream of its own, every call async and checked. On CPU tensors the threads race. On a device
    they take turns, a round each, in one order on every rank, as NCCL asks of communicators
    driven by threads: a GPU runs the streams on a few hardware queues, each in issue order, so a
    call waiting there for its peers holds back another group's call queued behind it, which the
    peers may be waiting for in turn (test_model_device's groups called in opposite orders). The
    ranks run with one queue (CUDA_DEVICE_MAX_CONNECTIONS=1), where anything else would deadlock.
    With a `seed`: 2-5 groups of random options instead (test_random_sequences' draw)."""
    dev = rank_device(device, rank)
    on_device = dev.type == "cuda" or _on_the_model()
    if seed is None:
        groups = [dist.group.WORLD] + [dist.new_group(backend="hca", pg_options=options) for options in
                                       (torch_hca.Options(num_packs=2), torch_hca.Options("reduce_to_one_device"),
                                        torch_hca.Options("direct"))]
    else:
        from test_random_sequences import _random_options
        rnd = random.Random(seed)  # every rank draws the same
        drawn = [_random_options(rnd, world, nccl=dev.type == "cpu") for _ in range(rnd.randint(2, 5))]
        groups = [dist.new_group(backend="hca", pg_options=torch_hca.Options(**o)) for o in drawn]
    errors = [[] for _ in groups]
    turns = _Turns()

    def drive(k):
        with _stream_of_its_own(dev):
            for i in range(4):
                with turns.turn(i * len(groups) + k) if on_device else contextlib.nullcontext():
                    try:
                        for work, name, t, want in _issue_mixed(rank, world, dev, groups[k], 1000 * k + 30 * i):
                            work.wait()
                            errors[k].append(mismatch(f"group {k} round {i}: {name}", t, want, world))
                    except Exception:  # noqa: BLE001  a thread's failure goes back to the test
                        errors[k].append(f"group {k} round {i}: {traceback.format_exc()}")

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [e for group_errors in errors for e in group_errors if e]


@pytest.mark.parametrize("world", [2, 3])
def test_groups_driven_by_threads_of_their_own_at_once(world, device):
    env = {**SMALL_CHUNKS, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert run_ranks(_groups_driven_by_threads, world, device, env=env) == [[]] * world


@pytest.mark.parametrize("seed", seeds(2))
def test_groups_of_random_options_driven_by_threads_at_once(seed, device):
    """The same with groups of random options (the pass-through on CPU tensors among them), 2-4 ranks;
    HCA_TEST_SEEDS=N runs N seeds."""
    world = 2 + seed % 3
    env = {**SMALL_CHUNKS, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert run_ranks(_groups_driven_by_threads, world, device, seed, env=env) == [[]] * world


def _temporaries_in_flight(rank, world, device):
    """Calls whose buffers only hca holds (dense copies of non-contiguous tensors, the stacked
    inputs of reduce_scatter's list form), their Works dropped and only the futures kept: the
    buffers must live until the device is done with them."""
    dev = rank_device(device, rank)
    errors, futures, checks = [], [], []
    for i in range(4):
        base = [make_input(300 + i, r, 300 * 301, torch.float32, "SUM").reshape(300, 301) for r in range(world)]
        # The reference first, from tensors the collective does not share: on "cpu" a plain
        # .to(dev) would alias base[rank], which the write-back below changes at any moment.
        want = reduce_reference([b.t() for b in base], "SUM")
        view = base[rank].to(dev, copy=True).t()  # non-contiguous: hca all-reduces a dense copy, then writes back
        futures.append(dist.all_reduce(view, async_op=True).get_future())
        checks.append((f"transposed view {i}", view, want))
        ins = [[make_input(400 + i * world + j, r, 9_000, torch.float32, "SUM") for j in range(world)]
               for r in range(world)]
        out = torch.empty(9_000, device=dev)
        futures.append(dist.reduce_scatter(out, [t.to(dev) for t in ins[rank]], async_op=True).get_future())
        checks.append((f"reduce_scatter list {i}", out, reduce_reference([ins[r][rank] for r in range(world)], "SUM")))
        # Allocations that could take the freed buffers' place.
        junk = [torch.full((300 * 301,), 7.0, device=dev) for _ in range(3)]
        del junk
    torch.futures.wait_all(futures)
    for name, got, want in checks:
        errors.append(mismatch(name, got, want, world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_buffers_only_hca_holds_live_until_the_device_is_done(world, device):
    assert run_ranks(_temporaries_in_flight, world, device, env=SMALL_CHUNKS) == [[]] * world


def _python_runs_when_the_worker_lets_go(rank, world):
    """An async all-gather whose input only the call holds (a numpy array with a finalizer) and
    whose Work the caller dropped: the worker that ran it holds their last references. The
    finalizer, Python, waits for the group's next call, which must still run: the worker hands
    its role on before it lets go, and never frees them under the lock that calls run under."""
    inputs = [make_input(30, r, 200_000, torch.float32, "SUM") for r in range(world)]
    array = inputs[rank].numpy().copy()
    finalizer = WaitingFinalizer(array)
    t, out = torch.from_numpy(array), torch.empty(200_000 * world)
    del array
    if rank == 0:
        time.sleep(0.2)  # rank 1's worker still runs the call when rank 1 lets go of it
    all_gather_single(out, t, async_op=True)
    del t
    completed = finalizer.completes_meanwhile()
    return completed, finalizer.seen, mismatch("all_gather", out, torch.cat(inputs), 1)


def test_python_run_by_a_call_the_worker_lets_go_may_wait_for_the_group():
    completed, seen, wrong = run_ranks(_python_runs_when_the_worker_lets_go, 2)[1]
    assert completed, "a call issued while a freed tensor's finalizer waited never finished"
    assert seen == {"thread": True, "released": True} and not wrong, (seen, wrong)


def _ddp(rank, world, device, backend_name, steps=6, set_device=True):
    if backend_name != "hca":
        dev = torch.device("cpu")
    elif set_device:
        dev = rank_device(device, rank)
    else:  # as a script that only moves its model to cuda:rank: the current device stays 0
        dev = torch.device(device, rank % torch.cuda.device_count()) if device == "cuda" else torch.device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(4)],
                                torch.nn.Linear(64, 4)).to(dev)
    ddp = DDP(model, bucket_cap_mb=0.02)  # ~5 buckets in flight while the backward pass goes on
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 4, generator=g).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_buckets_in_flight_matches_gloo(world, device):
    hca = run_ranks(_ddp, world, device, "hca", pg_options=torch_hca.Options(num_packs=2), env=SMALL_CHUNKS)
    gloo = run_ranks(_ddp, world, "cpu", "gloo", backend="gloo")
    for a, b in zip(hca[0], gloo[0]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-5)
    for r in range(1, world):
        for a, b in zip(hca[0], hca[r]):
            assert (a == b).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ddp_on_cuda_without_set_device_matches_gloo():
    hca = run_ranks(_ddp, 2, "cuda", "hca", 6, False, env=SMALL_CHUNKS)
    gloo = run_ranks(_ddp, 2, "cpu", "gloo", backend="gloo")
    for a, b in zip(hca[0], gloo[0]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-5)


def _fsdp2(rank, world, device):
    return [t.numpy() for t in fsdp2_training(rank, device=device)[1]]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_overlapped_gathers_and_scatters_match_gloo(world, device):
    hca = run_ranks(_fsdp2, world, device, env=SMALL_CHUNKS)
    gloo = run_ranks(_fsdp2, world, "cpu", backend="gloo")
    for a, b in zip(hca[0], gloo[0]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-5)
