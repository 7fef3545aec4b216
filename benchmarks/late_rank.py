"""What a collective costs after its last rank arrives, when one rank comes late (as in a training
step, where ranks finish their compute at different times).

    python benchmarks/late_rank.py [--world-sizes 2,3] [--late-ms 3] [--calls 30] [--out FILE.json]

For each world size, op (all_reduce, all_gather and reduce_scatter into one tensor; fp32, hca's
defaults) and size (64 KiB to 16 MiB of input), `calls` calls after a barrier, timed on
time.monotonic_ns, a clock every process of the machine shares: from the last rank's entry to the
last rank's exit, the median over the calls, us. Before each call one rank (rotating) computes for
`--late-ms` ("one late": the others wait in the collective meanwhile), or every rank does ("all
late": they arrive together, as in a replay of the calls alone).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from torch_hca.bench import int_list_arg
from torch_hca.reference import all_gather_single, reduce_scatter_single
from torch_hca.ranks import rows_by_world_size, write_rows

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
WARMUP = 3  # calls before the timed ones


def compute_for(seconds):
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def caller(op, numel, world, group):
    """The call, on tensors made once (a fresh output's page faults would be timed too)."""
    t = torch.randn(numel)
    if op == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        out = torch.zeros(numel * world)
        return lambda: all_gather_single(out, t, group=group)
    out = torch.zeros(numel // world)
    return lambda: reduce_scatter_single(out, t, group=group)


def after_last_arrival_us(rank, world, run, late_s, one_late, calls):
    """The median over `calls` of (last exit - last entry), us; every rank returns the same."""
    spans = []
    for i in range(WARMUP + calls):
        dist.barrier()  # hca's own: the ranks leave it within microseconds of each other
        if not one_late or rank == i % world:
            compute_for(late_s)
        entered = time.monotonic_ns()
        run()
        spans.append([entered, time.monotonic_ns()])
    every = [torch.empty(len(spans), 2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(spans))
    last = torch.stack(every).max(dim=0).values[WARMUP:]  # per call: the last entry, the last exit
    return statistics.median(((last[:, 1] - last[:, 0]) / 1e3).tolist())


def worker(rank, world, init, late_ms, calls, out):
    import torch_hca  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("hca", init_method=init, rank=rank, world_size=world)
    rows = []
    for op in OPS:
        for nbytes in SIZES:
            run = caller(op, nbytes // 4 // world * world, world, dist.group.WORLD)
            row = dict(world_size=world, op=op, size=nbytes)
            for key, one_late in (("all late", False), ("one late", True)):
                row[key] = after_last_arrival_us(rank, world, run, late_ms / 1e3, one_late, calls)
            rows.append(row)
    write_rows(rank, rows, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int_list_arg("integers such as 2,3", 2), default="2,3")
    parser.add_argument("--late-ms", type=float, default=3.0)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args()
    rows = rows_by_world_size(worker, args.world_sizes, args.late_ms, args.calls)
    print(f"us after the last rank arrived, median of {args.calls} calls; one rank late by {args.late_ms:g} ms")
    print("| ranks | op | size | all late | one late | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world_size']} | {r['op']} | {r['size'] >> 10} KiB | {r['all late']:.1f} | {r['one late']:.1f} "
              f"| {r['one late'] / r['all late']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
