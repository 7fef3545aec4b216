"""`python -m torch_hca.calibrate`: measure the cost model of this machine for a world size, and cache it.

    python -m torch_hca.calibrate --world-size 4
    torchrun --nproc-per-node 4 -m torch_hca.calibrate

Starts that many CPU ranks here (or runs on torchrun's), times one pack, a pack per rank,
reduce_to_one_device and direct against each other from 4 B to 8 MiB (torch_hca.costs; about 6 s for
4 ranks on 2 CPUs), and writes the cache file that every later group of that many ranks on this
machine reads at init (rank 0's, shared with the others). Delete the file to go back to the
shipped table.
"""
import argparse
import os

import torch.distributed as dist

from . import costs
from .ranks import run_on_ranks
from .topology import hierarchy


def _calibrate(_args):
    """On every rank: an hca group over them all, made with a calibration at its init."""
    os.environ["TORCH_HCA_CALIBRATE"] = "force"
    group = dist.new_group(backend="hca")
    model = hierarchy(group)["cost_model"]["cpu"]
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks: {model.origin}")
        for name, line in model.lines.items():
            print(f"  {name}: {line.fixed_us:.1f} us + bytes / {line.bytes_per_us:.0f} bytes per us")
        print(f"  with algorithm and num_packs unset: {model.rule()}")
        print(f"  with algorithm='hierarchical_copy': {model.rule(costs.candidates('hierarchical_copy', None))}",
              flush=True)
    dist.destroy_process_group(group)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start (not under torchrun)")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size: a calibration needs 2 ranks or more, got {args.world_size}")
    run_on_ranks(_calibrate, args, args.world_size)


if __name__ == "__main__":
    main()
