"""Where a small allreduce's time goes, at world size 1 (nothing moves) and 2.

    python benchmarks/overhead.py [--world-size 2] [--calls 20000]

Rows, each the mean microseconds per call over `calls` calls after a warm-up (rank 0):
  fake backend     dist.all_reduce on torch's fake backend, which does nothing: what torch's
                   wrapper costs around a backend (3.8-4.4 us in three launches on 2026-11-23;
                   one earlier launch measured it slower than hca, so read it beside hca's row)
  hca              dist.all_reduce on an hca group (what users call)
  hca backend      the hca backend's own allreduce([t], opts).wait(), without torch's wrapper:
                   "hca" minus this is torch's share (Python wrapper, dispatcher, Work object)
  gloo             dist.all_reduce on a gloo group
each blocking and with async_op=True then wait()."""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

from torch_hca.ranks import start_ranks


def mean_us(fn, calls):
    for _ in range(min(calls, 2000)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def worker(rank, world, init, calls, out):
    import torch_hca  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t = torch.zeros(1)
    hca = dist.new_group(backend="hca")
    gloo = dist.group.WORLD
    backend = hca._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    rows = {}
    for name, group in (("hca", hca), ("gloo", gloo)):
        dist.barrier(group=gloo)
        rows[f"{name} blocking"] = mean_us(lambda: dist.all_reduce(t, group=group), calls)
        dist.barrier(group=gloo)
        rows[f"{name} async+wait"] = mean_us(lambda: dist.all_reduce(t, group=group, async_op=True).wait(), calls)
    dist.barrier(group=gloo)
    rows["hca backend allreduce().wait()"] = mean_us(lambda: backend.allreduce([t], opts).wait(), calls)
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def fake_backend(calls):
    """dist.all_reduce on torch's fake backend, in this process (world size 1)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    t = torch.zeros(1)
    rows = {"fake backend blocking": mean_us(lambda: dist.all_reduce(t), calls),
            "fake backend async+wait": mean_us(lambda: dist.all_reduce(t, async_op=True).wait(), calls)}
    dist.destroy_process_group()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    rows = fake_backend(args.calls)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        start_ranks(worker, (args.world_size, f"file://{tmp}/store", args.calls, out), args.world_size)
        rows.update(torch.load(out))
    print(f"# 4-byte allreduce, world size {args.world_size}, mean us per call over {args.calls} calls (rank 0)")
    for name, us in rows.items():
        print(f"{name:<40} {us:8.2f}")


if __name__ == "__main__":
    main()
