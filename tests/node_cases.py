"""What every rank runs in the tests across nodes (simulated by TORCH_HCA_NODE_ID on one host, or
real network namespaces): each function returns a list of mismatches against references
computed independently (float64 on CPU), an empty list when every element matches."""
from __future__ import annotations

import os
import signal
import time
import warnings

import torch
import torch.distributed as dist

import torch_hca
from reference import (BITWISE, DTYPES, OPS, all_gather_single, make_input,
                       mismatch, rank_device, reduce_reference, reduce_scatter_single, supported)


def _allreduce_cases(rank, world, group, label, dtypes, ops, sizes, first_case, dev):
    errors, case = [], first_case
    for dtype in dtypes:
        for op in ops:
            # Between nodes, CUDA tensors are refused the bitwise ops NCCL lacks (a ValueError before any move).
            if not supported(dtype, op) or (dev.type == "cuda" and op in BITWISE):
                continue
            for numel in sizes:
                case += 1
                inputs = [make_input(case, r, numel, dtype, op) for r in range(world)]
                t = inputs[rank].to(dev, copy=True)
                dist.all_reduce(t, op=OPS[op], group=group)
                errors.append(mismatch(f"{label} allreduce {dtype} {op} numel={numel}", t,
                                       reduce_reference(inputs, op), world))
    return errors, case


def _group(algorithm, inter_node_backend, num_packs=1):
    options = torch_hca.Options(algorithm, num_packs=num_packs, inter_node_backend=inter_node_backend)
    return dist.new_group(backend="hca", pg_options=options)


def allreduce_matrix(rank, world, algorithm="hierarchical_copy", packings=(0, 1, 2, 3), device="cpu",
                     inter_node_backend=None):
    """allreduce of every dtype and op; several packings (rotating the leaders) on coalesced lists."""
    dev = rank_device(device, rank)
    group = _group(algorithm, inter_node_backend)
    errors, case = _allreduce_cases(rank, world, group, algorithm, DTYPES, OPS, (1, 1000), 0, dev)
    for num_packs in packings:
        group = _group(algorithm, inter_node_backend, num_packs)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            case += 1
            sizes = (7, 70_001, 3, 1000)
            inputs = [[make_input(case * 10 + i, r, n, dtype, "SUM") for i, n in enumerate(sizes)]
                      for r in range(world)]
            mine = [t.to(dev, copy=True) for t in inputs[rank]]
            dist.all_reduce_coalesced(mine, group=group)
            for i in range(len(sizes)):
                want = reduce_reference([inputs[r][i] for r in range(world)], "SUM")
                errors.append(mismatch(f"{algorithm} num_packs={num_packs} {dtype} tensor {i}", mine[i], want, world))
    return [e for e in errors if e]


def rooted_and_gathers(rank, world, algorithm="hierarchical_copy", device="cpu", inter_node_backend=None):
    """broadcast and reduce from every root; allgather, reduce_scatter (both forms), barrier, an
    async allreduce; on CPU tensors, the operations forwarded to the engine over every rank too."""
    dev = rank_device(device, rank)
    group = _group(algorithm, inter_node_backend, num_packs=2)
    errors, case = [], 1000
    cpu_bitwise = (("BOR", torch.int32), ("BXOR", torch.int64)) if device == "cpu" else ()
    for root in range(world):
        for dtype in (torch.float32, torch.int32, torch.bool, torch.float8_e4m3fn):
            case += 1
            inputs = [make_input(case, r, 1001, dtype, "SUM") for r in range(world)]
            t = inputs[rank].to(dev, copy=True)
            dist.broadcast(t, src=root, group=group)
            errors.append(mismatch(f"broadcast src={root} {dtype}", t, inputs[root], world))
        for op, dtype in (("SUM", torch.float64), ("AVG", torch.float64), ("MAX", torch.float64)) + cpu_bitwise:
            case += 1
            inputs = [make_input(case, r, 999, dtype, op) for r in range(world)]
            t = inputs[rank].to(dev, copy=True)
            dist.reduce(t, dst=root, op=OPS[op], group=group)
            want = reduce_reference(inputs, op) if rank == root else inputs[rank]
            errors.append(mismatch(f"reduce dst={root} {op} (rank {rank})", t, want, world))
    for dtype in (torch.float32, torch.float16, torch.int8, torch.float8_e5m2):
        case += 1
        inputs = [make_input(case, r, 517, dtype, "SUM") for r in range(world)]
        out = torch.full((world * 517,), 7, dtype=dtype, device=dev)
        all_gather_single(out, inputs[rank].to(dev, copy=True), group=group)
        errors.append(mismatch(f"all_gather_into_tensor {dtype}", out, torch.cat(inputs), world))
        outs = [torch.full((517,), 7, dtype=dtype, device=dev) for _ in range(world)]
        dist.all_gather(outs, inputs[rank].to(dev, copy=True), group=group)
        errors.append(mismatch(f"all_gather {dtype}", torch.cat(outs), torch.cat(inputs), world))
    for op, dtype in (("SUM", torch.float32), ("AVG", torch.float32), ("MAX", torch.float32)) + cpu_bitwise:
        case += 1
        inputs = [make_input(case, r, world * 333, dtype, op) for r in range(world)]
        want = reduce_reference(inputs, op)[rank * 333:(rank + 1) * 333]
        out = torch.full((333,), 7, dtype=dtype, device=dev)
        reduce_scatter_single(out, inputs[rank].to(dev, copy=True), op=OPS[op], group=group)
        errors.append(mismatch(f"reduce_scatter_tensor {op} {dtype}", out, want, world))
        out = torch.full((333,), 7, dtype=dtype, device=dev)
        dist.reduce_scatter(out, list(inputs[rank].to(dev, copy=True).chunk(world)), op=OPS[op], group=group)
        errors.append(mismatch(f"reduce_scatter {op}", out, want, world))
    dist.barrier(group=group)
    case += 1
    inputs = [make_input(case, r, 50_000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].to(dev, copy=True)
    dist.all_reduce(t, group=group, async_op=True).wait()
    errors.append(mismatch("async allreduce", t * 1, reduce_reference(inputs, "SUM"), world))
    if device == "cpu":
        errors += forwarded_ops(rank, world, group, case + 1)
    return [e for e in errors if e]


def forwarded_ops(rank, world, group, case, to_oneself=True):
    """gather, scatter, all_to_all_single and a send/recv ring (the operations hca's wrappers hand to
    the stock engine over every rank), against their inputs; float8 too, which gloo knows only as bytes;
    with `to_oneself`, a message to oneself."""
    errors = []
    for dtype in (torch.float32, torch.float8_e4m3fn):
        case += 2
        inputs = [make_input(case, r, 64, dtype, "SUM") for r in range(world)]
        gathered = [torch.zeros(64, dtype=dtype) for _ in range(world)] if rank == 0 else None
        dist.gather(inputs[rank].clone(), gathered, dst=0, group=group)
        if rank == 0:
            errors.append(mismatch(f"gather {dtype}", torch.cat(gathered), torch.cat(inputs), world))
        out = torch.zeros(64, dtype=dtype)
        dist.scatter(out, [t.clone() for t in inputs] if rank == 0 else None, src=0, group=group)
        errors.append(mismatch(f"scatter {dtype}", out, inputs[rank], world))
        blocks = [make_input(case + 1, r, 8 * world, dtype, "SUM") for r in range(world)]
        out = torch.zeros(8 * world, dtype=dtype)
        dist.all_to_all_single(out, blocks[rank].clone(), group=group)
        want = torch.cat([blocks[r][rank * 8:(rank + 1) * 8] for r in range(world)])
        errors.append(mismatch(f"all_to_all_single {dtype}", out, want, world))
        if world > 1:
            got = torch.zeros(64, dtype=dtype)
            ops = [dist.P2POp(dist.isend, inputs[rank].clone(), (rank + 1) % world, group),
                   dist.P2POp(dist.irecv, got, (rank - 1) % world, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            errors.append(mismatch(f"send/recv ring {dtype}", got, inputs[(rank - 1) % world], world))
        if not to_oneself:
            continue
        # To oneself: gloo takes none, the node's group does (as NCCL, an all-to-all's own block).
        got = torch.zeros(64, dtype=dtype)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs[rank].clone(), rank, group),
                                        dist.P2POp(dist.irecv, got, rank, group)])
        for work in works:
            work.wait()
        errors.append(mismatch(f"send/recv to oneself {dtype}", got, inputs[rank], world))
    return errors


def _strided(values):
    """`values` in a view of every other element, at an offset: not contiguous."""
    base = torch.zeros(2 * values.numel() + 3, dtype=values.dtype)
    view = base[3::2]
    view.copy_(values)
    return view


def strided_engine_ops(rank, world, group=None, premul=False):
    """The operations a stock engine carries (all but all_reduce under algorithm="nccl"; those handed
    whole across nodes), on views that are not contiguous: gloo read and wrote them as if they
    were (broadcast, reduce, scatter and reduce_scatter came out wrong, silently) or refused them.
    Every result against its input or a float64 reference; the views' other elements untouched."""
    errors = []
    n = 6 * world
    data = [make_input(900, r, n, torch.float32, "SUM") for r in range(world)]
    total = reduce_reference(data, "SUM")

    def check(what, view, want):
        errors.append(mismatch(what, view, want, world))
        if view._base is not None:
            rest = view._base.clone()
            rest[3::2] = 0
            if rest.any():
                errors.append(f"{what}: elements outside the view were written")

    for root in range(world):
        t = _strided(data[rank])
        dist.broadcast(t, src=root, group=group)
        check(f"broadcast from {root}", t, data[root])
        t = _strided(data[rank])
        dist.reduce(t, dst=root, group=group)
        check(f"reduce to {root}", t, total if rank == root else data[rank])
    outs = [_strided(torch.zeros(n)) for _ in range(world)]
    dist.all_gather(outs, _strided(data[rank]), group=group)
    check("all_gather", torch.cat([o.clone() for o in outs]), torch.cat(data))
    flat = _strided(torch.zeros(n * world))
    all_gather_single(flat, _strided(data[rank]), group=group)
    check("all_gather_single", flat, torch.cat(data))
    gathered = [_strided(torch.zeros(n)) for _ in range(world)] if rank == 0 else None
    dist.gather(_strided(data[rank]), gathered, dst=0, group=group)
    if rank == 0:
        check("gather", torch.cat([g.clone() for g in gathered]), torch.cat(data))
    out = _strided(torch.zeros(n))
    dist.scatter(out, [_strided(d) for d in data] if rank == world - 1 else None, src=world - 1, group=group)
    check("scatter", out, data[rank])
    out = _strided(torch.zeros(n))
    dist.all_to_all_single(out, _strided(data[rank]), group=group)
    check("all_to_all_single", out, torch.cat([d[rank * 6:(rank + 1) * 6] for d in data]))
    part = total[rank * 6:(rank + 1) * 6]
    out = _strided(torch.zeros(6))
    dist.reduce_scatter(out, [_strided(c.clone()) for c in data[rank].chunk(world)], group=group)
    check("reduce_scatter", out, part)
    out = _strided(torch.zeros(6))
    reduce_scatter_single(out, _strided(data[rank]), group=group)
    check("reduce_scatter_single", out, part)
    if premul:
        out = _strided(torch.zeros(6))
        reduce_scatter_single(out, _strided(data[rank]), op=dist._make_nccl_premul_sum(0.5), group=group)
        check("reduce_scatter_single PREMUL_SUM", out, part * 0.5)
    if world > 1:
        got = torch.zeros(n)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, _strided(data[rank]), (rank + 1) % world, group),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % world, group)])
        for work in works:
            work.wait()
        check("send from a view", got, data[(rank - 1) % world])
    return [e for e in errors if e]


def shaped_wholes(rank, world, group=None):
    """all_gather_into_tensor and reduce_scatter_tensor (alone and coalesced) with the whole tensor
    shaped as torch documents and NCCL takes it: stacked (ranks, *part), flat, or of any shape with
    `world` parts' elements, the parts one after another in memory (gloo takes only the parts
    stacked along the first dimension); the list forms (all_gather, all_gather_coalesced, gather,
    scatter, reduce_scatter) with tensors of their slots' elements in other shapes (gloo checks
    shapes). Every element against the inputs or a float64 reference."""
    errors = []
    parts = [make_input(960, r, 6, torch.float32, "SUM").view(2, 3) for r in range(world)]
    gathered = torch.cat([p.reshape(-1) for p in parts])
    for name, shape in (("stacked", (world, 2, 3)), ("flat", (world * 6,)), ("columns", (2, 3 * world))):
        out = torch.zeros(shape)
        all_gather_single(out, parts[rank], group=group)
        errors.append(mismatch(f"all_gather_into_tensor {name}", out.reshape(-1), gathered, world))
    wholes = [make_input(961, r, world * 6, torch.float32, "SUM") for r in range(world)]
    total = reduce_reference(wholes, "SUM")[rank * 6:(rank + 1) * 6].view(2, 3)
    for name, shape in (("stacked", (world, 2, 3)), ("flat", (world * 6,))):
        out = torch.zeros(2, 3)
        reduce_scatter_single(out, wholes[rank].view(shape), group=group)
        errors.append(mismatch(f"reduce_scatter_tensor {name}", out, total, world))
    stacked, scattered = torch.zeros(world, 2, 3), torch.zeros(2, 3)
    with dist._coalescing_manager(group=group):  # one kind of call per window
        all_gather_single(stacked, parts[rank], group=group)
    with dist._coalescing_manager(group=group):
        reduce_scatter_single(scattered, wholes[rank].view(world, 2, 3), group=group)
    errors.append(mismatch("coalesced all_gather_into_tensor stacked", stacked.reshape(-1), gathered, world))
    errors.append(mismatch("coalesced reduce_scatter_tensor stacked", scattered, total, world))
    # The list forms, each tensor of its slot's elements in another shape
    outs = [torch.zeros(6) for _ in range(world)]
    dist.all_gather(outs, parts[rank], group=group)
    errors += [mismatch(f"all_gather slot {r}, flat", outs[r], parts[r].reshape(-1), world) for r in range(world)]
    root = world - 1
    outs = [torch.zeros(3, 2) for _ in range(world)] if rank == root else None
    dist.gather(parts[rank], outs, dst=root, group=group)
    if rank == root:
        errors += [mismatch(f"gather slot {r}, (3, 2)", outs[r].reshape(-1), parts[r].reshape(-1), world)
                   for r in range(world)]
    out = torch.zeros(6)
    dist.scatter(out, [p.t() for p in parts] if rank == root else None, src=root, group=group)
    errors.append(mismatch("scatter into a flat tensor", out, parts[rank].t().reshape(-1), world))
    lists = [[torch.zeros(3, 2), torch.zeros(6)] for _ in range(world)]
    with warnings.catch_warnings():  # all_gather_coalesced is deprecated, and still carried
        warnings.simplefilter("ignore")
        dist.all_gather_coalesced(lists, [parts[rank], parts[rank].t()], group=group)
    for r in range(world):
        errors.append(mismatch(f"all_gather_coalesced slot {r}, (3, 2)", lists[r][0].reshape(-1),
                               parts[r].reshape(-1), world))
        errors.append(mismatch(f"all_gather_coalesced slot {r}, flat", lists[r][1], parts[r].t().reshape(-1), world))
    out = torch.zeros(6)
    dist.reduce_scatter(out, [w.view(2, 3) for w in wholes[rank].chunk(world)], group=group)
    errors.append(mismatch("reduce_scatter into a flat tensor", out, total.reshape(-1), world))
    return [e for e in errors if e]


def all_to_all_of_any_sizes(rank, world, group=None):
    """all_to_all's list form with a tensor of its own size (and shape) for each pair of ranks, as NCCL
    takes it (gloo's takes one size only), non-contiguous outputs too; all_to_all_single whose input
    and output rows differ in shape. Every element against the senders' inputs."""
    def part(src, dst):  # what rank `src` sends to rank `dst`
        return make_input(962, src * world + dst, (src + 2 * dst + 1) * 3, torch.float64, "SUM").view(-1, 3)

    outputs = [torch.zeros(3, part(src, rank).shape[0], dtype=torch.float64).t() for src in range(world)]  # views
    dist.all_to_all(outputs, [part(rank, dst) for dst in range(world)], group=group)
    errors = [mismatch(f"all_to_all from rank {src}", outputs[src], part(src, rank), world) for src in range(world)]
    # all_to_all_single whose input and output rows differ in shape: rows of 3 elements out, of 6 in
    single = [make_input(963, r, world * 6, torch.float32, "SUM") for r in range(world)]
    out = torch.zeros(world, 6)
    dist.all_to_all_single(out, single[rank].view(2 * world, 3), group=group)
    errors.append(mismatch("all_to_all_single, rows of other shapes", out.reshape(-1),
                           torch.cat([single[src][rank * 6:(rank + 1) * 6] for src in range(world)]), world))
    out = torch.zeros(world, 6)  # the same in rows given as splits: 2 rows of 3 out to each rank, 1 of 6 in
    dist.all_to_all_single(out, single[rank].view(2 * world, 3), [1] * world, [2] * world, group=group)
    errors.append(mismatch("all_to_all_single with splits, rows of other shapes", out.reshape(-1),
                           torch.cat([single[src][rank * 6:(rank + 1) * 6] for src in range(world)]), world))
    return [e for e in errors if e]


def expanded_inputs(rank, world, group=None):
    """Inputs whose elements share memory (expand(): a stride of 0), in every call that only reads
    its input, as gloo takes them (hca's own algorithms refused them); every element against the
    inputs or a float64 reference. An in-place call on such a view stays refused (test_collectives)."""
    def expanded(case, src, rows):  # `rows` copies of one row of 3 elements, in the memory of that row
        return make_input(case, src, 3, torch.float32, "SUM").view(1, 3).expand(rows, 3)

    errors = []
    root = world - 1
    mine = expanded(970, rank, 2)
    gathered = torch.cat([expanded(970, r, 2).reshape(-1) for r in range(world)])
    outs = [torch.zeros(2, 3) for _ in range(world)]
    dist.all_gather(outs, mine, group=group)
    errors.append(mismatch("all_gather", torch.cat([o.reshape(-1) for o in outs]), gathered, world))
    out = torch.zeros(world * 6)
    all_gather_single(out, mine, group=group)
    errors.append(mismatch("all_gather_into_tensor", out, gathered, world))
    lists = [[torch.zeros(2, 3)] for _ in range(world)]
    with warnings.catch_warnings():  # all_gather_coalesced is deprecated, and still carried
        warnings.simplefilter("ignore")
        dist.all_gather_coalesced(lists, [mine], group=group)
    errors.append(mismatch("all_gather_coalesced", torch.cat([t[0].reshape(-1) for t in lists]), gathered, world))
    outs = [torch.zeros(2, 3) for _ in range(world)] if rank == root else None
    dist.gather(mine, outs, dst=root, group=group)
    if rank == root:
        errors.append(mismatch("gather", torch.cat([o.reshape(-1) for o in outs]), gathered, world))
    out = torch.zeros(2, 3)
    dist.scatter(out, [expanded(971, r, 2) for r in range(world)] if rank == root else None, src=root, group=group)
    errors.append(mismatch("scatter", out, expanded(971, rank, 2), world))
    wholes = [expanded(972, r, 2 * world) for r in range(world)]
    out = torch.zeros(2 * world, 3)
    dist.all_to_all_single(out, wholes[rank], group=group)
    errors.append(mismatch("all_to_all_single", out, torch.cat([w[2 * rank:2 * rank + 2] for w in wholes]), world))
    outs = [torch.zeros(2, 3) for _ in range(world)]
    dist.all_to_all(outs, list(wholes[rank].split(2)), group=group)
    errors += [mismatch(f"all_to_all from {r}", outs[r], wholes[r][2 * rank:2 * rank + 2], world) for r in range(world)]
    part = reduce_reference(wholes, "SUM")[2 * rank:2 * rank + 2]
    out = torch.zeros(2, 3)
    reduce_scatter_single(out, wholes[rank], group=group)
    errors.append(mismatch("reduce_scatter_tensor", out, part, world))
    out = torch.zeros(2, 3)
    dist.reduce_scatter(out, list(wholes[rank].split(2)), group=group)
    errors.append(mismatch("reduce_scatter", out, part, world))
    if world > 1:
        got = torch.zeros(2, 3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, (rank + 1) % world, group),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % world, group)])
        for work in works:
            work.wait()
        errors.append(mismatch("send", got, expanded(970, (rank - 1) % world, 2), world))
    return [e for e in errors if e]


def exchanged_in_place(rank, world, group=None):
    """all_to_all whose outputs are its inputs (the same tensors, or non-contiguous views of them),
    and all_to_all_single with one tensor as both, or overlapping parts of one: each input read as
    it was before anything is written (stock gloo computed all_to_all_single(t, t) wrong, silently;
    hca's own algorithms refused the contiguous ones), the views' copies never written back over
    the results. Every element against the senders' inputs."""
    def rows(case, src):  # `src`'s tensor: rows of 2, 4 rows per rank
        return make_input(case, src, world * 8, torch.float32, "SUM").view(world * 4, 2)

    errors = []
    for case, name, lists in ((975, "tensors", lambda t: list(t[:, 0].contiguous().split(4))),
                              (976, "views", lambda t: list(t[:, 0].split(4)))):
        tensors = lists(rows(case, rank))
        dist.all_to_all(tensors, tensors, group=group)
        errors += [mismatch(f"all_to_all in place, {name}, from {r}", tensors[r],
                            rows(case, r)[4 * rank:4 * rank + 4, 0], world) for r in range(world)]
    for case, name, given in ((977, "tensor", lambda t: t[:, 1].contiguous()), (978, "view", lambda t: t[:, 1])):
        both = given(rows(case, rank))
        dist.all_to_all_single(both, both, group=group)
        errors.append(mismatch(f"all_to_all_single in place, {name}", both,
                               torch.cat([rows(case, r)[4 * rank:4 * rank + 4, 1] for r in range(world)]), world))
    buffer = rows(979, rank).reshape(-1)  # the output's first half of the input's second, and beyond
    output, source = buffer[:world * 4], buffer[world * 2:world * 6]
    want = torch.cat([rows(979, r).reshape(-1)[world * 2 + 4 * rank:world * 2 + 4 * rank + 4] for r in range(world)])
    dist.all_to_all_single(output, source, group=group)
    errors.append(mismatch("all_to_all_single into a part of its input", output, want, world))
    return [e for e in errors if e]


def inputs_among_outputs(rank, world, group=None):
    """Calls whose input is one of their outputs, or whose output is one of their inputs: a root
    gathering from, or scattering into, a tensor of its own list (its own slot, or another rank's),
    all_gather and all_gather_coalesced from a tensor of their outputs, reduce_scatter into one of
    its inputs. Each input is read as it was before anything is written (stock gloo scattered the
    root's list after writing into it, and reduced the list after writing into one of its
    tensors: wrong, silently; hca's own algorithms refused all but the last). Every element
    against the inputs or a float64 reference."""
    def part(case, src, k=0):
        return make_input(case, src * world + k, 5, torch.float32, "SUM")

    errors = []
    for root in range(world):
        for slot in sorted({root, (root + 1) % world}):  # the root's own slot, and another's
            case = 980 + slot
            if rank == root:
                outs = [torch.zeros(5) for _ in range(world)]
                outs[slot].copy_(part(case, rank))
                dist.gather(outs[slot], outs, dst=root, group=group)
                errors += [mismatch(f"gather to {root} from slot {slot}, part {r}", outs[r], part(case, r), world)
                           for r in range(world)]
            else:
                dist.gather(part(case, rank), None, dst=root, group=group)
            ins = [part(case + 10, root, r) for r in range(world)] if rank == root else None
            out = ins[slot] if rank == root else torch.zeros(5)
            dist.scatter(out, ins, src=root, group=group)
            errors.append(mismatch(f"scatter from {root} into slot {slot}", out, part(case + 10, root, rank), world))
    outs = [torch.zeros(5) for _ in range(world)]
    other = (rank + 1) % world
    outs[other].copy_(part(990, rank))
    dist.all_gather(outs, outs[other], group=group)
    errors += [mismatch(f"all_gather from slot {other}, part {r}", outs[r], part(990, r), world) for r in range(world)]
    lists = [[torch.zeros(5)] for _ in range(world)]
    lists[rank][0].copy_(part(991, rank))
    with warnings.catch_warnings():  # all_gather_coalesced is deprecated, and still carried
        warnings.simplefilter("ignore")
        dist.all_gather_coalesced(lists, [lists[rank][0]], group=group)
    errors += [mismatch(f"all_gather_coalesced in place, part {r}", lists[r][0], part(991, r), world)
               for r in range(world)]
    for slot in sorted({rank, other}):
        ins = [part(992, rank, k) for k in range(world)]
        dist.reduce_scatter(ins[slot], ins, group=group)
        want = reduce_reference([part(992, r, rank) for r in range(world)], "SUM")
        errors.append(mismatch(f"reduce_scatter into input {slot}", ins[slot], want, world))
    return [e for e in errors if e]


def empty_tensors(rank, world, group=None):
    """Every operation on tensors of no elements (an FSDP shard, a DDP bucket of unused parameters
    can be empty), then an all_reduce that must still be right: a failing stage would have broken
    the group."""
    errors = []

    def empty():
        return torch.zeros(0, 4)

    calls = {
        "all_reduce": lambda: dist.all_reduce(empty(), group=group),
        "all_reduce async": lambda: dist.all_reduce(empty(), group=group, async_op=True).wait(),
        "all_reduce_coalesced with a non-empty one": lambda: dist.all_reduce_coalesced(
            [empty(), torch.ones(3), empty()], group=group),
        "broadcast": lambda: dist.broadcast(empty(), src=world - 1, group=group),
        "reduce": lambda: dist.reduce(empty(), dst=world - 1, group=group),
        "all_gather": lambda: dist.all_gather([empty() for _ in range(world)], empty(), group=group),
        "all_gather_single": lambda: all_gather_single(torch.zeros(0), torch.zeros(0), group=group),
        "reduce_scatter_single": lambda: reduce_scatter_single(torch.zeros(0), torch.zeros(0), group=group),
        "reduce_scatter": lambda: dist.reduce_scatter(empty(), [empty() for _ in range(world)], group=group),
        "gather": lambda: dist.gather(empty(), [empty() for _ in range(world)] if rank == 0 else None, group=group),
        "scatter": lambda: dist.scatter(empty(), [empty() for _ in range(world)] if rank == 0 else None, group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(0), torch.zeros(0), group=group),
        "barrier": lambda: dist.barrier(group=group),
    }
    for name, call in calls.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001 (each call's error is the finding, the next call goes on)
            errors.append(f"{name} of empty tensors: {type(e).__name__}: {e}")
    t = make_input(950, rank, 1000, torch.float32, "SUM")
    dist.all_reduce(t, group=group)
    errors.append(mismatch("all_reduce after them", t,
                           reduce_reference([make_input(950, r, 1000, torch.float32, "SUM") for r in range(world)], "SUM"),
                           world))
    return [e for e in errors if e]


# The calls of mismatched_calls that the group across nodes runs in stages (the rest go whole to
# the engine over every rank).
STAGED_ACROSS_NODES = ("all_reduce", "all_reduce of no elements against some", "all_reduce of another dtype",
                       "broadcast", "reduce", "all_gather", "all_gather_single", "reduce_scatter_single",
                       "reduce_scatter", "all_reduce against a broadcast", "barrier against an all_reduce")


def mismatched_calls(rank, world, odd_ranks, staged=(), group=None):
    """The ranks in `odd_ranks` make each call with other sizes than the rest (or another call):
    every rank raises "mismatched calls" within seconds, where gloo, which carries these calls,
    aborts the process or writes a broadcast short (a root whose list does not fit raises ValueError
    at the call instead, and the others the mismatch with its refusal). Then an all_reduce must
    still be right: the group goes on. `staged`: calls after that whose mismatch ends the group
    (across nodes, where the nodes' leaders find it mid-call: every rank raises, and none goes on)."""
    odd = rank in odd_ranks
    n = 6 if odd else 4
    splits = [2 if odd else 1] * world
    received = [2 if r in odd_ranks else 1 for r in range(world)]
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(n), group=group),
        "all_reduce of no elements against some": lambda: dist.all_reduce(torch.ones(0 if odd else 4), group=group),
        "all_reduce of another dtype": lambda: dist.all_reduce(
            torch.ones(4, dtype=torch.float64 if odd else torch.float32), group=group),
        "broadcast": lambda: dist.broadcast(torch.ones(n), src=0, group=group),
        "reduce": lambda: dist.reduce(torch.ones(n), dst=0, group=group),
        "all_gather": lambda: dist.all_gather([torch.empty(n) for _ in range(world)], torch.ones(n), group=group),
        "all_gather_single": lambda: all_gather_single(torch.empty(world * n), torch.ones(n), group=group),
        "reduce_scatter_single": lambda: reduce_scatter_single(torch.empty(n), torch.ones(world * n), group=group),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(world)],
                                                      group=group),
        "gather": lambda: dist.gather(torch.ones(n), [torch.empty(n) for _ in range(world)] if rank == 0 else None,
                                      dst=0, group=group),
        "gather into a list that does not fit, on its root": lambda: dist.gather(
            torch.ones(4), [torch.empty(5) for _ in range(world)] if rank == odd_ranks[0] else None,
            dst=odd_ranks[0], group=group),
        "scatter from a list that does not fit, on its root": lambda: dist.scatter(
            torch.empty(4), [torch.ones(5) for _ in range(world)] if rank == odd_ranks[0] else None,
            src=odd_ranks[0], group=group),
        "scatter": lambda: dist.scatter(torch.empty(n), [torch.ones(n) for _ in range(world)] if rank == 0 else None,
                                        src=0, group=group),
        "all_to_all_single with splits that do not pair up": lambda: dist.all_to_all_single(
            torch.empty(world), torch.ones(sum(splits)), [1] * world, splits, group=group),
        "all_to_all_single with received splits that do not pair up": lambda: dist.all_to_all_single(
            torch.empty(world if odd else sum(received)), torch.ones(world), [1] * world if odd else received,
            [1] * world,
            group=group),
        "all_reduce against a broadcast": lambda: (dist.broadcast(torch.ones(4), src=0, group=group) if odd
                                                   else dist.all_reduce(torch.ones(4), group=group)),
        "barrier against an all_reduce": lambda: (dist.barrier(group=group) if odd
                                                  else dist.all_reduce(torch.ones(4), group=group)),
    }
    errors = []

    def expect_mismatch(name):
        start = time.monotonic()
        refuses = name.endswith("on its root") and rank == odd_ranks[0]
        try:
            calls[name]()
            errors.append(f"{name}: no error")
        except ValueError as e:
            if not (refuses and "tensor has 5 elements, expected 4" in str(e)):
                errors.append(f"{name}: ValueError: {e}")
        except dist.DistBackendError as e:
            if refuses or "mismatched calls" not in str(e) or (name.endswith("on its root") and
                                                             "refused at the call" not in str(e)):
                errors.append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 (each call's error is the finding, the next call goes on)
            errors.append(f"{name}: {type(e).__name__}: {e}")
        if time.monotonic() - start > 10:
            errors.append(f"{name}: took {time.monotonic() - start:.1f} s")

    for name in [c for c in calls if c not in staged]:
        expect_mismatch(name)
    t = make_input(950, rank, 1000, torch.float32, "SUM")
    dist.all_reduce(t, group=group)
    errors.append(mismatch("all_reduce after them", t,
                           reduce_reference([make_input(950, r, 1000, torch.float32, "SUM") for r in range(world)], "SUM"),
                           world))
    for name in staged:
        expect_mismatch(name)
    return [e for e in errors if e]


def messages_through_gloo(rank, world, group=None):
    """misfit_messages, then messages_posted_ahead, in one launch."""
    return misfit_messages(rank, world, group) + messages_posted_ahead(rank, world, group)


def misfit_messages(rank, world, group=None):
    """Rank 1 sends rank 0 messages that its receives do not fit: a larger receiving tensor, another
    dtype, a smaller one (where gloo carries messages, stock gloo fills the first two in part without
    an error and aborts the process on the third). Each such receive raises ValueError naming both
    sides, the message is consumed, and the channel goes on: a receive from any source after them
    gets its message whole. The errors found, none when every receive behaves so."""
    if rank == 1:
        dist.send(torch.ones(10), 0, group=group)
        dist.send(torch.ones(10, dtype=torch.int64), 0, group=group, tag=1)
        dist.send(torch.ones(10), 0, group=group, tag=2)
        dist.send(torch.arange(3.0), 0, group=group, tag=3)
    if rank != 0:
        return []
    expected = {
        "larger": (lambda: dist.recv(torch.empty(20), 1, group=group), "sent 10 x float32 with tag 0, but this recv expects 20 x float32"),
        "dtype": (lambda: dist.recv(torch.empty(10), 1, group=group, tag=1), "sent 10 x int64 with tag 1, but this recv expects 10 x float32"),
        "smaller": (lambda: dist.recv(torch.empty(4), 1, group=group, tag=2), "sent 10 x float32 with tag 2, but this recv expects 4 x float32"),
    }
    errors = []
    for name, (call, message) in expected.items():
        try:
            call()
            errors.append(f"{name}: no error")
        except ValueError as e:
            if f"hca recv: rank 1 {message}" not in str(e):
                errors.append(f"{name}: {e}")
    t = torch.empty(3)
    source = dist.recv(t, group=group, tag=3)
    errors.append(None if source == 1 and torch.equal(t, torch.arange(3.0)) else f"after them: {source} {t}")
    return [e for e in errors if e]


def messages_posted_ahead(rank, world, group=None):
    """Rank 0 posts every receive before it waits for any: 300 from each other rank on one tag
    (sizes 10, 1000 and 5 in turn, random data), then one from any source per other rank on
    another tag. Each gets its own message whole (in the sender's order), however many are posted
    from one sender and tag, whichever receive learns of its message first. Where gloo carries the messages, as here, tags outside [0, 2^30) are
    ValueErrors at the call (hca sends descriptions with the tag plus 2^30). The errors found."""
    sizes = (10, 1000, 5) * 100
    sent = {(r, k): make_input(600 + 1000 * r + k, r, n, torch.float32, "SUM") for r in range(1, world)
            for k, n in enumerate(sizes)}
    if rank != 0:
        works = [dist.isend(sent[(rank, k)], 0, group=group, tag=5) for k in range(len(sizes))]
        works.append(dist.isend(torch.full((7,), float(rank)), 0, group=group, tag=6))
        for work in works:
            work.wait()
        return []
    errors = []
    got = {key: torch.empty_like(value) for key, value in sent.items()}
    works = [dist.irecv(got[(r, k)], r, group=group, tag=5) for r in range(1, world) for k in range(len(sizes))]
    anysource = [torch.empty(7) for _ in range(1, world)]
    any_works = [dist.irecv(t, group=group, tag=6) for t in anysource]
    for work in works + any_works:
        work.wait()
    errors += [f"tag 5, rank {r}, message {k}" for (r, k), t in got.items() if not torch.equal(t, sent[(r, k)])]
    sources = sorted(int(t[0]) for t in anysource)
    if sources != list(range(1, world)) or any(not torch.all(t == t[0]) for t in anysource):
        errors.append(f"from any source: {anysource}")
    for tag in (-1, 2**30):
        for call in (dist.send, dist.recv):
            try:
                call(torch.ones(2), 1, group=group, tag=tag)
                errors.append(f"{call.__name__} with tag {tag}: no error")
            except ValueError as e:
                if f"tag {tag} is out of range" not in str(e):
                    errors.append(f"{call.__name__} with tag {tag}: {e}")
    return errors


def calls_in_turn_with_another_group(rank, world, device="cuda", rounds=3):
    """An async all-reduce across nodes, then one on a second group (across the same nodes), each
    round. Rank 0 makes the second 50 ms later, when its worker has got to the first call's stages;
    the other ranks at once. On a device, the stages must still issue before the second call on
    every rank: they issue in the turn the first call took when it was made."""
    dev = rank_device(device, rank)
    second = dist.new_group(backend="hca")
    for group in (None, second):  # set-up, in one order everywhere
        dist.all_reduce(torch.ones(4, device=dev), group=group)
    errors = []
    for i in range(rounds):
        inputs = [[make_input(50 + 2 * i + k, r, 300_000, torch.float32, "SUM") for r in range(world)]
                  for k in range(2)]
        mine = [inputs[k][rank].to(dev, copy=True) for k in range(2)]
        works = [dist.all_reduce(mine[0], async_op=True)]
        if rank == 0:
            time.sleep(0.05)
        works.append(dist.all_reduce(mine[1], group=second, async_op=True))
        for k, work in enumerate(works):
            work.wait()
            errors.append(mismatch(f"round {i}, group {k}", mine[k], reduce_reference(inputs[k], "SUM"), world))
    return [e for e in errors if e]


def p2p_on_a_full_dev_shm(rank, world):
    """After init, a file takes what is left of /dev/shm; rank 0 then sends rank 1 a message.
    Its ring's reservation fails: both ranks' calls raise (the sender's cause, the receiver told
    by it), neither process dies of SIGBUS. Returns each rank's error."""
    dist.barrier()
    if rank == 0:
        fd, space = os.open("/dev/shm/filler", os.O_CREAT | os.O_RDWR, 0o600), os.statvfs("/dev/shm")
        try:
            os.posix_fallocate(fd, 0, space.f_bavail * space.f_frsize)
        except OSError:
            pass  # what did fit is taken
        os.close(fd)
    dist.barrier()
    try:
        if rank == 0:
            dist.send(torch.ones(1000), 1)
        elif rank == 1:
            dist.recv(torch.empty(1000), 0)
        return None
    except dist.DistBackendError as e:
        return str(e)


def staged_in_a_small_dev_shm(rank, world):
    """All-reduces of 3 Mi elements (several rounds of any slot) on a model device each rank alone
    sees, so staged in host shared memory: mismatches, and where and in what slots it staged."""
    wrong = []
    for case, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64)):
        inputs = [make_input(case, r, 3 << 20, dtype, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        wrong.append(mismatch(f"all_reduce {dtype}", t, reduce_reference(inputs, "SUM"), world))
    found = torch_hca.hierarchy()
    return [w for w in wrong if w], found["staging"]["cpu"], found["staging_slot_bytes"]["cpu"]


def layout(rank, world):
    """The backend class and the nodes it found."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return type(backend).__name__, getattr(backend, "nodes", None)


def ddp_hca_and_gloo(rank, world):
    """The parameters after the same DDP steps over hca and over gloo."""
    return [_training(rank, world, "hca"), _training(rank, world, "gloo")]


def fsdp2_hca_and_gloo(rank, world):
    """The parameters after the same FSDP2 steps over hca (the default group) and over gloo."""
    from torch.distributed.device_mesh import DeviceMesh

    gloo = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    return [fsdp2_training(rank)[1], fsdp2_training(rank, gloo)[1]]


def fsdp2_training(rank, mesh=None, steps=5, device="cpu"):
    """FSDP2 (all_gather_into_tensor + reduce_scatter_tensor) on a small model on `device` (mesh:
    the default group's): the parameters before and after `steps` steps, gathered whole, on CPU."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dev = rank_device(device, rank)
    mesh = mesh or DeviceMesh.from_group(dist.group.WORLD, dev.type)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dev)
    initial = [p.detach().cpu() for p in model.parameters()]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return initial, [p.full_tensor().detach().cpu() for p in model.parameters()]


def node_dies(rank, world, dying):
    """Ranks in `dying` kill themselves (SIGKILL) while the others go on all-reducing: what the
    survivors raise (type, message) and how long after the first failing call."""
    t = torch.ones(10_000)
    for _ in range(3):
        dist.all_reduce(t)
    if rank in dying:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001  the error is the result
        return [type(e).__name__, str(e), time.monotonic() - start]
    return ["no error", "", time.monotonic() - start]


def _training(rank, world, backend):
    """A few DDP steps on a small model with per-rank data; the final parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    group = dist.new_group(backend=backend)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(8, 16, generator=g, dtype=torch.float64)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def late_ranks(rank, world, late):
    """Allreduces for which the ranks in `late` arrive 0.3 s after the others, who wait for them
    (and check that they live); the mismatches against the reference."""
    errors = []
    for case in range(3):
        inputs = [make_input(500 + case, r, 1000, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        if rank in late:
            time.sleep(0.3)
        dist.all_reduce(t)
        errors.append(mismatch(f"late allreduce {case}", t, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]
