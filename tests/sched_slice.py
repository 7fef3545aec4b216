"""A thread's scheduler slice (Linux's EEVDF, 6.12 and later), read and set through the
sched_getattr / sched_setattr system calls, which Python's os module lacks."""
from __future__ import annotations

import ctypes
import os
import platform
import threading

_libc = ctypes.CDLL(None, use_errno=True)
_SYSCALLS = {"x86_64": (315, 314), "aarch64": (275, 274)}  # (getattr, setattr)


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


def _syscall(which, *args):
    """sched_getattr (which=0) or sched_setattr (1); OSError where it fails."""
    if _libc.syscall(_SYSCALLS[platform.machine()][which], *args) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _attr(tid):
    attr = _SchedAttr()
    _syscall(0, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    return attr


def slice_ns(tid=0):
    """The slice of thread `tid` (0: the calling thread), ns."""
    return _attr(tid).sched_runtime


def set_slice_ns(ns, tid=0):
    """Asks for a slice of `ns` (0: the kernel's default) on thread `tid`, policy and nice kept."""
    attr = _attr(tid)
    attr.size, attr.sched_flags, attr.sched_runtime = ctypes.sizeof(attr), 0, ns
    _syscall(1, tid, ctypes.byref(attr), 0)


def custom_slices_supported():
    """Whether this kernel keeps a slice a thread asks for (tried on a thread of its own)."""
    if platform.machine() not in _SYSCALLS:
        return False
    kept = []

    def attempt():
        try:
            set_slice_ns(300_000)
            kept.append(slice_ns() == 300_000)
        except OSError:
            kept.append(False)
    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return kept[0]
