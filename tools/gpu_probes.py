"""The first GPU run's probes that the tests and the benchmark do not cover
(run by tools/gpu_check.sh; writes one JSON file):

T1  two ranks of hca on one GPU: rank 0's stream runs a ~50 ms kernel before its allreduce,
    rank 1 calls the allreduce at once, so its stream waits on rank 0's flag word. Rank 0's
    kernel must not slow down while rank 1's stream waits, and rank 1's other streams must run.
T2  legacy CUDA IPC between two processes on one GPU (torch's CUDA tensor sharing): copies
    both ways, checked element by element, and their bandwidth.

T3 (allreduce of 2/3/4 ranks on one GPU against the roofline) is the benchmark; T4 (kill -9
mid-collective) is tests/test_cuda.py::test_killed_rank_releases_the_streams_and_is_named.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KERNEL_MS = 50.0


def _sleep_cycles(ms):
    """torch.cuda._sleep cycles for about `ms` on this GPU, measured (with the GPU to itself: a
    peer's kernels would share its time and make the count far too small)."""
    torch.cuda._sleep(1000)  # the first launch loads the kernel
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 * ms / start.elapsed_time(end))


def _timed_sleep(cycles):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    return start, end


def _t1_rank(rank, world, init, results):
    import torch_hca  # noqa: F401  (registers hca)

    torch.cuda.set_device(0)
    dist.init_process_group("hca", init_method=init, rank=rank, world_size=world)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)  # set-up (IPC, registration) outside the timing
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.ones(1000, device="cuda").sum().item()  # the side stream's first work, outside the timing
    for turn in range(world):  # one rank at a time, so that each has the GPU to itself
        if rank == turn:
            cycles = _sleep_cycles(KERNEL_MS)
            alone = _timed_sleep(cycles)
            alone[1].synchronize()
        dist.barrier()
    row = {"rank": rank, "kernel_alone_ms": alone[0].elapsed_time(alone[1])}
    begin = time.perf_counter()
    if rank == 0:
        busy = _timed_sleep(cycles)  # the allreduce's stream waits for this kernel
        dist.all_reduce(t)
        busy[1].synchronize()
        row["kernel_while_peer_waits_ms"] = busy[0].elapsed_time(busy[1])
    else:
        dist.all_reduce(t)  # issued at once: its stream waits on rank 0's flag
        with torch.cuda.stream(side):
            t0 = time.perf_counter()
            torch.ones(1000, device="cuda").sum().item()  # another stream of the waiting process
            row["side_stream_ms_while_waiting"] = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    row["allreduce_done_after_ms"] = (time.perf_counter() - begin) * 1e3
    row["result_ok"] = bool(torch.all(t == 4.0).item())  # two allreduces of ones over two ranks
    results.put(row)
    dist.destroy_process_group()


def _t2_peer(queue, done):
    torch.cuda.set_device(0)
    shared = queue.get()  # opened through cudaIpcOpenMemHandle
    mine = torch.arange(shared.numel(), device="cuda", dtype=torch.float32)
    received = shared.clone()  # peer -> me
    shared.copy_(mine * 2)  # me -> peer
    torch.cuda.synchronize()
    done.put(bool(torch.equal(received, torch.arange(shared.numel(), device="cuda", dtype=torch.float32) + 1)))


def probe_t2(numel=1 << 26):
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_t2_peer, args=(queue, done))
    peer.start()
    torch.cuda.set_device(0)
    t = torch.arange(numel, device="cuda", dtype=torch.float32) + 1
    torch.cuda.synchronize()
    start = time.perf_counter()
    queue.put(t)
    peer_read_ok = done.get(timeout=120)
    elapsed = time.perf_counter() - start
    peer.join(timeout=30)
    wrote_back_ok = bool(torch.equal(t, torch.arange(numel, device="cuda", dtype=torch.float32) * 2))
    return {"bytes": numel * 4, "peer_read_ok": peer_read_ok, "wrote_back_ok": wrote_back_ok,
            "round_trip_s_including_open": elapsed}


def probe_t1(world=2):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_t1_rank, args=(r, world, init, results)) for r in range(world)]
        for p in procs:
            p.start()
        rows = [results.get(timeout=180) for _ in range(world)]
        for p in procs:
            p.join(timeout=30)
    return sorted(rows, key=lambda r: r["rank"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_probes: no CUDA device")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, probe in (("T1_stream_wait_on_shared_gpu", probe_t1), ("T2_ipc_one_gpu", probe_t2)):
        try:
            report[name] = probe()
        except Exception as e:  # a probe that fails is a finding: record it, run the next
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(report[name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
