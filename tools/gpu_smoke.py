"""A small hca allreduce on N ranks (the GPU check's first phase, and memcheck's target):
every rank all-reduces seeded data on its device (all CUDA ranks share GPU 0..n round-robin),
checks every element against a float64 sum, and prints one line per rank.

    python tools/gpu_smoke.py --world 2 --numel 1048576 [--device cuda|cpu]

--device defaults to cuda where a GPU is present, else cpu (the CPU model of the device, so
that the script is checked without a GPU)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, init, device, numel, rounds):
    if device == "cpu":
        os.environ["TORCH_HCA_CPU_EXECUTOR"] = "streams"
    import torch_hca  # noqa: F401  registers "hca"

    dist.init_process_group("hca", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(world)]
    want = torch.stack(inputs).sum(0).float()
    worst, start = 0.0, time.perf_counter()
    for _ in range(rounds):
        t = inputs[rank].float().to(dev)
        dist.all_reduce(t)
        worst = max(worst, float((t.cpu() - want).abs().max()))
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / rounds
    ok = worst <= 1e-4 * world
    print(f"rank {rank}/{world} {dev}: {rounds} allreduces of {numel} floats, max error {worst:.2e}, "
          f"{elapsed * 1e3:.2f} ms each: {'OK' if ok else 'WRONG'}", flush=True)
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(_rank, args=(args.world, init, args.device, args.numel, args.rounds), nprocs=args.world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
