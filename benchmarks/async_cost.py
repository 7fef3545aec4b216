"""What async_op=True costs over a blocking call, with a control that shows the noise.

    python benchmarks/async_cost.py [--world-sizes 1,2,3,4] [--out FILE.json]

For each world size and size (4 B, 4 KiB, 64 KiB), an hca group (default options) times batches
of 100 float32 allreduces in five modes, the batches alternating so that all see the same moments
of the machine (median of 21 batches, slowest rank, us per call):
  blocking         dist.all_reduce(t)
  async            dist.all_reduce(t, async_op=True).wait()
  blocking again   the first mode again: blocking again / blocking is the ratio's noise
  sleep            time.sleep(300 us) alone
  overlap          an async call, time.sleep(300 us), then wait(): overlap - sleep is what the
                   call adds when the caller does something else meanwhile (0 if fully hidden)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from torch_hca.bench import int_list_arg
from torch_hca.ranks import rows_by_world_size, write_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import alternating_medians  # noqa: E402

SIZES = (4, 4 << 10, 64 << 10)
BATCHES, CALLS = 21, 100


def sleep_then_wait(work):
    time.sleep(300e-6)
    work.wait()


def worker(rank, world, init, out):
    import torch_hca  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    timer_group = dist.group.WORLD
    hca = dist.new_group(backend="hca")
    rows = []
    for nbytes in SIZES:
        t = torch.zeros(max(1, nbytes // 4))
        modes = {"blocking": lambda: dist.all_reduce(t, group=hca),
                 "async": lambda: dist.all_reduce(t, group=hca, async_op=True).wait(),
                 "blocking again": lambda: dist.all_reduce(t, group=hca),
                 "sleep": lambda: time.sleep(300e-6),
                 "overlap": lambda: sleep_then_wait(dist.all_reduce(t, group=hca, async_op=True))}
        for fn in modes.values():
            for _ in range(CALLS):
                fn()
        medians = alternating_medians(modes, dict.fromkeys(modes, CALLS), timer_group, BATCHES)
        rows.append(dict(world_size=world, size=nbytes, **{mode: s * 1e6 for mode, s in medians.items()}))
    write_rows(rank, rows, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int_list_arg("integers such as 1,2,4", 1), default="1,2,3,4")
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args()
    rows = rows_by_world_size(worker, args.world_sizes)
    print("| ranks | size | blocking | async | blocking again | async / blocking | again / blocking "
          "| overlap - sleep |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world_size']} | {r['size']} B | {r['blocking']:.1f} | {r['async']:.1f} | "
              f"{r['blocking again']:.1f} | {r['async'] / r['blocking']:.2f} | "
              f"{r['blocking again'] / r['blocking']:.2f} | {r['overlap'] - r['sleep']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
