"""Waits beside other busy processes, and ranks sharing a CPU. A wait whose yield came back late
sleeps on doorbells from then on only if processes outside the group kept the cores busy;
torch_hca._C._outside_cores measures that as the wait does (/proc), and the collectives stay right
while it decides. A wait for a rank that said it runs on the waiter's own CPU does not spin, and
ranks that keep meeting on one CPU part where they may. A rank that comes early stages its data
while it waits for the late ones."""
import functools
import os
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import torch_hca
from torch_hca.bench import busy_processes
from harness import SMALL_CHUNKS, run_ranks
from sched_slice import custom_slices_supported, set_slice_ns, slice_ns
from reference import all_gather_single, make_input, mismatch, reduce_reference, reduce_scatter_single

# The share of a core above which a wait blames outsiders (OutsideLoad::kBusyCores).
BUSY_CORES = 0.5


@pytest.fixture
def busy_process():
    with busy_processes(1) as (process,):
        time.sleep(0.2)  # the interpreter's start-up is not the loop
        yield process


def test_a_busy_process_outside_the_group_is_an_outsider(busy_process):
    assert torch_hca._C._outside_cores([os.getpid()], 0.5) >= BUSY_CORES


def test_a_busy_process_of_the_group_is_not(busy_process):
    assert torch_hca._C._outside_cores([os.getpid(), busy_process.pid], 0.5) < BUSY_CORES


def test_a_pid_that_names_no_process_counts_as_outside(busy_process):
    """A rank's pid read from another pid namespace may name nothing here (or another process:
    the start time in its slot tells them apart); its CPU is then nobody's in the group."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert torch_hca._C._outside_cores([os.getpid(), gone.pid], 0.5) >= BUSY_CORES


def _checked_calls(rank, world, sizes, group=None):
    """An all-reduce and a broadcast (root rotating) of each size in `sizes` (elements), every
    element checked; the mismatches found."""
    errors = []
    for call, numel in enumerate(sizes):
        inputs = [make_input(call, r, numel, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t, group=group)
        errors.append(mismatch(f"allreduce #{call} of {numel}", t, reduce_reference(inputs, "SUM"), world))
        b = inputs[rank].clone()
        dist.broadcast(b, src=call % world, group=group)
        errors.append(mismatch(f"broadcast #{call} of {numel}", b, inputs[call % world], world))
    return [e for e in errors if e]


def _calls_beside_busy_processes(rank, world, calls):
    """One-pack all-reduces and broadcasts, many of several rounds: long enough (beside busy
    processes) for late yields, looks at /proc, and waits that sleep on doorbells."""
    group = dist.new_group(backend="hca", pg_options=torch_hca.Options(num_packs=1))
    return _checked_calls(rank, world, [[256, 262144, 2097152][call % 3] for call in range(calls)], group)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_beside_busy_processes(world):
    with busy_processes(2):
        results = run_ranks(_calls_beside_busy_processes, world, 30)
    assert results == [[]] * world


def _pin(cpus, rank):
    """Before the group (its threads inherit it): rank r on the r-th of `cpus`, round robin."""
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def _calls_on_pinned_cpus(rank, world):
    """Collectives of several sizes, every element checked, then the CPU each rank says it runs on."""
    errors = _checked_calls(rank, world, [1, 4096, 262144, 1048576] * 3)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return errors, [backend._cpu_said_by(r) for r in range(world)]


@pytest.mark.parametrize("world,layout", [(2, "one cpu"), (3, "one cpu"), (3, "round robin")])
def test_ranks_sharing_a_cpu(world, layout):
    """A rank waiting for a peer that said it runs on the same CPU skips its spin (the peer cannot
    run meanwhile): each rank's slot must say where it runs, and the collectives stay right."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:1] if layout == "one cpu" else allowed
    results = run_ranks(_calls_on_pinned_cpus, world, before_init=functools.partial(_pin, cpus))
    expected = [cpus[r % len(cpus)] for r in range(world)]
    for rank, (errors, said) in enumerate(results):
        assert errors == []
        assert said == expected, f"rank {rank} read the ranks' CPUs {said}, pinned {expected}"


def _calls_after_starting_on_one_cpu(rank, world, allowed, calls):
    """The ranks began on one CPU (pinned before the group), may now run on all `allowed`: small
    all-reduces, every element checked, then the CPUs the ranks say they run on."""
    inputs = [[make_input(call, r, 1, torch.float32, "SUM") for r in range(world)] for call in range(calls)]
    results = [call_inputs[rank].clone() for call_inputs in inputs]
    os.sched_setaffinity(0, allowed)  # this thread, the one the blocking calls wait on
    for t in results:  # back to back: Python between the calls gives the scheduler time to part them
        dist.all_reduce(t)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    said = [backend._cpu_said_by(r) for r in range(world)]
    errors = [mismatch(f"allreduce #{call}", t, reduce_reference(inputs[call], "SUM"), world)
              for call, t in enumerate(results)]
    return [e for e in errors if e], said


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_on_one_cpu_part_when_they_may(world):
    """Ranks that share a CPU take turns on it (a small call 3-4x slower), and Linux leaves them so
    for tens of milliseconds (500-1000 such calls here): a rank that keeps waiting for a lower one
    on its own CPU moves to an allowed CPU no rank runs on, within a few calls."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < world:
        pytest.skip(f"{world} ranks need {world} CPUs to part on, this process may use {len(allowed)}")
    results = run_ranks(_calls_after_starting_on_one_cpu, world, set(allowed), 100,
                        before_init=functools.partial(_pin, allowed[:1]))
    for rank, (errors, said) in enumerate(results):
        assert errors == []
        assert len(set(said)) == world, f"rank {rank}: the ranks said they run on CPUs {said} after 100 calls"


def _slices_of_async_calls(rank, world):
    """Async all-reduces, waited on through their Futures (as DDP waits for its buckets), first while
    the calling thread has the default slice, then after it asked for 3 ms. In each call one rank
    (in turn) comes 0.1 s late, so that on the others the call is still running when the Future's
    callback is added: the callback then runs on the thread that ran the call, and reads its slice."""
    errors, slices = [], []
    for call, (own_slice, late) in enumerate((s, r) for s in (None, 3_000_000) for r in range(world)):
        if own_slice is not None:
            set_slice_ns(own_slice)
        before = slice_ns()
        inputs = [make_input(call, r, 100_000, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        if rank == late:
            time.sleep(0.1)
        future = dist.all_reduce(t, async_op=True).get_future().then(lambda _: slice_ns())
        running_it = future.wait()
        if rank != late:
            slices.append((before, running_it, slice_ns()))
        errors.append(mismatch(f"call {call}", t, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e], slices


@pytest.mark.parametrize("world", [2, 3])
def test_the_worker_asks_to_run_soon_when_woken(world):
    """A rank woken by its peer waits for its turn on the CPU (a time slice, 1.4 ms here) unless it
    asked for a short slice (Linux 6.12+): hca's worker thread, which runs async calls beside the
    caller's compute, has the shortest; the caller's thread keeps its own."""
    if not custom_slices_supported():
        pytest.skip("this kernel keeps no slice a thread asks for (Linux before 6.12)")
    for rank, (errors, slices) in enumerate(run_ranks(_slices_of_async_calls, world)):
        assert errors == []
        assert len(slices) == 2 * (world - 1)  # each rank on time in world - 1 calls of each kind
        default = slices[0][0]
        assert [running_it for _, running_it, _ in slices] == [100_000] * len(slices), f"rank {rank}: {slices}"
        assert [(before, after) for before, _, after in slices] == (
            [(default, default)] * (world - 1) + [(3_000_000, 3_000_000)] * (world - 1)), f"rank {rank}: {slices}"


def _calls_with_a_late_rank(rank, world, calls):
    """All-reduces (every algorithm), all-gathers and reduce-scatters of many rounds, one random
    rank late to each by up to 3 ms: the others stage ahead into slots their peers may still be
    reading from the call before, unless the peers' progress says the slots are free."""
    rnd = random.Random(7)  # the same draws on every rank
    groups = [dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm=algorithm))
              for algorithm in ("hierarchical_copy", "reduce_to_one_device", "direct")]
    errors = []
    for call in range(calls):
        kind, group = rnd.choice(["allreduce", "allgather", "reduce_scatter"]), rnd.choice(groups)
        numel = rnd.choice([1000, 40_000, 300_001]) // world * world
        late, delay_s = rnd.randrange(world), rnd.uniform(0, 0.003)
        inputs = [make_input(call, r, numel, torch.float32, "SUM") for r in range(world)]
        if rank == late:
            time.sleep(delay_s)
        t = inputs[rank].clone()
        if kind == "allreduce":
            dist.all_reduce(t, group=group)
            got, want = t, reduce_reference(inputs, "SUM")
        elif kind == "allgather":
            got = torch.empty(numel * world)
            all_gather_single(got, t, group=group)
            want = torch.cat(inputs)
        else:
            got = torch.empty(numel // world)
            reduce_scatter_single(got, t, group=group)
            want = reduce_reference(inputs, "SUM")[rank * (numel // world):(rank + 1) * (numel // world)]
        errors.append(mismatch(f"call {call}: {kind} of {numel}, rank {late} late", got, want, world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_that_arrive_late(world):
    """Two slots of 64 KiB per rank: most calls take many rounds, so a rank staging ahead reaches
    slots of the very call its peers run."""
    assert run_ranks(_calls_with_a_late_rank, world, 60, env=SMALL_CHUNKS) == [[]] * world
