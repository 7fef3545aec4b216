"""Which ranks share a node: one kernel and one /dev/shm, whatever their hostnames say.

Containers of one host started with --ipc=host (or sharing an IPC namespace) see the same
/dev/shm under different hostnames; containers with an IPC namespace each may share a hostname
but not /dev/shm. A rank's automatic node identity is therefore the kernel's boot id with the
device of the filesystem on /dev/shm (each tmpfs mount has a device of its own), and the ranks
that announce one identity prove it at init: each finds the others' probe files in /dev/shm.
(The identity is the C++ transport's, _C.shared_memory_identity: segments check it too.)"""
from __future__ import annotations

import json
import os
import time
import uuid

from . import _C

SHM_DIR = "/dev/shm"  # where shm_open creates segments (glibc)


def node_identity(environ=None) -> str:
    """What names this rank's node: TORCH_HCA_NODE_ID where set, else the automatic identity.
    Ranks with equal identities share memory and devices."""
    environ = os.environ if environ is None else environ
    return environ.get("TORCH_HCA_NODE_ID", "").strip() or _C.shared_memory_identity()


def network_identity() -> str:
    """Equal for ranks that reach each other over loopback: one kernel, one network namespace
    (unknown where it cannot be read: then equal to no other)."""
    try:
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:
        namespace = f"unknown ({uuid.uuid4().hex})"
    return f"{_C.shared_memory_identity().split(',')[0]}, {namespace}"


def exchange_identities(store, rank, size, timeout_ms):
    """Every rank's (node identity, network identity), once the ranks of each node have shown
    that they see one /dev/shm; raises ValueError on every rank where some do not (instead of
    a wait for segments that never appear)."""
    probe = os.path.join(SHM_DIR, f"torch_hca-probe-{uuid.uuid4().hex}")
    made = _make_probe(probe)
    try:
        mine = json.dumps([node_identity(), network_identity(), os.path.basename(probe) if made else None])
        reports = [json.loads(r) for r in _C.exchange_reports(store, "node_identity", rank, size, mine, timeout_ms)]
        unseen = [r for r, (node, _, name) in enumerate(reports)
                  if r != rank and node == reports[rank][0] and not (name and os.path.exists(os.path.join(SHM_DIR, name)))]
        verdicts = [json.loads(v) for v in _C.exchange_reports(store, "shm_probe", rank, size, json.dumps(unseen),
                                                                  timeout_ms)]
    finally:
        if made:
            os.unlink(probe)
    blind = {r: others for r, others in enumerate(verdicts) if others}
    if blind:
        _leave_the_store_last(store, rank, size, timeout_ms)
        r, others = next(iter(blind.items()))
        raise ValueError(
            f"hca: ranks announce one node ({reports[r][0]!r}) but do not share /dev/shm: rank {r} cannot see the "
            f"files of rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} there"
            + (f" (and {len(blind) - 1} more ranks are as blind)" if len(blind) > 1 else "")
            + ". Containers of one host need --ipc=host (or one shared IPC namespace) to share memory; else "
            "give them different TORCH_HCA_NODE_ID values (or leave it unset), and gloo carries the traffic between "
            "them")
    return [node for node, _, _ in reports], [network for _, network, _ in reports]


def _leave_the_store_last(store, rank, size, timeout_ms):
    """Before every rank raises: rank 0, which hosts torch's TCP store (the default group's, and
    any group's it belongs to), waits until the others have read the verdicts, so that none of
    them loses the store while reading and reports a reset connection instead of the cause."""
    read = store.add("hca_shm_probe/read", 1)
    deadline = time.monotonic() + timeout_ms / 1000
    while rank == 0 and read < size and time.monotonic() < deadline:
        time.sleep(0.005)
        read = store.add("hca_shm_probe/read", 0)


def _make_probe(path) -> bool:
    """An empty file in /dev/shm that the ranks of this node must see; False where none can be
    made (no /dev/shm): then no rank sees it, which the verdict reports."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
        return True
    except OSError:
        return False
