"""hca across two simulated nodes (2 ranks each) beside gloo on the same 4 ranks.

    python benchmarks/nodes.py                      # allreduce, 4 KiB .. 16 MiB, CPU tensors

The nodes are named by TORCH_HCA_NODE_ID (node r // 2 for rank r), so hca reduces inside each
pair through shared memory and between the pairs over gloo (TCP on loopback here); hca on one
node of 4 ranks is shown for reference. Every contender runs in the same processes, one after
the other; columns as in bench.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import print_speedups, ratios  # noqa: E402
from torch_hca.bench import measure, parse_size, print_table, size_sweep  # noqa: E402
from torch_hca.ranks import rows_from_ranks, write_rows  # noqa: E402

WORLD = 4


def contenders():
    """(label, node id of rank r, hca options); gloo first."""
    import torch_hca

    return [("gloo", None, None),
            ("hca 2 nodes x 2 ranks", lambda r: f"node{r // 2}", torch_hca.Options(num_packs=1)),
            ("hca 2 nodes x 2 ranks (num_packs=2)", lambda r: f"node{r // 2}", torch_hca.Options(num_packs=2)),
            ("hca 1 node x 4 ranks", lambda r: "node", torch_hca.Options(num_packs=1))]


def worker(rank, init, sizes, out_path):
    import torch_hca  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    timer_group = dist.group.WORLD
    rows = []
    for label, node_of, options in contenders():
        if node_of is None:
            group = timer_group
        else:
            os.environ["TORCH_HCA_NODE_ID"] = node_of(rank)  # read when the group is created
            group = dist.new_group(backend="hca", pg_options=options)
        rows += measure(label, "all_reduce", group, sizes, torch.float32, torch.device("cpu"), timer_group)
    write_rows(rank, rows, out_path)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", default="4K")
    parser.add_argument("--max-bytes", default="16M")
    parser.add_argument("--step", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    try:
        sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.step)
    except ValueError as e:
        parser.error(f"--min-bytes, --max-bytes, --step: {e}")
    rows = rows_from_ranks(worker, WORLD, lambda init, out: (init, sizes, out))
    print_table(rows)
    speedups = ratios(rows)
    print_speedups(speedups)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    path = os.path.join(args.out, f"cpu-nodes2x2-{stamp}.json")
    meta = dict(device="cpu", cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                torch=torch.__version__, date=stamp, command=" ".join(sys.argv))
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows, speedup_vs_gloo=speedups), f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
