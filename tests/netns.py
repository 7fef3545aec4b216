"""Ranks in namespaces of their own, each a separate process running node_worker.py.
Simulated hosts on one machine: each node gets its own network namespace (a veth pair joins
them, each end with its own address) and each of its ranks runs in a UTS namespace named after
the node, so traffic between nodes crosses a (virtual) network and hostnames differ per node.
Needs root and `ip`/`unshare`; `unavailable()` says why not where they are missing.
Each simulated host has a /dev/shm of its own (a tmpfs), as separate hosts do.
Containers on one host: ranks in pid namespaces of their own (`run_in_pid_namespaces`), or with
a /dev/shm and a hostname of their own (`run_in_containers`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def unavailable():
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    probe = f"hcaprobe{os.getpid()}"
    steps = [["ip", "netns", "add", probe],
             ["ip", "netns", "exec", probe, "ip", "link", "add", "hcaprobe0", "type", "veth", "peer", "name", "hcaprobe1"],
             ["ip", "netns", "exec", probe, "unshare", "--uts", "--", "sh", "-c", "hostname hca-probe"]]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                return f"cannot {' '.join(step[:4])}...: {(done.stderr or done.stdout).strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args, netns=None):
    cmd = (["ip", "netns", "exec", netns, "ip"] if netns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def store_port(salt):
    """A port for a case's TCPStore, from `salt`: 20000-31999, below Linux's ephemeral range (32768
    and up), where outgoing connections take their ports. A port there may be held by one, even a
    rank's own connection to the store before it listens, given that very port (TCP's self-connect):
    rank 0's listen on 32784 failed with EADDRINUSE once, and the other ranks timed out."""
    return 20000 + salt % 12000


class TwoHosts:
    """Two network namespaces joined by a veth pair, addresses 10.<n>.0.1 and 10.<n>.0.2."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}"
        self.netns = [f"hca{tag}a", f"hca{tag}b"]
        self.links = [f"hv{tag}a", f"hv{tag}b"]
        subnet = 100 + os.getpid() % 100
        self.addresses = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
        self.hostnames = ["hca-node-a", "hca-node-b"]
        self.shm = NodeShm(2)

    def __enter__(self):
        try:
            self.shm.__enter__()
            for ns in self.netns:
                subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for ns, link, address in zip(self.netns, self.links, self.addresses):
                _ip("link", "set", link, "netns", ns)
                _ip("addr", "add", f"{address}/24", "dev", link, netns=ns)
                _ip("link", "set", link, "up", netns=ns)
                _ip("link", "set", "lo", "up", netns=ns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for ns in self.netns:  # deleting a namespace removes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.shm.__exit__(*exc)

    def run(self, case, node_sizes, args=(), timeout_s=30, deadline_s=240, allow_missing=()):
        """Runs node_cases.<case>(rank, world, *args) on every rank, node i's ranks in namespace i;
        returns each rank's value (None for a rank in `allow_missing` that left none)."""
        placement = [node for node, size in enumerate(node_sizes) for _ in range(size)]
        self.runs = getattr(self, "runs", 0) + 1
        port = store_port(os.getpid() * 7 + self.runs * 101)
        wrappers = [["ip", "netns", "exec", self.netns[node], "unshare", "--uts", "--mount", "--", "sh", "-c",
                     f'{self.shm.mount(node)} && hostname {self.hostnames[node]} && exec "$@"', "sh"]
                    for node in placement]
        envs = [dict(MASTER_ADDR=self.addresses[0], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=self.links[node])
                for node in placement]
        return run_workers(case, wrappers, envs, args, timeout_s, deadline_s, allow_missing)


class NodeShm:
    """A tmpfs per simulated node, for its ranks to mount on /dev/shm in mount namespaces of
    their own: the ranks of one node share it, and no other."""

    def __init__(self, nodes, size="512m"):
        self.dirs = [tempfile.mkdtemp(prefix=f"hca-shm{n}-") for n in range(nodes)]
        self.size = size

    def __enter__(self):
        for d in self.dirs:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", d], check=True,
                           capture_output=True)
        return self

    def __exit__(self, *exc):
        for d in self.dirs:
            subprocess.run(["umount", d], capture_output=True)
            os.rmdir(d)

    def mount(self, node):
        """The shell command that puts node `node`'s tmpfs on /dev/shm."""
        return f"mount --bind {self.dirs[node]} /dev/shm"


def mount_namespaces_unavailable():
    """Why a rank cannot get a /dev/shm of its own here (a mount namespace, a tmpfs), or None."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs"
    if shutil.which("unshare") is None:
        return "needs the `unshare` command"
    done = subprocess.run(["unshare", "--mount", "--uts", "--", "sh", "-c",
                           "mount -t tmpfs tmpfs /dev/shm && hostname hca-probe && test -z \"$(ls /dev/shm)\""],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"cannot mount a tmpfs on /dev/shm: {(done.stderr or done.stdout).strip()}"


def run_in_containers(case, shm, hostnames, args=(), env=None, timeout_s=30, deadline_s=240, shm_size="512m",
                      env_per_rank=None):
    """Runs node_cases.<case> on len(shm) ranks of this host, as containers would: rank r sees
    the host's /dev/shm where shm[r] is None, else the tmpfs (of `shm_size`) of simulated node
    shm[r] (ranks with one value share it), and has the hostname hostnames[r] (None: the host's);
    `env_per_rank` adds variables rank by rank."""
    port = store_port(os.getpid() * 17)
    with NodeShm(max((n for n in shm if n is not None), default=-1) + 1, shm_size) as nodes:
        wrappers = []
        for node, hostname in zip(shm, hostnames):
            steps = ([nodes.mount(node)] if node is not None else []) + ([f"hostname {hostname}"] if hostname else [])
            wrappers.append(["unshare", "--mount", "--uts", "--", "sh", "-c", " && ".join(steps + ['exec "$@"']), "sh"])
        envs = [dict(env or {}, **(env_per_rank[r] if env_per_rank else {}), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)) for r in range(len(shm))]
        return run_workers(case, wrappers, envs, args, timeout_s, deadline_s)


def pid_namespaces_unavailable():
    """Why a rank cannot be put in a pid namespace of its own here, or None."""
    if shutil.which("unshare") is None:
        return "needs the `unshare` command"
    done = subprocess.run(["unshare", "--pid", "--fork", "--", "sh", "-c", "test $$ = 1"], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else f"cannot unshare --pid: {(done.stderr or done.stdout).strip()}"


def run_in_pid_namespaces(case, world, isolated, args=(), env=None, timeout_s=30, deadline_s=240, allow_missing=()):
    """Runs node_cases.<case> on `world` ranks of this host; each rank in `isolated` in a pid
    namespace of its own (as in a container sharing /dev/shm and the hostname: --ipc=host),
    as pid 2 there (the namespace's init, pid 1, ignores the signals it sends itself)."""
    port = store_port(os.getpid() * 13)
    wrappers = [["unshare", "--pid", "--fork", "--", "sh", "-c", '"$@"; exit $?', "sh"] if rank in isolated else []
                for rank in range(world)]
    envs = [dict(env or {}, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for _ in range(world)]
    return run_workers(case, wrappers, envs, args, timeout_s, deadline_s, allow_missing)


def run_workers(case, wrappers, envs, args=(), timeout_s=30, deadline_s=240, allow_missing=()):
    """Runs node_worker.py <case> as rank r of len(wrappers) under the command prefix wrappers[r]
    with the variables envs[r]; returns each rank's value (None for a rank in `allow_missing`
    that left none), or raises AssertionError with the failed ranks' tracebacks and logs."""
    world = len(wrappers)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank, (wrapper, extra) in enumerate(zip(wrappers, envs)):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join([ROOT, HERE]))
            env.pop("TORCH_HCA_NODE_ID", None)
            env.update(extra)
            out = os.path.join(tmp, f"rank{rank}.json")
            worker = [sys.executable, "-W", "ignore", os.path.join(HERE, "node_worker.py"), case, out,
                      json.dumps(list(args)), str(timeout_s)]
            procs.append(subprocess.Popen(wrapper + worker, env=env, cwd=HERE, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        end = time.monotonic() + deadline_s
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                logs.append(p.communicate()[0] + "\n(killed at the deadline)")
        values, errors = [], []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                values.append(None)
                if rank not in allow_missing:
                    errors.append(f"rank {rank}: no result\n{logs[rank][-3000:]}")
                continue
            with open(path) as f:
                status, value = json.load(f)
            values.append(value)
            if status != "ok":
                errors.append(f"rank {rank}:\n{value}")
    if errors:
        raise AssertionError("\n".join(errors))
    return values
