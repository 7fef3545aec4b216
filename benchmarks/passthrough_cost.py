"""What the pass-through (algorithm="nccl") adds to gloo's own calls on CPU tensors.

    python benchmarks/passthrough_cost.py [--world-sizes 2,3] [--out FILE.json]

For each world size and size (4 B, 4 KiB, 64 KiB), a gloo group and an hca group with
algorithm="nccl" (gloo carries its CPU calls, each agreed on first) time batches of 100 float32
all-reduces, blocking and async (all issued, then waited for), the batches alternating so that
all see the same moments of the machine (median of 15 batches, slowest rank, us per call). The
ratio to gloo's is the pass-through's cost: its packing, its queue, and the ranks' agreement on
each call (docs/architecture.md, "Operations").
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from torch_hca.bench import int_list_arg
from torch_hca.ranks import rows_by_world_size, write_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import alternating_medians  # noqa: E402

SIZES = (4, 4 << 10, 64 << 10)
BATCHES, CALLS = 15, 100


def issued_then_waited(t, group):
    works = [dist.all_reduce(t, group=group, async_op=True) for _ in range(CALLS)]
    for work in works:
        work.wait()


def worker(rank, world, init, out):
    import torch_hca

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = {"gloo": dist.new_group(backend="gloo"),
              "pass-through": dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl"))}
    agreed = getattr(groups["pass-through"]._get_backend(torch.device("cpu")), "agreements", "gloo")
    rows = []
    for nbytes in SIZES:
        t = torch.zeros(max(1, nbytes // 4))
        modes = {}
        for name, group in groups.items():
            modes[f"{name} blocking"] = lambda g=group: [dist.all_reduce(t, group=g) for _ in range(CALLS)]
            modes[f"{name} async"] = lambda g=group: issued_then_waited(t, g)
        for fn in modes.values():
            fn()
        medians = alternating_medians(modes, dict.fromkeys(modes, 1), dist.group.WORLD, BATCHES)
        rows.append(dict(world_size=world, size=nbytes, agreements=agreed,
                         **{mode: s / CALLS * 1e6 for mode, s in medians.items()}))
    write_rows(rank, rows, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int_list_arg("integers such as 2,3", 2), default="2,3")
    parser.add_argument("--out", help="write the rows as JSON here too")
    args = parser.parse_args()
    rows = rows_by_world_size(worker, args.world_sizes)
    print(f"pass-through agreements: {rows[0]['agreements']}")
    print("| ranks | size | gloo blocking | pass-through blocking | ratio | gloo async | pass-through async | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world_size']} | {r['size']} B | {r['gloo blocking']:.1f} | {r['pass-through blocking']:.1f} | "
              f"{r['pass-through blocking'] / r['gloo blocking']:.2f} | {r['gloo async']:.1f} | "
              f"{r['pass-through async']:.1f} | {r['pass-through async'] / r['gloo async']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
