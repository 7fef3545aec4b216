"""`python -m torch_hca`: what this torch_hca is and what it sees here, to paste into a bug report.

    python -m torch_hca

The version and the torch it was built for, whether the build has the CUDA executor and what
CUDA, NCCL and gloo torch offers, the CPUs and /dev/shm ranks would share, this process's node
identity, the TORCH_HCA_* variables set (naming any torch_hca does not read), the calibrations
cached, and the other tools. Starts no ranks.
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import List

import torch
import torch.distributed as dist

from . import _C, __version__, costs, node_identity
from .build_check import RECORD
from .settings import set_variables, unknown_text, unknown_variables

TOOLS = (
    ("check", "every op, dtype and algorithm against a float64 reference"),
    ("bench", "nccl-tests' sweep, against gloo or nccl with --compare"),
    ("calibrate", "fits the cost model that picks algorithm and num_packs per call"),
    ("explain", "the plan of a collective: who reduces what into whom"),
)


def _built_for() -> str:
    try:
        with open(RECORD) as f:
            return f.read().strip()
    except FileNotFoundError:
        return "not recorded"


def _cuda_lines() -> List[str]:
    build = f"the CUDA executor (built with CUDA {torch.version.cuda})" if _C.has_cuda else "CPU only (no CUDA executor)"
    lines = [f"build: {build}"]
    if not torch.cuda.is_available():
        return lines + ["CUDA: no GPU visible to torch"]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "not in this torch"
    return lines + [f"CUDA: {len(names)} GPU(s): {', '.join(names)}; NCCL {nccl}"]


def _shm_line() -> str:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError as e:
        return f"/dev/shm: unusable ({e})"
    return f"/dev/shm: {usage.total / 2**30:.1f} GiB, {usage.free / 2**30:.1f} GiB free"


def _settings_lines() -> List[str]:
    variables = set_variables()
    if not variables:
        return ["TORCH_HCA_* set: none (every setting at its default)"]
    unknown = dict(unknown_variables())
    lines = ["TORCH_HCA_* set:"]
    for name, value in variables.items():
        lines.append(f"  {name}={value}" + (f"  <- {unknown_text(name, unknown[name])}" if name in unknown else ""))
    return lines


def _calibration_lines() -> List[str]:
    folder = costs.cache_dir()
    files = sorted(folder.glob("costs-*.json")) if folder.is_dir() else []
    lines = [f"calibrations in {folder}: " + (f"{len(files)}" if files else "none (groups use the shipped table)")]
    return lines + [f"  {f.name}" for f in files]


def report() -> List[str]:
    """The lines `python -m torch_hca` prints."""
    lines = [f"torch_hca {__version__} ({os.path.dirname(os.path.abspath(__file__))})",
             f"torch: {torch.__version__} running, extension built for {_built_for()}"]
    lines += _cuda_lines()
    lines.append(f"gloo: {'available' if dist.is_gloo_available() else 'not in this torch'}")
    lines.append(f"CPUs: {len(os.sched_getaffinity(0))} usable of {os.cpu_count()} ({costs._cpu_model()})")
    lines.append(_shm_line())
    lines.append(f"node identity: {node_identity()}")
    lines += _settings_lines()
    lines += _calibration_lines()
    lines.append("tools:")
    lines += [f"  python -m torch_hca.{name:<10} {what}" for name, what in TOOLS]
    return lines


def main(argv=None) -> None:
    argparse.ArgumentParser(prog="python -m torch_hca", description=__doc__.splitlines()[0]).parse_args(argv)
    print("\n".join(report()))


if __name__ == "__main__":
    main()
