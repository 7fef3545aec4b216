"""Soak: many mixed collectives with random sizes and algorithms, every result checked;
resident memory and open file descriptors reported at the start and the end.

    python benchmarks/soak.py --collectives 10000 --world-size 3
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from torch_hca.ranks import start_ranks

ALGORITHMS = [dict(algorithm="hierarchical_copy", num_packs=n) for n in (0, 1, 2, 5)] + [
    dict(algorithm="reduce_to_one_device"), dict(algorithm="nccl", num_packs=2)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32]


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def check(name, got, want):
    tol = dict(rtol=2e-2, atol=2e-2) if got.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    if not torch.allclose(got.double(), want.double(), **tol):
        raise AssertionError(f"{name}: wrong result")


def one(step, rank, world, groups, rng):
    """One random collective; every rank draws the same choices from the shared seed."""
    group = groups[rng.randrange(len(groups))]
    dtype = rng.choice(DTYPES)
    numel = int(10 ** rng.uniform(0, 5.5))
    kind = rng.choice(["allreduce", "allreduce", "batch", "broadcast", "allgather", "reduce"])
    def make(r, n=numel):  # rank r's input, recomputable by every rank
        return torch.randint(-50, 50, (n,), generator=torch.Generator().manual_seed(step * 64 + r)).to(dtype)

    mine = make(rank)
    if kind == "allreduce":
        dist.all_reduce(mine, group=group)
        check(f"#{step} allreduce", mine, sum(make(r).double() for r in range(world)))
    elif kind == "batch":
        import torch_hca

        extra = make(rank, 1 + numel // 3)
        torch_hca.batch_allreduce([mine, extra], group=group)
        check(f"#{step} batch", mine, sum(make(r).double() for r in range(world)))
        check(f"#{step} batch", extra, sum(make(r, 1 + numel // 3).double() for r in range(world)))
    elif kind == "broadcast":
        src = rng.randrange(world)
        dist.broadcast(mine, src=src, group=group)
        check(f"#{step} broadcast", mine, make(src))
    elif kind == "allgather":
        outs = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(outs, mine, group=group)
        for r in range(world):
            check(f"#{step} allgather", outs[r], make(r))
    else:
        dst = rng.randrange(world)
        dist.reduce(mine, dst=dst, group=group)
        if rank == dst:
            check(f"#{step} reduce", mine, sum(make(r).double() for r in range(world)))


def worker(rank, world, init, count, seed):
    import torch_hca

    torch.set_num_threads(1)
    dist.init_process_group("hca", init_method=init, rank=rank, world_size=world)
    groups = [dist.new_group(backend="hca", pg_options=torch_hca.Options(**a)) for a in ALGORITHMS]
    rng = random.Random(seed)
    for step in range(20):  # warm up the allocators before the first reading
        one(step, rank, world, groups, rng)
    start_rss, start_fds, t0 = rss_mib(), open_fds(), time.time()
    for step in range(20, count):
        one(step, rank, world, groups, rng)
        if rank == 0 and step % 1000 == 0:
            print(f"  {step} collectives, rss {rss_mib():.1f} MiB, fds {open_fds()}", flush=True)
    end_rss, end_fds = rss_mib(), open_fds()
    if rank == 0:
        print(f"soak: {count} collectives on {world} ranks in {time.time() - t0:.0f} s, all checked; "
              f"rank 0 rss {start_rss:.1f} -> {end_rss:.1f} MiB, open fds {start_fds} -> {end_fds}")
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=10_000)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(worker, (args.world_size, f"file://{tmp}/store", args.collectives, args.seed), args.world_size)
    left = [n for n in os.listdir("/dev/shm") if n.startswith("torch_hca")]
    print(f"/dev/shm entries of torch_hca left: {len(left)}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
