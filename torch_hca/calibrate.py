"""`python -m torch_hca.calibrate`: measure the cost model of this machine for a world size, and cache it.

    python -m torch_hca.calibrate --world-size 4

Starts that many CPU ranks here, times one pack against a pack per rank (torch_hca.costs), and
writes the cache file that every later group of that many ranks on this machine reads at init
(rank 0's, shared with the others). Delete the file to go back to the shipped table.
"""
import argparse
import json
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from .costs import NEVER, CostModel


def _rank(rank, world, init, out):
    import torch_hca  # noqa: F401  registers "hca"

    os.environ["TORCH_HCA_CALIBRATE"] = "force"
    dist.init_process_group("hca", init_method=init, rank=rank, world_size=world)
    if rank == 0:
        model = torch_hca.hierarchy()["cost_model"]
        with open(out, "w") as f:
            json.dump(model.to_json(), f)
    dist.destroy_process_group()


def calibrate(world_size: int):
    """The CostModel measured for `world_size` ranks on this machine (and now cached)."""
    if world_size < 2:
        raise ValueError(f"world_size: a calibration needs 2 ranks or more, got {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "model.json")
        mp.start_processes(_rank, args=(world_size, f"file://{os.path.join(tmp, 'store')}", out),
                           nprocs=world_size, start_method="spawn")
        with open(out) as f:
            return CostModel.from_json(json.load(f))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    model = calibrate(args.world_size)
    threshold = model.pack_per_rank_from_bytes()
    print(f"{args.world_size} ranks: {model.origin}")
    for name in ("one_pack", "pack_per_rank"):
        line = getattr(model, name)
        print(f"  {name}: {line.fixed_us:.1f} us + bytes / {line.bytes_per_us:.0f} bytes per us")
    print("  a pack per rank " + ("never" if threshold == NEVER else f"from {threshold} bytes"))


if __name__ == "__main__":
    main()
