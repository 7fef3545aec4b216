"""One rank of a test across simulated hosts (see netns.py): initialises an `hca` group from the
environment, runs node_cases.<case>, and writes ["ok", value] or ["error", traceback] as JSON."""
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import node_cases
import torch_hca  # noqa: F401  registers "hca"


def plain(value):
    """JSON-ready: tensors become lists (floats as Python floats: exact through JSON)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def main():
    case, out, args, timeout_s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    try:
        dist.init_process_group("hca", init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        result = ["ok", plain(getattr(node_cases, case)(rank, world, *args))]
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  every failure goes back to the test
        result = ["error", traceback.format_exc()]
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
