"""Runs a function on N ranks, each a spawned process in an `hca` (or other) process group."""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist


class RankFailed(AssertionError):
    pass


# Small staging slots, so that a collective of a few hundred KiB runs many rounds; in shared
# memory the tightest ring (two slots per rank), so that most rounds wait for their slot.
SMALL_CHUNKS = {"TORCH_HCA_SHM_CHUNK_BYTES": "65536", "TORCH_HCA_SHM_SLOTS": "2",
                "TORCH_HCA_CUDA_CHUNK_BYTES": "65536"}

# CPU tensors through the stream executor (the one CUDA tensors use), on host threads.
STREAMS_ENV = {"TORCH_HCA_CPU_EXECUTOR": "streams"}

# For NCCL with several ranks on one GPU (NCCL 2.30+; ranks take the GPUs round-robin).
NCCL_SHARED_GPU_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def group_kind(where):
    """run_ranks' keywords for where a group's calls go: "default", hca's own algorithms; "nccl",
    the pass-through (gloo carries CPU calls, from the group's queue); "2 nodes", 4 ranks on two
    named nodes (ranks 0 and 2 on one), whose calls between nodes go through gloo."""
    import torch_hca

    return {"default": {}, "nccl": dict(pg_options=torch_hca.Options("nccl")),
            "2 nodes": dict(env_per_rank=[{"TORCH_HCA_NODE_ID": node} for node in "abab"])}[where]


def nccl_fits(ranks):
    """Whether stock NCCL can join `ranks` ranks here: a GPU each, or several ranks per GPU
    (NCCL 2.30+ with NCCL_SHARED_GPU_ENV)."""
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return False
    return torch.cuda.device_count() >= ranks or torch.cuda.nccl.version() >= (2, 30, 0)


# Ranks fork from a server process that imported torch once (multiprocessing's forkserver), instead of
# each spawning an interpreter that imports torch again: that import was most of the suite's time.
# `fresh_interpreter=True` still spawns, for what only a new program sees (LD_PRELOAD).
_FORKSERVER = mp.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch"])


def _entry(fn, rank, world_size, init_method, backend, pg_options, environ, timeout_s, args, results, before_init,
           stacks_after_s):
    # A forked rank has the server's environment, from when it started: it takes the test's, as a
    # spawned one inherits it.
    os.environ.clear()
    os.environ.update(environ)
    # A rank that crashes, or still runs just before the launch's deadline, prints where its threads are.
    faulthandler.enable()
    faulthandler.dump_traceback_later(stacks_after_s, exit=False)
    try:
        import torch.distributed as dist

        import torch_hca  # noqa: F401  registers "hca"

        if before_init is not None:
            before_init(rank)
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                pg_options=pg_options, timeout=timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  every failure goes back to the test
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size, *args, backend="hca", pg_options=None, env=None, env_per_rank=None,
              pg_timeout_s=60.0, deadline_s=240.0, allow_missing=(), before_init=None, fresh_interpreter=False):
    """Returns [fn's value on rank 0, ..., rank N-1]; raises RankFailed with the tracebacks
    of failed ranks. `env_per_rank` adds variables rank by rank. Ranks in `allow_missing` may
    end without a result (value None). `before_init(rank)` runs in each rank before the group
    is created (picklable: a module-level function or a partial of one). HCA_TEST_DEADLINE_S
    caps the deadline (a GPU session, where a hang must not eat the device call).
    `fresh_interpreter=True` spawns each rank as a new program, not a fork of the server."""
    deadline_s = min(deadline_s, float(os.environ.get("HCA_TEST_DEADLINE_S", "inf")))
    ctx = mp.get_context("spawn") if fresh_interpreter else _FORKSERVER
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        envs = [{**os.environ, **(env or {}), **(env_per_rank[r] if env_per_rank else {})} for r in range(world_size)]
        stacks_after_s = max(1.0, deadline_s - 5)
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init, backend, pg_options, envs[r], pg_timeout_s,
                                                  args, results, before_init, stacks_after_s), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + deadline_s
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        ends = []  # each rank's exit code, or "hung" where it had to be killed
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()) if len(got) == world_size else 1.0)
            ends.append("hung" if p.is_alive() else p.exitcode)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in got and r not in allow_missing]
    # A rank that gave its result and then never ended hung in destroy_process_group or at exit.
    stuck = sorted(r for r in got if ends[r] == "hung")
    if errors or missing or stuck:
        how = ", ".join(f"rank {r}: " + (ends[r] if ends[r] == "hung" else f"exit code {ends[r]}") for r in missing)
        raise RankFailed("\n".join(errors) + (f"\nno result from ranks {missing} ({how})" if missing else "") +
                         (f"\nranks {stuck} gave their results but did not end by the deadline (hung in "
                          "destroy_process_group or at exit)" if stuck else ""))
    return [got[r][1] if r in got else None for r in range(world_size)]


def seeds(default, first=0):
    """The seeds of a randomized test: `default` of them, or HCA_TEST_SEEDS (a longer search for rare
    failures), from `first`."""
    return range(first, first + int(os.environ.get("HCA_TEST_SEEDS", default)))


def shared_mappings():
    """How many of this process's mappings are hca's shared-memory segments."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum("/dev/shm/torch_hca_" in line for line in f)


def raises(fn, exc_type):
    """What `fn` raised as `exc_type` (its message), or a line starting UNEXPECTED."""
    try:
        fn()
    except exc_type as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        return f"UNEXPECTED {type(e).__name__}: {e}"
    return "UNEXPECTED: no exception"


def watch_until(finished):
    """Starts a thread that polls `finished()` every millisecond; join(timeout) on what it returns
    gives the time.monotonic() at which it first held (the same clock in every process: a rank's
    moment can be compared with another's), late by up to the poll, or None if it has not."""
    import threading

    seen = []

    def watch():
        while not finished():
            time.sleep(0.001)
        seen.append(time.monotonic())

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def join(timeout):
        thread.join(timeout)
        return seen[0] if seen else None

    return join


class WaitingFinalizer:
    """Python that runs when `obj` is freed and waits, off the main thread, until `go_on` is set
    (as a finalizer may wait for something the group must do). `seen` says where it ran and
    whether it was let go; `started` is set once it runs."""

    def __init__(self, obj):
        self.started, self.go_on, self.seen = threading.Event(), threading.Event(), {}
        weakref.finalize(obj, self._run)

    def _run(self):
        self.seen["thread"] = threading.current_thread() is not threading.main_thread()
        self.started.set()
        if self.seen["thread"]:
            self.seen["released"] = self.go_on.wait(20)

    def completes_meanwhile(self, within_s=10.0):
        """Whether an all-reduce issued now (polled, never waited: only hca's threads can run
        it) completes within `within_s` while the finalizer waits; then lets the finalizer go."""
        assert self.started.wait(20), "the tensor was never freed"
        work = dist.all_reduce(torch.ones(1000), async_op=True)
        deadline = time.monotonic() + within_s
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        completed = work.is_completed()
        self.go_on.set()
        work.wait()
        return completed
