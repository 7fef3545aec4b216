"""Seeded random sequences of collectives, every result against its float64 reference.

The matrix tests check one collective, option and dtype at a time. Here the calls of a sequence
(every collective, coalesced ones, PREMUL_SUM, the list forms, gather, scatter, point-to-point
rings) interleave on three groups at once, each with random options (algorithm, the nccl
pass-through on CPU tensors among them, packing, small-tensor aggregation, the reducing rank, the
hierarchy's groups), in random dtypes, ops, sizes and layouts (views at an offset, strided views,
inputs and outputs), and half of them async: waited at once, later in a shuffled order, or left
pending while later calls run. Every rank draws the same sequence from the seed.

HCA_TEST_SEEDS=N runs N seeds of each test instead of a few (a search for rare failures, e.g. 500).
"""
import functools
import random

import pytest
import torch
import torch.distributed as dist

import torch_hca
from harness import SMALL_CHUNKS, STREAMS_ENV, run_ranks, seeds
from reference import (DTYPES, OPS, all_gather_single, make_input, mismatch, rank_device,
                       reduce_reference, reduce_scatter_single, supported)
from test_model_device import one_visible_device, own_devices

SIZES = [1, 3, 17, 1000, 16385, 70_001, 200_003]
CALLS = 40


def _random_options(rnd, world, across_nodes=False, nccl=False):
    """Options for one group; across nodes, those a group across nodes takes (no `direct`, which
    reads every peer's memory, and no explicit groups). With `nccl`, the pass-through too (stock
    engines: gloo for CPU tensors)."""
    algorithm = rnd.choice([None, "hierarchical_copy", "reduce_to_one_device"] + ([] if across_nodes else ["direct"])
                           + (["nccl"] if nccl else []))
    options = {"algorithm": algorithm}
    if algorithm == "nccl" and rnd.random() < 0.5:
        options["num_packs"] = rnd.choice([0, 1, 2, 3])
    if algorithm in (None, "hierarchical_copy"):
        if rnd.random() < 0.6:
            options["num_packs"] = rnd.choice([0, 1, 2, 3, 7])
            if options["num_packs"] == 0 and rnd.random() < 0.5:
                options["agg_small_grads_max_bytes"] = rnd.choice([64, 4096, 100_000])
                options["agg_small_grads_max_group"] = rnd.choice([1, 2, 5])
        if world > 1 and not across_nodes and rnd.random() < 0.3:
            ranks = rnd.sample(range(world), world)
            cut = rnd.randrange(1, world)
            options["groups"] = [sorted(ranks[:cut]), sorted(ranks[cut:])]
    if algorithm == "reduce_to_one_device" and rnd.random() < 0.5:
        options["reduce_to_device"] = rnd.randrange(world)
    return options


def _laid_out(rnd, t):
    """`t`'s values in a tensor of a random layout: its own, a view at an offset, a strided view."""
    layout = rnd.choice(["own", "offset", "strided"])
    if layout == "own":
        return t.clone(), layout
    base = torch.zeros(2 * t.numel() + 10, dtype=t.dtype, device=t.device)
    view = base[5:5 + t.numel()] if layout == "offset" else base[::2][:t.numel()]
    view.copy_(t)
    return view, layout


def _all_reduce(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    inputs = [make_input(case, r, numel, dtype, op) for r in range(world)]
    t, layout = _laid_out(rnd, inputs[rank].to(dev))
    work = dist.all_reduce(t, op=OPS[op], group=group, async_op=async_op)
    return [(work, layout, t, reduce_reference(inputs, op), world)]


def _coalesced(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    """Several tensors in one call: one dtype through all_reduce_coalesced, or mixed dtypes
    through the coalescing manager (as DDP and FSDP batch theirs)."""
    count = rnd.randint(1, 5)
    mixed = rnd.random() < 0.5
    dtypes = [rnd.choice([d for d in DTYPES if supported(d, op)]) if mixed else dtype for _ in range(count)]
    sizes = [rnd.choice([1, 5, 300, 20_000]) for _ in range(count)]
    inputs = [[make_input(case * 10 + j, r, sizes[j], dtypes[j], op) for r in range(world)] for j in range(count)]
    tensors = [per_rank[rank].to(dev, copy=True) for per_rank in inputs]
    if mixed:
        with dist._coalescing_manager(group=group, async_ops=True) as manager:
            for t in tensors:
                dist.all_reduce(t, op=OPS[op], group=group)
        work = manager
    else:
        work = dist.all_reduce_coalesced(tensors, op=OPS[op], group=group, async_op=True)
    return [(work if j == 0 else None, f"tensor {j} of {count} {dtypes[j]}", t, reduce_reference(per_rank, op), world)
            for j, (t, per_rank) in enumerate(zip(tensors, inputs))]


def _broadcast(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    src = rnd.randrange(world)
    inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
    t, layout = _laid_out(rnd, inputs[rank].to(dev))
    work = dist.broadcast(t, src=dist.get_global_rank(group, src), group=group, async_op=async_op)
    return [(work, f"src={src} {layout}", t, inputs[src], 1)]


def _reduce(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    dst = rnd.randrange(world)
    inputs = [make_input(case, r, numel, dtype, op) for r in range(world)]
    t = inputs[rank].to(dev, copy=True)
    work = dist.reduce(t, dst=dist.get_global_rank(group, dst), op=OPS[op], group=group, async_op=async_op)
    if rank == dst:
        return [(work, f"dst={dst}", t, reduce_reference(inputs, op), world)]
    return [(work, f"dst={dst}, kept by a non-root", t, inputs[rank], 1)]


def _all_gather(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    n = max(1, numel // world)
    inputs = [make_input(case, r, n, dtype, "SUM") for r in range(world)]
    out, out_layout = _laid_out(rnd, torch.zeros(n * world, dtype=dtype, device=dev))
    given, layout = _laid_out(rnd, inputs[rank].to(dev))
    work = all_gather_single(out, given, group=group, async_op=async_op)
    return [(work, f"{layout} into {out_layout}", out, torch.cat(inputs), 1)]


def _reduce_scatter(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    n = max(1, numel // world)
    inputs = [make_input(case, r, n * world, dtype, op) for r in range(world)]
    out, out_layout = _laid_out(rnd, torch.zeros(n, dtype=dtype, device=dev))
    given, layout = _laid_out(rnd, inputs[rank].to(dev))
    work = reduce_scatter_single(out, given, op=OPS[op], group=group, async_op=async_op)
    return [(work, f"op={op} {layout} into {out_layout}", out, reduce_reference(inputs, op)[rank * n:(rank + 1) * n],
             world)]


def _all_to_all(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    sends = [[rnd.randint(0, 40) for _ in range(world)] for _ in range(world)]  # sends[i][j]: i to j
    inputs = [make_input(case, r, sum(sends[r]), dtype, "SUM") for r in range(world)]
    received = [sends[r][rank] for r in range(world)]
    out, out_layout = _laid_out(rnd, torch.zeros(sum(received), dtype=dtype, device=dev))
    given, layout = _laid_out(rnd, inputs[rank].to(dev))
    work = dist.all_to_all_single(out, given, output_split_sizes=received,
                                  input_split_sizes=sends[rank], group=group, async_op=async_op)
    want = torch.cat([inputs[r][sum(sends[r][:rank]):sum(sends[r][:rank + 1])] for r in range(world)])
    return [(work, f"{layout} into {out_layout}", out, want, 1)]


def _coalesced_gathers(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    """all_gather_into_tensor or reduce_scatter_tensor, several in one coalescing window, as FSDP2
    batches its own."""
    count = rnd.randint(1, 4)
    parts = [max(1, rnd.choice([1, 5, 300, 20_000]) // world) for _ in range(count)]
    if rnd.random() < 0.5:
        inputs = [[make_input(case * 10 + j, r, n, dtype, "SUM") for r in range(world)] for j, n in enumerate(parts)]
        outs = [torch.zeros(n * world, dtype=dtype, device=dev) for n in parts]
        with dist._coalescing_manager(group=group, async_ops=True) as manager:
            for out, per_rank in zip(outs, inputs):
                all_gather_single(out, per_rank[rank].to(dev), group=group)
        return [(manager if j == 0 else None, f"all_gather {j} of {count}", out, torch.cat(per_rank), 1)
                for j, (out, per_rank) in enumerate(zip(outs, inputs))]
    inputs = [[make_input(case * 10 + j, r, n * world, dtype, op) for r in range(world)] for j, n in enumerate(parts)]
    outs = [torch.zeros(n, dtype=dtype, device=dev) for n in parts]
    with dist._coalescing_manager(group=group, async_ops=True) as manager:
        for out, per_rank in zip(outs, inputs):
            reduce_scatter_single(out, per_rank[rank].to(dev), op=OPS[op], group=group)
    return [(manager if j == 0 else None, f"reduce_scatter {j} of {count} op={op}", out,
             reduce_reference(per_rank, op)[rank * n:(rank + 1) * n], world)
            for j, (out, per_rank, n) in enumerate(zip(outs, inputs, parts))]


def _premul_sum(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    """FSDP2's gradient divide with NCCL: each input times a factor, then summed (floating dtypes),
    by all_reduce or into one rank by reduce."""
    dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    factor = rnd.choice([0.5, 0.25, 1.0 / world])
    inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
    t = inputs[rank].to(dev, copy=True)
    premul = dist._make_nccl_premul_sum(factor)
    want = reduce_reference([x * factor for x in inputs], "SUM")
    if rnd.random() < 0.5:
        work = dist.all_reduce(t, op=premul, group=group, async_op=async_op)
        return [(work, f"factor={factor} {dtype}", t, want, world)]
    dst = rnd.randrange(world)
    work = dist.reduce(t, dst=dist.get_global_rank(group, dst), op=premul, group=group, async_op=async_op)
    return [(work, f"reduce to {dst}, factor={factor} {dtype}", t, want if rank == dst else inputs[rank], world)]


def _list_forms(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    """all_gather into a list of tensors, or reduce_scatter from one; half of them with a slot of
    its own size per rank, as NCCL takes them."""
    n = max(1, numel // world)
    sizes = [n + r for r in range(world)] if rnd.random() < 0.5 else [n] * world
    if rnd.random() < 0.5:
        inputs = [make_input(case, r, sizes[r], dtype, "SUM") for r in range(world)]
        outs = [torch.empty(size, dtype=dtype, device=dev) for size in sizes]
        work = dist.all_gather(outs, inputs[rank].to(dev), group=group, async_op=async_op)
        return [(work if r == 0 else None, f"all_gather list {sizes} [{r}]", out, inputs[r], 1)
                for r, out in enumerate(outs)]
    inputs = [[make_input(case * 10 + j, r, sizes[j], dtype, op) for j in range(world)] for r in range(world)]
    out = torch.empty(sizes[rank], dtype=dtype, device=dev)
    work = dist.reduce_scatter(out, [t.to(dev) for t in inputs[rank]], op=OPS[op], group=group, async_op=async_op)
    return [(work, f"reduce_scatter list op={op}", out, reduce_reference([inputs[r][rank] for r in range(world)], op),
             world)]


def _gather_or_scatter(rnd, rank, world, dev, group, case, dtype, op, numel, async_op):
    root = rnd.randrange(world)
    global_root = dist.get_global_rank(group, root)
    if rnd.random() < 0.5:
        inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
        given, layout = _laid_out(rnd, inputs[rank].to(dev))
        # Drawn on every rank alike (the sequence stays the same), used on the root.
        outs = [_laid_out(rnd, torch.zeros(numel, dtype=dtype, device=dev)) for _ in range(world)]
        work = dist.gather(given, [o for o, _ in outs] if rank == root else None, dst=global_root, group=group,
                           async_op=async_op)
        if rank != root:
            return [(work, f"gather to {root}, a sender", None, None, 1)]  # nothing to compare: only waited
        return [(work if r == 0 else None, f"gather {layout} to {root} [{r}] {out_layout}", out, inputs[r], 1)
                for r, (out, out_layout) in enumerate(outs)]
    pieces = [make_input(case * 10 + j, root, numel, dtype, "SUM") for j in range(world)]
    laid = [_laid_out(rnd, p.to(dev))[0] for p in pieces]  # drawn on every rank alike
    out, out_layout = _laid_out(rnd, torch.zeros(numel, dtype=dtype, device=dev))
    work = dist.scatter(out, laid if rank == root else None, src=global_root, group=group, async_op=async_op)
    return [(work, f"scatter from {root} into {out_layout}", out, pieces[rank], 1)]


def _ring(rnd, rank, world, dev, group, case, dtype, op, numel, async_op, to_oneself=True):
    """Every rank sends to the one `shift` ranks on (itself where 0, if `to_oneself`) by isend/irecv,
    in one batch or as two calls."""
    if not to_oneself and world == 1:
        return []
    shift = rnd.randrange(world) if to_oneself else 1 + rnd.randrange(world - 1)
    to, frm = (rank + shift) % world, (rank - shift) % world
    inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
    out = torch.empty(numel, dtype=dtype, device=dev)
    peer_to, peer_from = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    if rnd.random() < 0.5:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs[rank].to(dev), peer_to, group),
                                        dist.P2POp(dist.irecv, out, peer_from, group)])
    else:
        works = [dist.isend(inputs[rank].to(dev), peer_to, group=group), dist.irecv(out, peer_from, group=group)]
    return [(_All(works), f"from {frm}, shift {shift}", out, inputs[frm], 1)]


class _All:
    """Waits for every Work of a call that returns several."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


KINDS = [_all_reduce, _all_reduce, _coalesced, _broadcast, _reduce, _all_gather, _reduce_scatter, _all_to_all,
         _coalesced_gathers, _premul_sum, _list_forms, _gather_or_scatter, _ring]


def _sequence(rank, world, device, seed, across_nodes=False):
    rnd = random.Random(seed)  # every rank draws the same sequence
    dev = rank_device(device, rank)
    groups = []
    for _ in range(3):
        # The pass-through on CPU tensors (gloo); NCCL refuses several ranks on one GPU.
        options = _random_options(rnd, world, across_nodes, nccl=not across_nodes and dev.type == "cpu")
        groups.append((dist.new_group(backend="hca", pg_options=torch_hca.Options(**options)), options))
    errors, pending = [], []

    def check(checks):
        for work, what, got, want, tolerance_world in checks:
            if work is not None:
                work.wait()
            if got is not None:
                errors.append(mismatch(what, got, want, tolerance_world))

    for i in range(CALLS):
        group, options = rnd.choice(groups)
        kind = rnd.choice(KINDS)
        if kind is _ring and options["algorithm"] == "nccl":
            kind = functools.partial(_ring, to_oneself=False)  # gloo takes no message to oneself
        dtype = rnd.choice(DTYPES)
        op = rnd.choice([o for o in OPS if supported(dtype, o)])
        numel, async_op = rnd.choice(SIZES), rnd.random() < 0.5
        name = f"call {i}: {getattr(kind, 'func', kind).__name__[1:]} {options} {dtype} {op} numel={numel}"
        checks = kind(rnd, rank, world, dev, group, seed * 1000 + i, dtype, op, numel, async_op)
        checks = [(work, f"{name} {what}", got, want, w) for work, what, got, want, w in checks]
        if async_op and rnd.random() < 0.7:
            pending.append(checks)
            if len(pending) > 4 or rnd.random() < 0.3:
                rnd.shuffle(pending)  # calls in a random order; a call's own checks after its Work's wait
                for call in pending:
                    check(call)
                pending = []
        else:
            check(checks)
    for call in pending:
        check(call)
    return [e for e in errors if e]


# One hardware queue (Megatron-LM's setting) for the device's streams: hca's groups must put their
# calls there in the order they were made, the same on every rank, or the ranks deadlock.
ONE_QUEUE = {**SMALL_CHUNKS, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.mark.parametrize("seed", seeds(4))
def test_random_sequences_match_references(seed, device):
    world = seed % 4 + 1
    assert run_ranks(_sequence, world, device, seed, env=ONE_QUEUE) == [[]] * world


NODES = [["a", "b"], ["a", "a", "b"], ["a", "b", "a", "b"], ["a", "a", "a", "b", "b"]]


@pytest.mark.parametrize("seed", seeds(4, first=10))
def test_random_sequences_across_named_nodes_match_references(seed, device):
    """The same across nodes (TORCH_HCA_NODE_ID): hca inside each node, gloo among the leaders,
    the rest handed whole to the engine over every rank; on the CPU model of the device too
    (`cpu-streams`), where the stages run on the calls' streams in their turns."""
    if device == "cuda":
        pytest.skip("across nodes on one GPU: covered by test_nodes.py's CUDA tests")
    nodes = NODES[seed % len(NODES)]
    env = [{**ONE_QUEUE, "TORCH_HCA_NODE_ID": node} for node in nodes]
    assert run_ranks(_sequence, len(nodes), device, seed, True, env_per_rank=env) == [[]] * len(nodes)


def _two_shared_devices(world, **extra):
    """Each rank's environment: two model devices that the ranks' tensors share round-robin."""
    return [{**STREAMS_ENV, "TORCH_HCA_MODEL_DEVICES": "2", "TORCH_HCA_MODEL_DEVICE": str(r % 2), **extra}
            for r in range(world)]


# Where the ranks' tensors live on the CPU model of the device: a device each; each rank seeing only its
# own physical device, as its device 0 (CUDA_VISIBLE_DEVICES=<its GPU>); two devices shared round-robin.
MODEL_PLACES = {"own-device": own_devices, "one-visible": one_visible_device, "two-shared": _two_shared_devices}


@pytest.mark.parametrize("place", MODEL_PLACES)
@pytest.mark.parametrize("seed", seeds(1, first=20))
def test_random_sequences_on_model_devices_match_references(seed, place):
    """The same on the CPU model of the device with the ranks' tensors on several devices, so that
    each call's device, the current device of the calling thread and the peers' memory differ."""
    world = 2 + (seed + list(MODEL_PLACES).index(place)) % 3
    env = MODEL_PLACES[place](world, **ONE_QUEUE)
    assert run_ranks(_sequence, world, "cpu", seed, env_per_rank=env) == [[]] * world
