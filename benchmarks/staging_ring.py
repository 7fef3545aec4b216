"""How long the shared-memory staging ring should be: hca groups that differ only in
TORCH_HCA_SHM_SLOTS, timed interleaved in one launch (so the VM's placement, which changes
every few seconds here, weighs on every ring alike).

    python benchmarks/staging_ring.py [--world-size 2] [--slots 2,8,16,32] [--num-packs 1]
        [--algorithm hierarchical_copy] [--out F.json]

Per size and ring: the median and the best of 7 repeats (rank 0's mean microseconds per call
over a batch of back-to-back calls); repeats alternate the order of the rings."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from torch_hca.bench import int_list_arg, parse_size
from torch_hca.ranks import start_ranks

REPEATS = 7


def worker(rank, world, init, slots, sizes, options, out):
    import torch_hca

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = {}
    for s in slots:
        os.environ["TORCH_HCA_SHM_SLOTS"] = str(s)  # read when the group is made
        groups[s] = dist.new_group(backend="hca", pg_options=torch_hca.Options(**options))
    rows = []
    for nbytes in sizes:
        t = torch.randn(max(1, nbytes // 4))
        calls = max(20, min(4000, (32 << 20) // nbytes))
        times = {s: [] for s in slots}
        for repeat in range(REPEATS):
            for s in slots if repeat % 2 == 0 else slots[::-1]:
                for _ in range(min(200, calls)):
                    dist.all_reduce(t, group=groups[s])
                dist.barrier(group=groups[s])
                start = time.perf_counter()
                for _ in range(calls):
                    dist.all_reduce(t, group=groups[s])
                times[s].append((time.perf_counter() - start) / calls * 1e6)
        rows += [{"bytes": nbytes, "slots": s, "median_us": statistics.median(v), "best_us": min(v)}
                 for s, v in times.items()]
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--slots", type=int_list_arg("slot counts such as 2,8", 1), default="2,8,16,32")
    parser.add_argument("--sizes", default="4,64K,1M,16M")
    parser.add_argument("--num-packs", type=int, default=1)
    parser.add_argument("--algorithm", default="hierarchical_copy")
    parser.add_argument("--out", help="write the rows here as JSON")
    args = parser.parse_args()
    options = {"algorithm": args.algorithm, "num_packs": args.num_packs}
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        start_ranks(worker, (args.world_size, f"file://{tmp}/store", args.slots, sizes, options, out), args.world_size)
        rows = torch.load(out)
    print(f"# allreduce float32, {args.world_size} ranks, {args.algorithm}, num_packs={args.num_packs}: "
          "median (best) us per call")
    print(f"{'bytes':>10} " + " ".join(f"{f'{s} slots':>18}" for s in args.slots))
    for nbytes in sizes:
        cells = [r for r in rows if r["bytes"] == nbytes]
        print(f"{nbytes:>10} " + " ".join(f"{r['median_us']:>9.1f} ({r['best_us']:>6.1f})" for r in cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "torch": torch.__version__, "world_size": args.world_size,
                       **options, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
