"""Where the installed tools' ranks come from: torchrun's environment, or processes of their own."""
from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import reference


def launched_by_torchrun(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


def run_on_ranks(main, args, nprocs: int):
    """main(args) on every rank, with a gloo default group up: this process's rank under
    torchrun (main's answer returned), else `nprocs` spawned processes that meet in a temporary
    file store (None returned: they answer through files)."""
    if launched_by_torchrun():
        dist.init_process_group("gloo")
        try:
            return main(args)
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory(prefix="torch_hca-") as tmp:
        start_ranks(_spawned, (nprocs, f"file://{tmp}/store", main, args), nprocs)


def start_ranks(fn, args, nprocs: int):
    """fn(rank, *args) in `nprocs` processes, as torch.multiprocessing.spawn runs it, but forked
    from multiprocessing's forkserver, which imported torch once: a spawned process would import
    it again, seconds of a short run per rank."""
    mp.set_forkserver_preload(["torch"])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def rows_from_ranks(fn, nprocs: int, make_args):
    """Starts fn(rank, *make_args(init_method, out)) on `nprocs` ranks (start_ranks), which meet
    in a temporary file store; returns the JSON that one of them wrote to the file `out`."""
    with tempfile.TemporaryDirectory(prefix="torch_hca-") as tmp:
        out = os.path.join(tmp, "rows.json")
        start_ranks(fn, make_args(f"file://{tmp}/store", out), nprocs)
        with open(out) as f:
            return json.load(f)


def rows_by_world_size(fn, world_sizes, *args):
    """rows_from_ranks for each world size in turn, fn(rank, world, init_method, *args, out): every
    launch's rows, in order."""
    rows = []
    for world in world_sizes:
        rows += rows_from_ranks(fn, world, lambda init, out: (world, init, *args, out))
    return rows


def write_rows(rank, rows, out):
    """On rank 0, `rows` as the JSON that rows_from_ranks reads back from `out`."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def _spawned(rank, world, init_method, main, args):
    import torch_hca  # noqa: F401  (registers "hca" in the spawned interpreter)

    torch.set_num_threads(1)  # the ranks share the cores; one thread each, as torchrun sets
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        main(args)
    finally:
        dist.destroy_process_group()


def rank_device(device: str) -> torch.device:
    """This rank's device ("auto": cuda where a GPU is): CUDA ranks share the visible GPUs
    round-robin by local rank (several ranks on one GPU run with hca)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return reference.rank_device(device, int(os.environ.get("LOCAL_RANK", dist.get_rank())))
