"""What creating a group costs: dist.new_group beside ProcessGroup.split_group, measured alike.

    python benchmarks/group_creation.py [--world-size 2] [--groups 100] [--store tcp|file]
                                        [--backend hca|gloo]

Each rank creates `groups` groups of every rank one way, then as many the other way (each kept,
as a program keeps its groups), after a barrier; rank 0 prints the median, 90th percentile and
largest time of one creation, in ms, and how many took over a second. split_group asks torch to
clone the parent's store first (a new TCP connection under tcp); the backend's own split comes after.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

from torch_hca.ranks import start_ranks


def _times(make, count):
    took = []
    for i in range(count):
        start = time.perf_counter()
        make(i)
        took.append((time.perf_counter() - start) * 1e3)
    return took


def worker(rank, world, init, backend, groups, out):
    import torch_hca  # noqa: F401  (registers "hca")

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    everyone = list(range(world))
    parent = dist.group.WORLD
    kept = []
    dist.barrier()
    rows = {"new_group": _times(lambda i: kept.append(dist.new_group(everyone, backend=backend)), groups)}
    dist.barrier()
    rows["split_group"] = _times(lambda i: kept.append(parent.split_group(
        everyone, timeout=timedelta(seconds=60), group_name=f"split{i}")), groups)
    if rank == 0:
        with open(out, "w") as f:
            for name, took in rows.items():
                took.sort()
                f.write(f"{name:12} median {statistics.median(took):7.1f}  p90 {took[int(0.9 * len(took))]:7.1f}  "
                        f"max {took[-1]:7.1f} ms; {sum(t > 1000 for t in took)} of {len(took)} over 1 s\n")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--store", choices=["tcp", "file"], default="tcp")
    p.add_argument("--backend", choices=["hca", "gloo"], default="hca")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="torch_hca-") as tmp:
        if args.store == "tcp":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        else:
            init = f"file://{tmp}/store"
        out = os.path.join(tmp, "rows.txt")
        start_ranks(worker, (args.world_size, init, args.backend, args.groups, out), args.world_size)
        print(f"{args.world_size} ranks, {args.groups} groups each way, {args.store} store, {args.backend}:")
        print(open(out).read(), end="")


if __name__ == "__main__":
    main()
