"""`torch_hca.explain`: the plan of a collective, as data and as text.

    python -m torch_hca.explain 8 --num-packs 2
    python -m torch_hca.explain 4 --nodes a,a,b,b --num-packs 2
    python -m torch_hca.explain 4 --numa-nodes "0;1;0;1" --here
    python -m torch_hca.explain 4 --device cuda --gpus 0,0,0,0 --numels 262144
    python -m torch_hca.explain 8 --device cuda --gpus 0,1,2,3,4,5,6,7 --links nvswitch --numels 16777216
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Sequence, Union

from .. import _C, costs, links as link_model, topology
from ..options import Options, cuda_chunk_bytes, cuda_slots, shm_chunk_bytes, shm_slots


@dataclasses.dataclass
class Plan:
    """packs: one dict per pack (index, dtype, numel, segments, steps, result_ranks);
    each step is a list of (kind, src, dst) edges, kind being "reduce" or "copy".
    roles[rank][pack]: what that rank does for the pack (stages, fused_step, result, last_in, direct)
    and who reads its slot (readers: the ranks its slot's reuse waits for).
    rounds: the pieces (pack, begin, count, byte offset) each round stages in a slot of `slot_bytes`.
    predicted_us: where hca chose per call, the cost model's time for each candidate left open
    (of "one_pack", "pack_per_rank", "reduce_to_one_device", "direct"); chosen: the one the call got;
    cost_model: that model (its lines and where they came from).
    peer_waits: per rank, the waits on peers' progress words its stream issues for one such call once
    the group has used every staging slot, repeating the call on the group's stream (where a wait of
    the call before covers one of this call's; on a GPU that processes share, each a switch between
    them unless the peer is already past it)."""

    packs: List[dict]
    text: str
    roles: List[List[dict]] = dataclasses.field(default_factory=list)
    rounds: List[List[tuple]] = dataclasses.field(default_factory=list)
    hierarchy: Optional[topology.Hierarchy] = None
    predicted_us: Optional[Dict[str, float]] = None
    cost_model: Optional[costs.CostModel] = None
    chosen: Optional[str] = None
    peer_waits: Optional[List[int]] = None

    def leaders(self) -> List[int]:
        """The rank that ends each pack's reduction (the last reduce edge's destination)."""
        out = []
        for pack in self.packs:
            reduces = [dst for step in pack["steps"] for kind, _, dst in step if kind == "reduce"]
            out.append(reduces[-1] if reduces else pack["result_ranks"][0])
        return out

    def __str__(self) -> str:
        return self.text


@dataclasses.dataclass
class NodePlan:
    """An allreduce across nodes. nodes: each node's ranks. packs: one dict per pack (index,
    numel, position, leaders): the pack's node leaders, one per node, reduce it inside their
    node, all-reduce it between nodes, and copy it back inside their node."""

    nodes: List[List[int]]
    packs: List[dict]
    text: str

    def __str__(self) -> str:
        return self.text


def _slot_bytes(device, running, gpus):
    """The slot a group of `device`'s tensors stages in: a running group's once it set up its staging,
    else the one set or, for CUDA, the one for ranks on `gpus` (different GPUs where not given)."""
    staged = running and running["staging_slot_bytes"][device]
    if staged:
        return staged
    return shm_chunk_bytes() if device == "cpu" else _C.cuda_slot_bytes(cuda_chunk_bytes(), gpus)


def explain(
    world_size: Optional[int] = None,
    algorithm: Optional[str] = None,
    num_packs: Optional[int] = None,
    groups: Union[str, Sequence[Sequence[int]], None] = "auto",
    reduce_to_device: Optional[int] = None,
    numels: Sequence[int] = (1024,),
    collective: str = "allreduce",
    root: int = 0,
    agg_small_grads_max_bytes: int = 0,
    agg_small_grads_max_group: int = 10,
    verbose: bool = False,
    slot_bytes: Optional[int] = None,
    nodes: Optional[Sequence] = None,
    inter_node_backend: Optional[str] = None,
    numa_nodes: Optional[Sequence[Sequence[int]]] = None,
    packages: Optional[Sequence[Sequence[int]]] = None,
    cpus: Optional[int] = None,
    group=None,
    device: str = "cpu",
    gpus: Optional[Sequence] = None,
    links: Optional[str] = None,
):
    """The schedule `hca` runs for `collective` over float32 tensors of `numels` elements:
    who reduces or copies which elements into whom, step by step, each rank's role, and the
    rounds that cut the packs to fit a staging slot of `slot_bytes` (default: `device`'s slot, a
    running group's once it staged, else TORCH_HCA_SHM_CHUNK_BYTES or TORCH_HCA_CUDA_CHUNK_BYTES;
    where the latter is unset, 8 MiB, the slot of ranks on different GPUs). For algorithm="nccl", the packing alone. With `nodes` (each
    rank's node, e.g. ["a", "a", "b", "b"]) and more than one node, the allreduce across nodes, as a
    NodePlan. With groups="auto" (the default), the groups the ranks would form if they ran on
    `numa_nodes` (each rank's NUMA nodes, e.g. [[0], [1], [0], [1]]) and `packages` (each rank's
    CPU packages); TF's halves where these are not given. With algorithm and/or num_packs None (the
    defaults), what an allreduce of that size gets per call and the cost model's predicted time for
    each candidate, for ranks that run on `cpus` CPUs between them (default: the CPUs this process
    may run on): the model a group of them would use here (this machine's cached calibration, else the shipped table), or a
    running group's; for CUDA tensors, a running group's (chosen per call once its first
    collective on CUDA tensors found every rank's on one GPU, else one pack), or, without one, that
    of ranks whose tensors are on `gpus` (each rank's GPU, e.g. [0, 0, 0, 0]; where all are one,
    the table of ranks sharing a GPU and its 64 MiB slots; else, or not given, one pack and 8 MiB). With
    `links` (one of topology.LINK_LAYOUTS: "nvswitch", "pcie", "pcie-switches", "dgx1") as well, the
    ranks on `gpus` as if linked so: the groups they would find (groups="auto"), and where each has
    a GPU of its own and all are peers, the link model's choice (links.py: predicted, not measured).
    With `group` (a running hca process group), for its ranks: its size,
    the hierarchy it found for `device`'s tensors (where groups="auto"), and where it stages them
    (for CUDA: GPU memory by CUDA IPC, or host shared memory; set up at its first collective on
    `device`); the options are still the arguments'. Prints it if verbose."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if gpus is not None and (device != "cuda" or group is not None):
        raise ValueError("gpus: for device='cuda' without a running group (a group asks its ranks where their "
                         "tensors are)")
    running = topology.hierarchy(group) if group is not None else None
    found = None  # the running group's hierarchy, where its groups are the plan's
    if running is not None:
        size = group.size()
        if world_size not in (None, size):
            raise ValueError(f"world_size: {world_size}, but the group has {size} ranks")
        world_size = size
        if groups == "auto":
            found = running[device]
            groups = found.groups
    elif world_size is None:
        raise ValueError("explain: give world_size, or a running group")
    if gpus is not None and len(gpus) != world_size:
        raise ValueError(f"gpus: {len(gpus)} GPUs for a world of {world_size} ranks")
    if links is not None and gpus is None:
        raise ValueError("links: name each rank's GPU too (gpus=)")
    gpus = [str(g) for g in gpus or ()]  # as the C++ rule compares them; none given: one GPU per rank
    places = topology.layout_places(gpus, links) if links is not None else None
    options = Options(algorithm, num_packs, reduce_to_device, groups, agg_small_grads_max_bytes,
                      agg_small_grads_max_group, inter_node_backend)
    hierarchy = found or (topology.gpu_hierarchy(places) if places and options.groups == "auto"
                          else _hierarchy(options.groups, world_size, numa_nodes, packages))
    numels = [int(n) for n in numels]
    identities = None if nodes is None else [str(n) for n in nodes]
    if identities is not None and len(identities) != world_size:
        raise ValueError(f"nodes: {len(identities)} node ids for a world of {world_size} ranks")
    if identities is not None and len(set(identities)) > 1 and algorithm != "nccl":
        if collective != "allreduce":
            raise ValueError(f"collective: across nodes, explain shows allreduce only, got {collective!r}")
        members, _ = _C.nodes(identities)
        packs, text = _C.explain_nodes(numels, identities, options.plan_options())
        plan = NodePlan([list(m) for m in members], list(packs), text)
    elif algorithm == "nccl":
        packs, text = _C.packs(numels, options.packing_options())
        plan = Plan(list(packs), text)
    else:
        names = costs.candidates(algorithm, num_packs) if world_size > 1 else ()
        model = _cost_model(running, device, world_size, cpus, hierarchy.groups, gpus, places) if names else None
        by_choice = options.plan_options(hierarchy.groups, costs.plan_choices(model, names) if model else ())
        slot = _slot_bytes(device, running, gpus) if slot_bytes is None else slot_bytes
        packs, text, roles, rounds = _C.plan(collective, world_size, numels, by_choice, root, slot)
        nbytes = 4 * sum(numels)
        predicted = model.predict_us(nbytes, names) if model and collective == "allreduce" else None
        chosen = model.choose(nbytes, names) if predicted else None
        choice = _choice(model, names, predicted, chosen) if predicted else ""
        slots = shm_slots() if device == "cpu" else cuda_slots()
        waits = list(_C.peer_waits_of_call(collective, world_size, numels, by_choice, root, slot, slots))
        if device == "cuda":
            text += (f"waits on peers a call issues, by rank (with {slots} slots; ranks sharing a GPU switch between "
                     f"their processes at each one a peer has not passed yet): {', '.join(map(str, waits))}\n")
        plan = Plan(list(packs), f"{hierarchy}\n{choice}{text}", list(roles), [list(r) for r in rounds], hierarchy,
                    predicted, model, chosen, waits)
    if running is not None:
        where = running["staging"][device] or f"not set up yet (at the group's first collective on {device} tensors)"
        plan.text = f"{plan.text.rstrip()}\nstaging of {device} tensors: {where}\n"
    if verbose:
        print(plan)
    return plan


def _cost_model(running, device, world_size, cpus, groups, gpus, places) -> Optional[costs.CostModel]:
    """A running group's model of `device`'s tensors; else, for CPU tensors, the one a group of
    these ranks would get here, as rank 0 reads it (this machine's cached calibration, else the
    shipped table); for CUDA tensors, the table of ranks sharing one GPU where `gpus` names one,
    the link model where `places` (ranks on a GPU each) form one clique, else None (one pack)."""
    if running is not None and (running["cost_model"][device] or device == "cuda"):
        return running["cost_model"][device]
    if device == "cuda":
        if _C.share_one_device(gpus):
            return costs.sharing_one_gpu(world_size)
        kind = places and topology.clique_kind(places)
        return link_model.clique_cost_model(kind, world_size, _C.cuda_slot_bytes(cuda_chunk_bytes(), gpus)) \
            if kind else None
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return costs.cached_or_shipped(costs.cache_path(world_size, cpus, groups), world_size, cpus)


def _choice(model, names, predicted, chosen) -> str:
    """The lines that say what the call gets (`chosen`) and why, where hca chose it."""
    return (f"chosen per call: {costs.WORDS[chosen]} (set algorithm and num_packs to fix it): "
            f"{model.rule(names)}, by the cost model of {model.origin}\n"
            f"  predicted: " + ", ".join(f"{costs.WORDS[n]} {t:.1f} us" for n, t in predicted.items()) + "\n")


def _hierarchy(groups, world_size, numa_nodes, packages) -> topology.Hierarchy:
    """What groups="auto" gives for the given places; "halves" and given groups as they are."""
    if groups != "auto" or numa_nodes is None:
        if groups == "auto":
            return topology.Hierarchy(_C.default_groups(world_size), "halves", "TF's halves: no places given "
                                      "(numa_nodes=, packages=; a running group: torch_hca.hierarchy())")
        return topology.resolve(groups, size=world_size)[0]
    if len(numa_nodes) != world_size or (packages is not None and len(packages) != world_size):
        raise ValueError(f"numa_nodes/packages: expected one entry per rank of {world_size}")
    places = [topology.Place(tuple(packages[r]) if packages else (), tuple(numa_nodes[r])) for r in range(world_size)]
    return topology.cpu_hierarchy(places)
