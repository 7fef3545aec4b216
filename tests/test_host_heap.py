"""The process's C heap under hca: buffers of up to 32 MiB come from the heap once a group exists, as beside gloo.

glibc gives blocks above its mmap threshold fresh mappings (faulted in page by page, returned at
free); freeing a large mapped block raises the threshold (gloo's own buffers do). hca frees nothing
large, so its group raises it once at init. Where a block came from is read from glibc's own
count of mapped bytes (mallinfo2's hblkhd) while the block is alive.
"""
import ctypes
import functools
import os

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


def _mapped_apart(mib):
    """Whether a fresh tensor of `mib` MiB got a mapping of its own rather than heap memory."""
    libc = _libc()
    before = libc.mallinfo2().hblkhd
    block = torch.empty(mib << 18)
    grown = libc.mallinfo2().hblkhd - before
    del block
    return grown >= mib << 20


def _before_init(user_fixed_threshold, _rank):
    if user_fixed_threshold:  # as MALLOC_MMAP_THRESHOLD_ would, which glibc reads at start
        assert _libc().mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
    # Freed, this 20 MiB block raises glibc's threshold to 20 MiB, so 28 MiB stays mapped unless hca raises it further.
    os.environ["HCA_TEST_MAPPED_BEFORE_INIT"] = str(int(_mapped_apart(20)))


def _mapped_before_and_after(rank, world):
    dist.all_reduce(torch.ones(1 << 16))
    return os.environ["HCA_TEST_MAPPED_BEFORE_INIT"] == "1", _mapped_apart(28), _mapped_apart(20)


@pytest.mark.parametrize("world", [1, 3])
def test_buffers_up_to_32_mib_come_from_the_heap_once_a_group_exists(world):
    for before, after, _ in run_ranks(_mapped_before_and_after, world, before_init=functools.partial(_before_init, False)):
        assert before, "a 20 MiB tensor should get a mapping of its own in a fresh process"
        assert not after, "after init, a 28 MiB tensor should come from the heap"


def test_a_threshold_the_user_fixed_is_kept():
    for before, after, smaller_after in run_ranks(_mapped_before_and_after, 2,
                                                  before_init=functools.partial(_before_init, True)):
        assert before and after and smaller_after, "glibc keeps a threshold the user fixed: every tensor mapped"
