"""Registers the c10d backend "hca" for CPU and CUDA devices."""
import dataclasses
import ipaddress
import json
import os
import socket

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from . import _C, costs, links, topology
from .node import exchange_identities, node_identity  # noqa: F401  (node_identity: torch_hca's API)
from .options import Options, cpu_executor, cuda_chunk_bytes, cuda_slots, cuda_staging, shm_chunk_bytes, shm_slots
from .settings import warn_unknown_variables

BACKEND_NAME = "hca"


def create_backend(dist_backend_opts, backend_options):
    """torch's creator hook (extended API): one backend per process group. `nccl` is a wrapper
    around stock engines (which span nodes themselves); the other algorithms run hca's own
    executors inside each node and, when the ranks span nodes, engines between them."""
    warn_unknown_variables()
    backend = _create(dist_backend_opts, backend_options)
    # Where the group's ranks are in the world, for the metadata profiler traces carry.
    backend._global_ranks = list(dist_backend_opts.global_ranks_in_group)
    return backend


def _create(dist_backend_opts, backend_options):
    options = Options.from_env() if backend_options is None else backend_options
    if not isinstance(options, Options):
        raise TypeError(f"hca: pg_options must be torch_hca.Options, got {type(options).__name__}")
    if dist_backend_opts.timeout.total_seconds() < 0:
        raise ValueError(f"hca: the group's timeout is negative ({dist_backend_opts.timeout.total_seconds()} s); give "
                         "zero or more")
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    store = incarnation_store(dist_backend_opts.store, rank)
    timeout_ms = int(dist_backend_opts.timeout.total_seconds() * 1000)
    check_same_options(store, rank, size, options, timeout_ms)
    identities, networks = exchange_identities(store, rank, size, timeout_ms)
    if options.algorithm == "nccl":
        cpu_engine, cuda_engine = _engines(dist_backend_opts, store)
        # Ranks of one node agree on their CPU calls through its shared memory, the others through gloo.
        return _C.PassthroughBackend(rank=rank, size=size, timeout_ms=timeout_ms, packing=options.packing_options(),
                                     cpu_engine=cpu_engine, cuda_engine=cuda_engine,
                                     one_node_store=store if len(set(identities)) == 1 else None)
    if len(set(identities)) == 1:
        return _node_group(store, rank, size, timeout_ms, options)
    try:
        return _across_nodes(dist_backend_opts, store, options, identities, networks, timeout_ms)
    except Exception as e:
        _C.publish_setup_failure(store, rank, f"{type(e).__name__}: {e}")
        raise


def process_settings():
    """The TORCH_HCA_* variables each process reads for itself, beside the options, that the ranks
    must share: the executor of CPU tensors (ranks with different ones each wait for the others'
    staging until the timeout, then blame a live peer) and the first-use self-test (its collectives,
    run on some ranks only, meet the user's first call on the others)."""
    return {"TORCH_HCA_CPU_EXECUTOR": cpu_executor(),
            "TORCH_HCA_SELF_TEST": "1" if _C.ProcessGroupHCA.self_test_wanted() else "0"}


def check_same_options(store, rank, size, options, timeout_ms):
    """Every option decides who sends what to whom (packs, aggregation, the reducing rank, the
    groups): ranks that disagree would sum the wrong pieces, or fail later with a misleading
    error. So do the process settings. ValueError on every rank, naming each option or variable
    that differs and the ranks' values."""
    mine = {**dataclasses.asdict(options), **process_settings()}
    reports = [json.loads(r) for r in _C.exchange_reports(store, "options", rank, size,
                                                          json.dumps(mine, sort_keys=True), timeout_ms)]
    differences = []
    for name in mine:
        by_value = {}
        for r, report in enumerate(reports):
            value = report[name]
            by_value.setdefault("unset" if value is None else json.dumps(value), []).append(r)
        if len(by_value) > 1:
            held = "; ".join(f"{value} on {'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
                             for value, ranks in by_value.items())
            differences.append(f"{name} is {held}")
    if differences:
        raise ValueError("hca: the options must be the same on every rank (pg_options or TORCH_HCA_* variables): "
                         + "; and ".join(differences))


def incarnation_store(store, rank):
    """The group's keys under a prefix of their own for each time the group is created on this
    store (init, destroy, init again on one TCPStore, as tests and elastic restarts do): the
    previous incarnation's keys name segments that no longer exist. Every rank counts its own
    creations, so the ranks agree without reading a shared counter someone else may bump."""
    incarnation = store.add(f"hca_incarnation/{rank}", 1)
    return dist.PrefixStore(f"hca/{incarnation}/", store)


def _node_group(store, rank, size, timeout_ms, options):
    """hca's own group over the ranks of one node, its hierarchy from where they run (groups="auto")."""
    cpu, cuda, places = topology.resolve(options.groups, store, rank, size, timeout_ms)
    cpus_of_ranks = [json.loads(c) for c in _C.exchange_reports(store, "cpus", rank, size,
                                                                   json.dumps(sorted(os.sched_getaffinity(0))),
                                                                   timeout_ms)]
    cpus = len(set().union(*cpus_of_ranks))

    def make(store, options, cpu_tables=None, cuda_tables=None, cuda_per_rank=None):
        return _C.ProcessGroupHCA(store=store, rank=rank, size=size, timeout_ms=timeout_ms,
                                  options=options.plan_options(cpu.groups), cuda_groups=cuda.groups,
                                  cpu_tables=cpu_tables or {}, cpus_of_ranks=cpus_of_ranks,
                                  cuda_tables_sharing_one_gpu=cuda_tables or {},
                                  cuda_tables_gpu_per_rank=cuda_per_rank or {},
                                  shm_slot_bytes=shm_chunk_bytes(), shm_slots=shm_slots(),
                                  cuda_slot_bytes=cuda_chunk_bytes(), cuda_slots=cuda_slots(),
                                  cuda_host_staging=cuda_staging() == "host", cpu_executor=cpu_executor())

    names = costs.candidates(options.algorithm, options.num_packs)
    cpu_tables, cuda_tables, cuda_per_rank = {}, {}, {}
    if names:
        model = costs.for_group(
            rank, size, cpus, cpu.groups,
            lambda topic, mine: _C.exchange_reports(store, topic, rank, size, mine, timeout_ms),
            lambda algorithm, num_packs: make(dist.PrefixStore(f"hca_calibrate_{algorithm}{num_packs}/", store),
                                              dataclasses.replace(options, algorithm=algorithm, num_packs=num_packs)),
            costs.counting_barrier(store.add, size, timeout_ms / 1000))
        # By world size (and, for CPU tensors, whether the ranks have fewer CPUs than ranks), for this
        # group and any child split off, each taking its own. CUDA tensors' at the group's first CUDA
        # collective, where it finds all ranks' on one GPU.
        if model:
            cpu_tables = {key: (costs.plan_choices(m, names), json.dumps(m.to_json()))
                          for key, m in costs.by_world(model, size, cpus).items()}
        cuda_tables = {world: _table(costs.sharing_one_gpu(world), names) for world in range(2, size + 1)}
        # Where each rank has a GPU of its own and all are peers, the link model's, for this group and
        # any child (a child of a clique is a clique of the same links).
        kind = places and topology.clique_kind(places)
        if kind:
            slot_bytes = _C.cuda_slot_bytes(cuda_chunk_bytes(), [str(r) for r in range(size)])
            cuda_per_rank = {world: _table(links.clique_cost_model(kind, world, slot_bytes), names)
                             for world in range(2, size + 1)}
    group = make(store, options, cpu_tables, cuda_tables, cuda_per_rank)
    group.hierarchy = topology.describe(cpu, cuda, places)
    return group


def _table(model, names):
    """A choice table as the C++ group takes it: the model's choice over `names`, and the model."""
    return costs.plan_choices(model, names), json.dumps(model.to_json())


def _across_nodes(dist_backend_opts, store, options, identities, networks, timeout_ms):
    """hca inside this rank's node; among the node leaders of each leader position (one group
    per position: every local rank of the largest node leads one), gloo for CPU tensors and
    the `inter_node_backend` engine for CUDA tensors; over every rank, the stock engines for the
    operations that have no hierarchical form."""
    cuda_engine = _inter_node_cuda_engine(options.inter_node_backend)
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    members, leaders = _C.nodes(identities)
    node = next(n for n, ranks in enumerate(members) if rank in ranks)
    plan_options = options.plan_options()
    plan_options.validate_across_nodes(identities)
    check_gloo_can_leave_this_host(networks)
    # One call per pack: the node's group need not split it again. Its groups: auto or halves
    # (validate_across_nodes refused groups given across nodes).
    inside = Options(options.algorithm, num_packs=1, groups=options.groups)
    local = _node_group(dist.PrefixStore(f"hca_node{node}/", store), members[node].index(rank), len(members[node]),
                        timeout_ms, inside)
    leader_cpu, leader_cuda = {}, {}
    for position, ranks in enumerate(leaders):
        if rank in ranks:
            position_store = dist.PrefixStore(f"hca_leaders{position}/", store)
            leader_rank, timeout = ranks.index(rank), dist_backend_opts.timeout
            leader_cpu[position] = _gloo(position_store, leader_rank, len(ranks), timeout)
            if cuda_engine == "nccl":
                leader_cuda[position] = _nccl(position_store, leader_rank, len(ranks), timeout)
    world_cpu, world_cuda = _engines(dist_backend_opts, store)
    return _C.NodeBackend(rank=rank, size=size, timeout_ms=timeout_ms, options=plan_options,
                          node_identities=identities, local=local, leader_cpu=leader_cpu, leader_cuda=leader_cuda,
                          world_cpu=world_cpu, world_cuda=world_cuda)


def check_gloo_can_leave_this_host(networks, environ=None, hostname=None, resolve=None):
    """gloo finds its address by resolving the hostname; where that gives only loopback (or
    nothing), the ranks of other hosts fail after a long wait with "Connection refused,
    remote=[127.0.0.1]". Raises ValueError at once instead, naming the host and the fix.
    networks: each rank's network identity (node.network_identity); where all are one (one
    kernel, one network namespace: nodes told apart by their /dev/shm or TORCH_HCA_NODE_ID),
    loopback reaches every rank and is right."""
    environ = os.environ if environ is None else environ
    if environ.get("GLOO_SOCKET_IFNAME") or len(set(networks)) < 2:
        return
    hostname = hostname or socket.gethostname()
    resolve = resolve or (lambda name: [info[4][0] for info in socket.getaddrinfo(name, None)])
    try:
        addresses = set(resolve(hostname))
    except OSError:
        addresses = set()
    if not addresses or all(_is_loopback(a) for a in addresses):
        found = ", ".join(sorted(addresses)) or "nothing"
        raise ValueError(f"hca: the ranks span hosts, but this host's name '{hostname}' resolves to {found}: "
                         "gloo, which carries the traffic between hosts, would listen on loopback only and the "
                         "other hosts could not connect. Set GLOO_SOCKET_IFNAME to the interface that reaches "
                         "them (e.g. GLOO_SOCKET_IFNAME=eth0), or make the hostname resolve to a routable "
                         "address (/etc/hosts or DNS)")


def _is_loopback(address):
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _inter_node_cuda_engine(named):
    """The engine among node leaders for CUDA tensors: "nccl" (ProcessGroupNCCL) or "gloo" (its
    CPU engine, through host copies); None picks NCCL where this torch and machine have it."""
    nccl_usable = _C.has_cuda and torch.cuda.is_available() and dist.is_nccl_available()
    if named == "nccl" and not nccl_usable:
        raise ValueError("inter_node_backend: 'nccl' needs torch_hca built with CUDA, a GPU and torch with NCCL "
                         f"(here: hca CUDA build {_C.has_cuda}, GPU {torch.cuda.is_available()}, "
                         f"NCCL {dist.is_nccl_available()}); use 'gloo' or None")
    return named or ("nccl" if nccl_usable else "gloo")


def _gloo(store, rank, size, timeout):
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)


def _nccl(store, rank, size, timeout):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)


def _engines(dist_backend_opts, store):
    """The stock engines over every rank, on the group's store (`store`), rank, world and timeout:
    gloo for CPU tensors, ProcessGroupNCCL for CUDA tensors where torch has it and a GPU is present."""
    store = dist.PrefixStore("engine/", store)
    rank, size, timeout = dist_backend_opts.group_rank, dist_backend_opts.group_size, dist_backend_opts.timeout
    cuda = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        cuda = _nccl(store, rank, size, timeout)
    return _gloo(store, rank, size, timeout), cuda


class SplitOptions(C10dBackend.Options):
    """A group's `options`, as `dist.split_group` reads them (and through it a DeviceMesh of
    several dimensions where an accelerator is present and the group has a device, `device_id`):
    torch's backend options (name, timeout) deep-copied for the children, which torch's own type
    cannot be. hca's own options (algorithm, packing, hierarchy) go to the children in the split."""

    def __deepcopy__(self, memo):
        copied = SplitOptions(self.backend, self._timeout)
        copied.group_name = self.group_name
        copied.global_ranks_in_group = list(self.global_ranks_in_group)
        return copied


def _split_options(backend):
    theirs = backend._backend_options()
    return SplitOptions(theirs.backend, theirs._timeout)


def _no_part_in_a_split(backend, device):
    """torch's new_group asks this of the ranks left out of a new group when the world group has a
    device (`device_id`), as NCCL's communicator split needs every rank of the parent. An hca group
    meets through the store among its own ranks: the others have nothing to do."""


def register():
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
    # What torch's Python asks of a backend that supports splitting (ProcessGroupNCCL's API).
    _C.ProcessGroupHCA.options = property(_split_options)
    _C.ProcessGroupHCA.perform_nocolor_split = _no_part_in_a_split
