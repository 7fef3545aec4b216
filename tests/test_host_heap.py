"""The process's C heap under hca: buffers of up to 32 MiB come from the heap once a group exists, as beside gloo,
and up to 128 MiB freed at once stay in the heap for the next step.

glibc gives blocks above its mmap threshold fresh mappings (faulted in page by page, returned at
free), and returns the heap's free top above its trim threshold; freeing a large mapped block raises
both, up to 32 and 64 MiB (gloo's own buffers do). hca frees nothing large, so its group raises them
once at init, the trim threshold to 128 MiB. Where a block came from is read from glibc's own count
of mapped bytes (mallinfo2's hblkhd) while the block is alive; what the heap kept, from its count of
free bytes (fordblks).
"""
import ctypes
import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


pytestmark = pytest.mark.skipif(_libc() is None, reason="glibc 2.33 or later (mallinfo2)")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
FREED_MIB = 112  # more than glibc's own rule keeps (64 MiB), less than hca's trim threshold (128 MiB)


def _mapped_apart(mib):
    """Whether a fresh tensor of `mib` MiB got a mapping of its own rather than heap memory."""
    libc = _libc()
    before = libc.mallinfo2().hblkhd
    block = torch.empty(mib << 18)
    grown = libc.mallinfo2().hblkhd - before
    del block
    return grown >= mib << 20


def _kept_after_freeing(mib):
    """MiB of free memory the heap holds once `mib` MiB of 64 KiB blocks (below any mmap threshold,
    each large enough that its free looks at the trim threshold) are freed, the last first: they
    join the heap's free top, which glibc returns whenever it grows past the trim threshold."""
    libc = _libc()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(mib * 16)]
    for block in reversed(blocks):
        libc.free(block)
    return libc.mallinfo2().fordblks / (1 << 20)


def _before_init(user_fixed_threshold, _rank):
    if user_fixed_threshold:  # as MALLOC_MMAP_THRESHOLD_ would, which glibc reads at start
        assert _libc().mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
    # Freed, this 20 MiB block raises glibc's threshold to 20 MiB, so 28 MiB stays mapped unless hca raises it further.
    os.environ["HCA_TEST_MAPPED_BEFORE_INIT"] = str(int(_mapped_apart(20)))
    os.environ["HCA_TEST_KEPT_BEFORE_INIT"] = str(_kept_after_freeing(FREED_MIB))


def _mapped_before_and_after(rank, world):
    dist.all_reduce(torch.ones(1 << 16))
    return (os.environ["HCA_TEST_MAPPED_BEFORE_INIT"] == "1", _mapped_apart(28), _mapped_apart(20),
            float(os.environ["HCA_TEST_KEPT_BEFORE_INIT"]), _kept_after_freeing(FREED_MIB))


@pytest.mark.parametrize("world", [1, 3])
def test_buffers_up_to_32_mib_come_from_the_heap_and_the_freed_top_stays_once_a_group_exists(world):
    for before, after, _, kept_before, kept_after in run_ranks(_mapped_before_and_after, world,
                                                               before_init=functools.partial(_before_init, False)):
        assert before, "a 20 MiB tensor should get a mapping of its own in a fresh process"
        assert not after, "after init, a 28 MiB tensor should come from the heap"
        assert kept_before <= 64, f"before init glibc returns a free top above 64 MiB, kept {kept_before:.1f} MiB"
        assert kept_after >= FREED_MIB - 8, f"after init the heap should keep the {FREED_MIB} MiB freed, kept {kept_after:.1f}"


def test_a_threshold_the_user_fixed_is_kept():
    for before, after, smaller_after, kept_before, kept_after in run_ranks(
            _mapped_before_and_after, 2, before_init=functools.partial(_before_init, True)):
        assert before and after and smaller_after, "glibc keeps a threshold the user fixed: every tensor mapped"
        assert kept_before < 8 and kept_after < 8, ("glibc keeps the trim threshold (128 KiB) of a user who fixed "
                                                    f"the mmap threshold: kept {kept_before:.1f}, {kept_after:.1f} MiB")


_FRESH_PROCESS = f"""
import os, sys, tempfile
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import torch, torch.distributed as dist, torch_hca
from test_host_heap import _kept_after_freeing
dist.init_process_group("hca", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0,
                        world_size=1)
dist.all_reduce(torch.ones(4))
print(_kept_after_freeing({FREED_MIB}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("fixed", ["MALLOC_MMAP_THRESHOLD_=33554432", "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432"])
def test_a_threshold_fixed_in_the_environment_keeps_glibc_s_trim_threshold(fixed):
    """A user who fixed only the mmap threshold, to 32 MiB (a 32 MiB block then still comes from the
    heap), keeps glibc's trim threshold of 128 KiB: the freed blocks are returned."""
    name, value = fixed.split("=", 1)
    env = {**os.environ, name: value, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 8, f"with {fixed}, the heap kept {out.stdout.split()[-1]} MiB"
