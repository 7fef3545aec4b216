"""How often two ranks end up on one CPU, and what it costs them.

    python benchmarks/shared_cpu.py [--world 2] [--bytes 1024] [--batches 80] [--calls 200] [--out FILE.json]

Each batch starts after a gloo barrier, where the ranks sleep (a woken task goes to its waker's
CPU, so this is where two ranks meet on one), then times `calls` back-to-back all-reduces of
`bytes` (fp32, hca's defaults) one by one: the batch's median, the slowest rank's, us. Each rank
also notes the CPU it runs on before and after the batch. Printed: the batches, their median, how
many took over twice the median of all, and how many ended with two ranks on one CPU.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch
import torch.distributed as dist

from torch_hca.ranks import rows_from_ranks, write_rows

_libc = ctypes.CDLL(None)


def batches_on_rank(rank, world, init_method, out, numel, batches, calls):
    import torch_hca  # noqa: F401  (registers "hca" in the forked rank)

    dist.init_process_group("hca", init_method=init_method, rank=rank, world_size=world)
    timer = dist.new_group(backend="gloo")
    t = torch.randn(numel)
    rows = []
    for _ in range(batches):
        dist.barrier(group=timer)
        for _ in range(3):
            dist.all_reduce(t)
        before = _libc.sched_getcpu()
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        mine = torch.tensor([statistics.median(samples) * 1e6, before, _libc.sched_getcpu()], dtype=torch.float64)
        every = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, mine, group=timer)
        rows.append(dict(median_us=max(r[0].item() for r in every),
                         cpus_before=[int(r[1]) for r in every], cpus_after=[int(r[2]) for r in every]))
    write_rows(rank, rows, out)
    dist.destroy_process_group()


def summary(rows):
    times = [r["median_us"] for r in rows]
    middle = statistics.median(times)
    shared = sum(len(set(r["cpus_after"])) < len(r["cpus_after"]) for r in rows)
    return dict(batches=len(rows), median_us=middle, max_us=max(times),
                over_twice_the_median=sum(t > 2 * middle for t in times), ended_sharing_a_cpu=shared)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = rows_from_ranks(batches_on_rank, args.world, lambda init, out: (
        args.world, init, out, args.bytes // 4, args.batches, args.calls))
    result = dict(args=vars(args), summary=summary(rows), batches=rows)
    print(json.dumps(result["summary"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
