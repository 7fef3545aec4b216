"""Whether the compiled extension was built for the torch that is running: checked before it
loads, since an extension built against another torch release fails to load with an undefined
symbol that names neither version."""
from __future__ import annotations

import os
from typing import Optional

import torch

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "built_for_torch.txt")
REBUILD = "pip install --no-build-isolation -e . (or python setup.py build_ext --inplace) in torch_hca's checkout"


def release(version: str) -> str:
    """"2.13.0" of "2.13.0+cpu": builds of one release share their C++ interface."""
    return version.split("+")[0]


def check_built_torch(record: str = RECORD, running: Optional[str] = None) -> None:
    """ImportError naming both versions where the extension was built for another torch release;
    nothing where the build left no record (a build older than the record)."""
    running = running or torch.__version__
    try:
        with open(record) as f:
            built = f.read().strip()
    except FileNotFoundError:
        return
    if release(built) != release(running):
        raise ImportError(f"torch_hca's extension was built for torch {built}, but torch {running} is running: "
                          f"rebuild it against this torch ({REBUILD})")
