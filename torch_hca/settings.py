"""The TORCH_HCA_* environment variables torch_hca reads. One it does not know (NUMPACKS for
NUM_PACKS) would be ignored without a word, so a group's creation warns about it, naming the
closest known name; the table in docs/troubleshooting.md says what each one does."""
from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from typing import Dict, List, Optional, Tuple

from .options import ENV_PREFIX, Options

# Read beside the options (whose names come from Options' fields): by the executors, the
# calibration, the build, the CPU model of the device (tests), and tools/check_torch.sh.
OTHER_VARIABLES = (
    "CALIBRATE", "CACHE_DIR", "SHM_CHUNK_BYTES", "SHM_SLOTS", "CUDA_CHUNK_BYTES", "CUDA_SLOTS", "CUDA_STAGING",
    "CPU_EXECUTOR", "NODE_ID", "SELF_TEST", "NO_CUDA", "CHECK_VENV",
    "MODEL_FAULT_AT", "MODEL_CORRUPT_AT", "MODEL_OP_DELAY_MS", "MODEL_IPC_FAIL", "MODEL_DEVICES", "MODEL_VISIBLE",
    "MODEL_DEVICE", "MODEL_EXCLUSIVE", "MODEL_RUN_AHEAD",
)


def known_variables() -> List[str]:
    """Every TORCH_HCA_* name torch_hca reads."""
    options = [ENV_PREFIX + field.name.upper() for field in dataclasses.fields(Options)]
    return options + [ENV_PREFIX + name for name in OTHER_VARIABLES]


def set_variables(environ=None) -> Dict[str, str]:
    """The TORCH_HCA_* variables set in `environ` (default os.environ), by name."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in sorted(environ.items()) if name.startswith(ENV_PREFIX)}


def unknown_variables(environ=None) -> List[Tuple[str, Optional[str]]]:
    """Each TORCH_HCA_* variable set that torch_hca does not read, with the known name closest to
    it (None where none is close)."""
    known = known_variables()
    # Compared without the prefix, which every name shares.
    suffixes = {name[len(ENV_PREFIX):]: name for name in known}

    def closest(name):
        match = difflib.get_close_matches(name[len(ENV_PREFIX):], suffixes, n=1, cutoff=0.6)
        return suffixes[match[0]] if match else None

    return [(name, closest(name)) for name in set_variables(environ) if name not in known]


def unknown_text(name: str, closest: Optional[str]) -> str:
    guess = f" (did you mean {closest}?)" if closest else ""
    return f"{name} is not a torch_hca setting{guess}: it is ignored"


def warn_unknown_variables(environ=None) -> None:
    """A UserWarning for each variable unknown_variables finds (Python's filters show each once)."""
    for name, closest in unknown_variables(environ):
        warnings.warn(unknown_text(name, closest), UserWarning, stacklevel=3)
