"""Every collective on CPU tensors, world sizes 1-4, against float64 references."""
import hashlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import torch_hca
from node_cases import (all_to_all_of_any_sizes, exchanged_in_place, expanded_inputs, inputs_among_outputs,
                        shaped_wholes)
from harness import SMALL_CHUNKS, group_kind, raises, run_ranks
from reference import (DTYPES, FLOATS, MOVED_ONLY, OPS, all_gather_single, make_input,
                       mismatch, rank_device, reduce_reference, reduce_scatter_single, supported)

WORLD_SIZES = [1, 2, 3, 4]
CONFIGS = {
    "hierarchical_copy": [dict(num_packs=n) for n in (0, 1, 2, 7, 5000)],
    "reduce_to_one_device": [dict(), dict(reduce_to_device=-1)],  # -1: the last rank
    "direct": [dict(), dict(num_packs=3)],
}
SIZES = [1, 13, 1000]
BIG = 70_001  # > 65536 bytes for every dtype wider than one byte


def _options(algorithm, config, world):
    config = dict(config)
    if config.get("reduce_to_device") == -1:
        config["reduce_to_device"] = world - 1
    return torch_hca.Options(algorithm, **config)


def _digest(t):
    return hashlib.sha1(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _allreduce_matrix(rank, world, algorithm, device):
    dev = rank_device(device, rank)
    errors, digests, case = [], {}, 0
    for config in CONFIGS[algorithm]:
        group = dist.new_group(backend="hca", pg_options=_options(algorithm, config, world))
        for dtype in DTYPES:
            for op in OPS:
                if not supported(dtype, op):
                    continue
                sizes = SIZES + ([BIG] if dtype in (torch.float32, torch.bfloat16, torch.int64) else [])
                for numel in sizes:
                    case += 1
                    inputs = [make_input(case, r, numel, dtype, op) for r in range(world)]
                    t = inputs[rank].to(dev, copy=True)
                    dist.all_reduce(t, op=OPS[op], group=group)
                    name = f"{config} {dtype} {op} numel={numel}"
                    errors.append(mismatch(name, t, reduce_reference(inputs, op), world))
                    digests[name] = _digest(t)
    return [e for e in errors if e], digests


@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_allreduce_every_op_dtype_and_packing(world, algorithm, device):
    results = run_ranks(_allreduce_matrix, world, algorithm, device, env=SMALL_CHUNKS)
    for errors, _ in results:
        assert errors == []
    # Everybody copies the leader's result, or (direct) sums the same inputs in rank order: all ranks
    # hold the same bits.
    assert all(digests == results[0][1] for _, digests in results)


def _batch(rank, world, device):
    """A packed batch of mixed dtypes and sizes, zero-element tensors included."""
    dev = rank_device(device, rank)
    errors = []
    specs = [(torch.float32, 13), (torch.int64, 7), (torch.float32, 0), (torch.bfloat16, 1001), (torch.float32, 5),
             (torch.float64, 40_000), (torch.int32, 1)]
    for case, num_packs in enumerate([0, 1, 3, 100]):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(num_packs=num_packs))
        inputs = [[make_input(100 + case * 10 + i, r, n, d, "SUM") for i, (d, n) in enumerate(specs)]
                  for r in range(world)]
        mine = [t.to(dev, copy=True) for t in inputs[rank]]
        torch_hca.batch_allreduce(mine, group=group)
        for i, t in enumerate(mine):
            want = reduce_reference([inputs[r][i] for r in range(world)], "SUM")
            errors.append(mismatch(f"num_packs={num_packs} tensor {i}", t, want, world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_batch_allreduce_mixed_dtypes(world, device):
    assert run_ranks(_batch, world, device, env=SMALL_CHUNKS) == [[]] * world


def test_a_ring_of_three_slots(device):
    """Slots reused as a ring of three (not two): every round waits for the right peers."""
    env = {**SMALL_CHUNKS, "TORCH_HCA_SHM_SLOTS": "3", "TORCH_HCA_CUDA_SLOTS": "3"}
    assert run_ranks(_batch, 3, device, env=env) == [[]] * 3


def _rooted(rank, world, device):
    """broadcast from every src, reduce to every dst, allgather, reduce_scatter, barrier."""
    dev = rank_device(device, rank)
    errors, case = [], 1000
    for algorithm in ("hierarchical_copy", "reduce_to_one_device", "direct"):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, num_packs=2))
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
            for numel in (1, 1001, BIG):
                for root in range(world):
                    case += 2
                    op = "SUM" if dtype in FLOATS else ("SUM", "BXOR", "BAND", "BOR")[root % 4]  # integers: bitwise too
                    inputs = [make_input(case, r, numel, dtype, op).to(dev) for r in range(world)]
                    t = inputs[rank].clone()
                    dist.broadcast(t, src=root, group=group)
                    errors.append(mismatch(f"broadcast {algorithm} {dtype} {numel} src={root}", t, inputs[root], world))
                    t = inputs[rank].clone()
                    dist.reduce(t, dst=root, op=OPS[op], group=group)
                    want = reduce_reference(inputs, op) if rank == root else inputs[rank]
                    errors.append(mismatch(f"reduce {algorithm} {dtype} {op} {numel} dst={root}", t, want, world))
                outs = [torch.empty(numel, dtype=dtype, device=dev) for _ in range(world)]
                dist.all_gather(outs, inputs[rank], group=group)
                for r in range(world):
                    errors.append(mismatch(f"all_gather {dtype} {numel} from {r}", outs[r], inputs[r], world))
                flat = torch.empty(numel * world, dtype=dtype, device=dev)
                all_gather_single(flat, inputs[rank], group=group)
                errors.append(mismatch(f"all_gather_into_tensor {dtype} {numel}", flat, torch.cat(inputs), world))
                if dtype in FLOATS:
                    big = [make_input(case + 1, r, numel * world, dtype, "SUM").to(dev) for r in range(world)]
                    out = torch.empty(numel, dtype=dtype, device=dev)
                    reduce_scatter_single(out, big[rank], op=dist.ReduceOp.AVG, group=group)
                    want = reduce_reference(big, "AVG")[rank * numel:(rank + 1) * numel]
                    errors.append(mismatch(f"reduce_scatter_tensor {dtype} {numel}", out, want, world))
        dist.barrier(group=group)
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_broadcast_reduce_allgather_reduce_scatter(world, device):
    assert run_ranks(_rooted, world, device, env=SMALL_CHUNKS) == [[]] * world


def _uneven_lists(rank, world, device):
    """all_gather and reduce_scatter in their list forms with a size of its own for each rank's part,
    as NCCL takes them (gloo takes reduce_scatter's): a part of no elements, one over many staging
    rounds. Ranks that disagree on the sizes are told so."""
    dev = rank_device(device, rank)
    sizes = [1001, 0, BIG, 3][:world]
    starts = [sum(sizes[:j]) for j in range(world)]
    errors, case = [], 3000
    for algorithm in ("hierarchical_copy", "reduce_to_one_device", "direct"):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, num_packs=2))
        for dtype, op in ((torch.float32, "SUM"), (torch.bfloat16, "AVG"), (torch.int64, "MAX"), (torch.int32, "BXOR")):
            case += 2
            parts = [make_input(case, r, sizes[r], dtype, op).to(dev) for r in range(world)]
            outs = [torch.empty(n, dtype=dtype, device=dev) for n in sizes]
            dist.all_gather(outs, parts[rank], group=group)
            for r in range(world):
                errors.append(mismatch(f"all_gather {algorithm} {dtype} from {r}", outs[r], parts[r], world))
            whole = [make_input(case + 1, r, sum(sizes), dtype, op).to(dev) for r in range(world)]
            out = torch.empty(sizes[rank], dtype=dtype, device=dev)
            dist.reduce_scatter(out, list(whole[rank].split(sizes)), op=OPS[op], group=group)
            want = reduce_reference(whole, op)[starts[rank]:starts[rank] + sizes[rank]]
            errors.append(mismatch(f"reduce_scatter {algorithm} {dtype} {op}", out, want, world))
    if world > 1:
        # Each rank's own part matches its tensor, but the ranks' lists differ: both calls refused.
        group = dist.new_group(backend="hca")
        mine = [2, 3 + rank] + [1] * (world - 2)
        outs = [torch.empty(n, device=dev) for n in mine]
        message = raises(lambda: dist.all_gather(outs, torch.ones(mine[rank], device=dev), group=group),
                         dist.DistBackendError)
        errors.append(None if "mismatched calls" in message and "Float[2+3" in message else message)
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_list_forms_with_a_size_per_rank(world, device):
    assert run_ranks(_uneven_lists, world, device, env=SMALL_CHUNKS) == [[]] * world


def _odd_shapes(rank, world, device):
    """Non-contiguous views, multi-dimensional, zero-element and async use with futures."""
    dev = rank_device(device, rank)
    errors = []
    base = [make_input(5, r, 6 * 7, torch.float32, "SUM").reshape(6, 7).to(dev) for r in range(world)]
    view = base[rank].clone().t()  # non-contiguous
    dist.all_reduce(view)
    errors.append(mismatch("transposed view", view, reduce_reference([b.t() for b in base], "SUM"), world))
    # Views of other shapes, async: each in place once wait() returns.
    cube = [make_input(6, r, 4 * 5 * 6, torch.float64, "SUM").reshape(4, 5, 6).to(dev) for r in range(world)]
    views = [lambda t: t[:, ::2], lambda t: t.permute(2, 0, 1), lambda t: t[1:3, :, 1::3]]
    owned = [view_of(cube[rank].clone()) for view_of in views]
    pending = [dist.all_reduce(v, async_op=True) for v in owned]
    for k, (view_of, v, work) in enumerate(zip(views, owned, pending)):
        work.wait()
        errors.append(mismatch(f"async view {k}", v, reduce_reference([view_of(c) for c in cube], "SUM"), world))
    # A view whose elements share memory is refused before anything moves (every rank passes one).
    message = raises(lambda: dist.all_reduce(torch.ones(1, 4, device=dev).expand(3, 4)), ValueError)
    errors.append(None if "whose elements share memory" in message else message)
    empty = torch.empty(0, 3, device=dev)
    dist.all_reduce(empty)
    errors.append(None if empty.shape == (0, 3) else "empty tensor changed shape")
    works, tensors = [], []
    for i in range(5):
        t = make_input(50 + i, rank, 333, torch.float64, "SUM").to(dev)
        tensors.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    futures = [w.get_future() for w in works]
    torch.futures.wait_all(futures)
    for i, (w, f) in enumerate(zip(works, futures)):
        want = reduce_reference([make_input(50 + i, r, 333, torch.float64, "SUM") for r in range(world)], "SUM")
        errors.append(mismatch(f"async {i}", tensors[i], want, world))
        errors.append(mismatch(f"future value {i}", f.value()[0], want, world))
        errors.append(None if w.is_completed() and w.wait() else f"work {i} not completed")
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "name": "x" * rank})
    errors.append(None if objects == [{"rank": r, "name": "x" * r} for r in range(world)] else f"objects {objects}")
    box = [{"from": rank}] if rank == world - 1 else [None]
    dist.broadcast_object_list(box, src=world - 1)
    errors.append(None if box == [{"from": world - 1}] else f"broadcast_object_list {box}")
    return [e for e in errors if e]


def _coalescing_manager(rank, world, device):
    """torch's coalescing manager routes a run of all_reduce calls to allreduce_coalesced, then
    waits on the Work that ends the window (startCoalescing/endCoalescing), not on that call's."""
    dev = rank_device(device, rank)
    errors = []
    for async_ops in (True, False):
        inputs = [[make_input(70 + i, r, n, torch.float32, "SUM") for i, n in enumerate((10, 1, 5000))]
                  for r in range(world)]
        mine = [t.to(dev, copy=True) for t in inputs[rank]]
        with dist._coalescing_manager(device=dev, async_ops=async_ops) as cm:
            for t in mine:
                dist.all_reduce(t)
        if async_ops:
            # The Work that ends the window stands for the window's calls: on a GPU, waiting on a
            # Work of its own would leave the caller's stream unordered after them.
            ended = [x.data_ptr() for w in cm.works for x in w.result()]
            errors.append(None if ended == [t.data_ptr() for t in mine] else f"the window's Work holds {ended}")
            cm.wait()
        for i, t in enumerate(mine):
            want = reduce_reference([inputs[r][i] for r in range(world)], "SUM")
            errors.append(mismatch(f"coalesced async={async_ops} {i}", t, want, world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 3])
def test_coalescing_manager(world, device):
    assert run_ranks(_coalescing_manager, world, device) == [[]] * world


def _window_of_several_calls(rank, world, device):
    """Calls torch does not batch (broadcast, reduce) issued inside the coalescing manager: the
    Work that ends the window stands for all of them, its Future for each one's."""
    dev = rank_device(device, rank)
    inputs = [make_input(60 + r, r, 1001, torch.float32, "SUM") for r in range(world)]
    sent = inputs[rank].to(dev, copy=True)
    reduced = inputs[rank].to(dev, copy=True)
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        dist.broadcast(sent, src=world - 1)
        dist.reduce(reduced, dst=0)
    errors = []
    ended = [x.data_ptr() for w in cm.works for x in w.result()]
    errors.append(None if ended == [sent.data_ptr(), reduced.data_ptr()] else f"the window's Work holds {ended}")
    futures = cm.works[0].get_future().wait()
    errors.append(None if len(futures) == 2 and all(f.done() for f in futures) else f"its Future gave {futures}")
    cm.wait()
    errors.append(mismatch("broadcast in the window", sent, inputs[world - 1], world))
    if rank == 0:
        errors.append(mismatch("reduce in the window", reduced, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 3])
def test_a_coalescing_window_of_several_calls(world, device):
    assert run_ranks(_window_of_several_calls, world, device) == [[]] * world


def _unclosed_window(rank, world, device):
    """A coalescing window torch never closes (an exception inside its manager leaves it open):
    the calls after it still run, and those that finished are not kept alive by the window."""
    import weakref
    dev = rank_device(device, rank)
    group = dist.distributed_c10d._get_default_group()
    group._start_coalescing(dev)
    alive, errors = [], []
    for i in range(200):
        t = make_input(80 + i, 0, 100, torch.float32, "SUM").to(dev) if rank == 0 else torch.zeros(100, device=dev)
        dist.broadcast(t, src=0)
        errors.append(mismatch(f"broadcast {i}", t, make_input(80 + i, 0, 100, torch.float32, "SUM"), world))
        alive.append(weakref.ref(t))
        del t
    kept = sum(r() is not None for r in alive)
    errors.append(None if kept <= 64 else f"the open window keeps {kept} of 200 finished calls' tensors")
    group._end_coalescing(dev).wait()
    return [e for e in errors if e]


def test_an_unclosed_coalescing_window_keeps_no_finished_call(device):
    assert run_ranks(_unclosed_window, 2, device) == [[]] * 2


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_views_empty_async_and_objects(world, device):
    assert run_ranks(_odd_shapes, world, device) == [[]] * world


def _async_order(rank, world, device):
    """Async calls on one tensor, waited on in any order (a wait may run its Work itself, a blocking
    call may come between): they still run in call order, so MAX, SUM, AVG, SUM give world^2 * max."""
    dev = rank_device(device, rank)
    errors = []
    inputs = [make_input(90, r, 1000, torch.float64, "SUM") for r in range(world)]
    want = reduce_reference(inputs, "MAX") * world * world
    for order in ("first at once, rest reversed", "reversed", "blocking call between"):
        t = inputs[rank].to(dev, copy=True)
        works = [dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)]
        if order == "first at once, rest reversed":
            works[0].wait()
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            works.append(dist.all_reduce(t, op=op, async_op=True))
        if order == "blocking call between":
            other = inputs[rank].to(dev, copy=True)
            dist.all_reduce(other)
            errors.append(mismatch(f"{order}: the blocking call", other, reduce_reference(inputs, "SUM"), world))
            works[2].wait()
        for w in reversed(works):
            w.wait()
        errors.append(mismatch(order, t, want, world))
        errors.append(None if all(w.is_completed() for w in works) else f"{order}: a work not completed")
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_async_calls_waited_in_any_order(world, device):
    assert run_ranks(_async_order, world, device) == [[]] * world


def _unwaited_call(rank, world, device):
    """An async call nobody waits on still runs, also right after calls whose waiters ran them
    (then the worker is not woken for a new call, and must find it by itself)."""
    dev = rank_device(device, rank)
    inputs = [make_input(92, r, 1000, torch.float64, "SUM") for r in range(world)]
    errors = []
    for waited_before in (0, 3):
        for _ in range(waited_before):
            scratch = inputs[rank].to(dev, copy=True)
            dist.all_reduce(scratch, async_op=True).wait()
        t = inputs[rank].to(dev, copy=True)
        work = dist.all_reduce(t, async_op=True)
        deadline = time.monotonic() + 10
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not work.is_completed():
            errors.append(f"after {waited_before} waited calls: not completed in 10 s without wait()")
        work.wait()
        errors.append(mismatch(f"after {waited_before} waited calls", t, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_an_async_call_nobody_waits_on_still_runs(world, device):
    assert run_ranks(_unwaited_call, world, device) == [[]] * world


def _wait_with_a_timeout(rank, world, device):
    """Work.wait(timeout) on an async call whose last rank comes late gives control back with an
    error instead of running the call to its end; a plain wait() then completes it."""
    dev = rank_device(device, rank)
    # Not the group's first call: on a stream transport that one blocks until every rank is there
    # (the self-test; NCCL's first call blocks likewise, making its communicator).
    dist.all_reduce(torch.ones(1, device=dev))
    inputs = [make_input(91, r, 100, torch.float64, "SUM") for r in range(world)]
    t = inputs[rank].to(dev, copy=True)
    if rank == world - 1:
        time.sleep(1.5)
    work = dist.all_reduce(t, async_op=True)
    errors = []
    if rank == 0:
        try:
            work.wait(timeout=timedelta(milliseconds=200))
            errors.append("wait(timeout=200 ms) returned although the last rank had not called yet")
        except RuntimeError as e:
            errors.append(None if "timed out" in str(e).lower() else f"unexpected error: {e}")
    work.wait()
    errors.append(mismatch("after the late rank", t, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3])
def test_wait_with_a_timeout_returns_within_it(world, device):
    assert run_ranks(_wait_with_a_timeout, world, device) == [[]] * world


PREMUL_CONFIGS = [("hierarchical_copy", dict(num_packs=1)), ("hierarchical_copy", dict(num_packs=2)),
                  ("reduce_to_one_device", dict()), ("direct", dict(num_packs=2))]


def _premul_sum(rank, world, device, configs):
    """PREMUL_SUM (dist._make_nccl_premul_sum, FSDP2's gradient divide with NCCL): each rank's input
    times the factor, summed; against float64 references."""
    dev = rank_device(device, rank)
    premul = dist._make_nccl_premul_sum
    errors, case = [], 900
    for algorithm, config in configs:
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, **config))
        for dtype in sorted(FLOATS, key=str):
            for factor in (0.25, 1.0 / world, torch.tensor([0.5], dtype=torch.float64, device=dev)):
                f = float(factor) if isinstance(factor, torch.Tensor) else factor
                case += 1
                name = f"{algorithm} {config} {dtype} factor={f}"
                inputs = [make_input(case, r, 1003, dtype, "SUM") for r in range(world)]
                t = inputs[rank].to(dev, copy=True)
                dist.all_reduce(t, op=premul(factor), group=group)
                want = sum(x.double() * f for x in inputs).to(dtype)
                errors.append(mismatch(f"all_reduce {name}", t, want, world))
                # reduce: dst's tensor takes the result, the others' stay as given (as NCCL's)
                dst = case % world
                t = inputs[rank].to(dev, copy=True)
                dist.reduce(t, dst, op=premul(factor), group=group)
                errors.append(mismatch(f"reduce to {dst} {name}", t, want if rank == dst else inputs[rank], world))
                # reduce_scatter: the input stays the caller's, unscaled
                chunks = [make_input(case + 1000, r, 7 * world, dtype, "SUM") for r in range(world)]
                inp, out = chunks[rank].to(dev, copy=True), torch.empty(7, dtype=dtype, device=dev)
                reduce_scatter_single(out, inp, op=premul(factor), group=group)
                want = sum(x.double() * f for x in chunks)[7 * rank:7 * (rank + 1)].to(dtype)
                errors.append(mismatch(f"reduce_scatter {name}", out, want, world))
                errors.append(mismatch(f"reduce_scatter's input {name}", inp, chunks[rank], world))
        # Two async calls on one tensor: the second scales what the first wrote, in its turn.
        inputs = [make_input(case + 2000, r, 300_007, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].to(dev, copy=True)
        works = [dist.all_reduce(t, op=premul(0.5), group=group, async_op=True) for _ in range(2)]
        for w in works:
            w.wait()
        want = (sum(x.double() for x in inputs) * 0.25 * world).float()
        errors.append(mismatch(f"two async {algorithm} {config}", t, want, world))
    ints = raises(lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op=premul(2.0)), ValueError)
    passthrough = None
    if ("nccl", dict(num_packs=2)) in configs:
        nccl = dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl"))
        passthrough = raises(lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op=premul(2.0),
                                                     group=nccl), ValueError)
    # No rank leaves while another still connects the nccl group's gloo engine (seen under load).
    dist.barrier()
    return [e for e in errors if e], ints, passthrough


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_premul_sum(world, device):
    # The nccl pass-through: gloo's engine sums and hca scales after; NCCL (several ranks on one GPU
    # aside) would take PREMUL_SUM itself.
    configs = PREMUL_CONFIGS + ([("nccl", dict(num_packs=2))] if device != "cuda" else [])
    for errors, ints, passthrough in run_ranks(_premul_sum, world, device, configs, env=SMALL_CHUNKS):
        assert errors == []
        assert "ReduceOp.PREMUL_SUM is not supported for int32 (floating dtypes only)" in ints, ints
        if device != "cuda":
            assert "hca allreduce: ReduceOp.PREMUL_SUM is not supported for int32 (floating dtypes only)" in passthrough


@pytest.mark.parametrize("nodes", ["aab", "abab"])
def test_premul_sum_across_nodes(nodes):
    """Each rank multiplies its own tensors before the stages sum them (FSDP2's gradient divide)."""
    env = [{**SMALL_CHUNKS, "TORCH_HCA_NODE_ID": node} for node in nodes]
    configs = [("hierarchical_copy", dict(num_packs=2)), ("reduce_to_one_device", dict())]
    for errors, ints, _ in run_ranks(_premul_sum, len(nodes), "cpu", configs, env_per_rank=env):
        assert errors == []
        assert "ReduceOp.PREMUL_SUM is not supported for int32 (floating dtypes only)" in ints, ints


# The plans whose last reducer folds every input at once. hierarchical_copy's groups of 2 at 4 ranks
# store their partial sums in the dtype first: one rounding per reduce step, as documented.
AVG_CONFIGS = [("reduce_to_one_device", dict()), ("direct", dict(num_packs=2))]
ONE_STEP_HIERARCHY = [("hierarchical_copy", dict(num_packs=1)), ("hierarchical_copy", dict(num_packs=3))]


def _exact_halves(case, rank, numel, dtype):
    """Multiples of 1/16 with as many significant bits as `dtype` holds: exact in it, and four of them
    add up exactly in float32, so that a sum's rounding can only come from storing it."""
    bits = 8 if dtype == torch.bfloat16 else 11
    g = torch.Generator().manual_seed(case * 7919 + rank)
    return (torch.randint(-(1 << bits) + 1, 1 << bits, (numel,), generator=g).double() / 16).to(dtype)


def _avg_of_halves(rank, world, device):
    """AVG of fp16/bf16 divides before it rounds: each element is the exact mean, rounded once."""
    dev = rank_device(device, rank)
    errors, case = [], 1900
    for algorithm, config in AVG_CONFIGS + (ONE_STEP_HIERARCHY if world <= 3 else []):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, **config))
        for dtype in (torch.float16, torch.bfloat16):
            for numel in (1003, BIG):
                case += 1
                inputs = [_exact_halves(case, r, numel * world, dtype) for r in range(world)]
                want = (sum(x.double() for x in inputs) / world).to(dtype)
                t = inputs[rank].to(dev, copy=True)
                dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
                name = f"{algorithm} {config} {dtype} numel={numel}"
                errors.append(mismatch(f"all_reduce {name}", t, want, 1, exact=True))
                out = torch.empty(numel, dtype=dtype, device=dev)
                reduce_scatter_single(out, inputs[rank].to(dev), op=dist.ReduceOp.AVG, group=group)
                errors.append(mismatch(f"reduce_scatter {name}", out, want[numel * rank:numel * (rank + 1)], 1,
                                       exact=True))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_avg_of_half_dtypes_rounds_once(world, device):
    assert run_ranks(_avg_of_halves, world, device, env=SMALL_CHUNKS) == [[]] * world


def _moved_only(rank, world, device):
    """float8/float4 tensors (FSDP2's float8 all-gathers) through every collective that moves data,
    every byte checked; the reductions refuse them, and the group goes on."""
    dev, errors, refusals = rank_device(device, rank), [], []
    root = world - 1

    def check(what, got, want):
        errors.append(mismatch(what, got, want, 1))

    for case, dtype in enumerate(MOVED_ONLY, start=2100):
        for numel in (1, BIG):
            inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
            name = f"{dtype} numel={numel}"
            t = inputs[rank].to(dev, copy=True)
            dist.broadcast(t, src=root)
            check(f"broadcast {name}", t, inputs[root])
            flat = torch.empty(numel * world, dtype=dtype, device=dev)
            all_gather_single(flat, inputs[rank].to(dev))
            check(f"all_gather_single {name}", flat, torch.cat(inputs))
            outs = [torch.empty(numel, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(outs, inputs[rank].to(dev))
            for r in range(world):
                check(f"all_gather [{r}] {name}", outs[r], inputs[r])
            gathered = [torch.empty(numel, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
            dist.gather(inputs[rank].to(dev), gathered, dst=root)
            for r in range(world if rank == root else 0):
                check(f"gather [{r}] {name}", gathered[r], inputs[r])
            pieces = [make_input(case + 50, j, numel, dtype, "SUM") for j in range(world)]
            out = torch.empty(numel, dtype=dtype, device=dev)
            dist.scatter(out, [p.to(dev) for p in pieces] if rank == root else None, src=root)
            check(f"scatter {name}", out, pieces[rank])
            # all_to_all: rank i sends j + 1 rows of numel to rank j
            rows = [make_input(case + 100, r, numel * world * (world + 1) // 2, dtype, "SUM") for r in range(world)]
            starts = [numel * j * (j + 1) // 2 for j in range(world)]
            got = torch.empty(numel * (rank + 1) * world, dtype=dtype, device=dev)
            dist.all_to_all_single(got, rows[rank].to(dev), output_split_sizes=[numel * (rank + 1)] * world,
                                   input_split_sizes=[numel * (j + 1) for j in range(world)])
            check(f"all_to_all {name}", got,
                  torch.cat([rows[r][starts[rank]:starts[rank] + numel * (rank + 1)] for r in range(world)]))
            received = torch.empty(numel, dtype=dtype, device=dev)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs[rank].to(dev), (rank + 1) % world),
                                            dist.P2POp(dist.irecv, received, (rank - 1) % world)])
            for work in works:
                work.wait()
            check(f"isend/irecv {name}", received, inputs[(rank - 1) % world])
        t = inputs[rank].to(dev, copy=True)
        refusals.append(raises(lambda: dist.all_reduce(t), TypeError))
        refusals.append(raises(lambda: reduce_scatter_single(torch.empty(1, dtype=dtype, device=dev),
                                                             torch.empty(world, dtype=dtype, device=dev)), TypeError))
        refusals.append(raises(lambda: dist.reduce(t, dst=root, op=dist.ReduceOp.MAX), TypeError))
    ones = torch.ones(5, device=dev)
    dist.all_reduce(ones)  # the refused calls started nothing
    errors.append(mismatch("all_reduce after the refusals", ones, torch.full((5,), float(world)), 1, exact=True))
    return [e for e in errors if e], refusals


@pytest.mark.parametrize("world", [1, 2, 3])
def test_float8_tensors_are_moved_not_reduced(world, device):
    for errors, refusals in run_ranks(_moved_only, world, device, env=SMALL_CHUNKS):
        assert errors == []
        assert len(refusals) == 3 * len(MOVED_ONLY)
        for msg, dtype in zip(refusals, [d for d in MOVED_ONLY for _ in range(3)]):
            name = str(dtype).replace("torch.f", "F")
            assert f"dtype {name} is not supported in reductions" in msg and "all_gather" in msg, msg


def _nans_win(rank, world, device, algorithms=("hierarchical_copy", "reduce_to_one_device", "direct", "nccl")):
    """MAX and MIN with a NaN on one rank, in turn on each: the result is NaN there, wherever the
    NaN comes from in the reduction's order, as torch.amax/amin have it (a kernel that kept its
    accumulator unless the next value compared greater dropped a NaN that came second: a NaN
    loss on one rank vanished; so does stock gloo, which carries the pass-through's CPU calls and
    the exchange among nodes' leaders). The other elements exact."""
    dev = rank_device(device, rank)
    errors = []
    n = 3 * world + 1000  # a NaN at rank e % world in elements e < 2 * world, finite values after
    for algorithm in algorithms:
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, num_packs=2))
        for case, dtype in enumerate((torch.float32, torch.float64, torch.bfloat16, torch.float16)):
            inputs = [make_input(1300 + case, r, n * world, dtype, "MAX") for r in range(world)]
            for r, t in enumerate(inputs):
                t.view(world, n)[:, r:2 * world:world] = float("nan")  # in every rank's part
            for op in ("MAX", "MIN"):
                stacked = torch.stack(inputs)
                want = stacked.amax(0) if op == "MAX" else stacked.amin(0)
                got = inputs[rank].to(dev, copy=True)
                dist.all_reduce(got, op=OPS[op], group=group)
                errors.append(_nan_mismatch(f"all_reduce {algorithm} {dtype} {op}", got, want))
                out = torch.empty(n, dtype=dtype, device=dev)
                reduce_scatter_single(out, inputs[rank].to(dev), op=OPS[op], group=group)
                errors.append(_nan_mismatch(f"reduce_scatter_tensor {algorithm} {dtype} {op}", out,
                                            want[rank * n:(rank + 1) * n]))
                out = torch.empty(n, dtype=dtype, device=dev)
                dist.reduce_scatter(out, list(inputs[rank].to(dev).chunk(world)), op=OPS[op], group=group)
                errors.append(_nan_mismatch(f"reduce_scatter {algorithm} {dtype} {op}", out,
                                            want[rank * n:(rank + 1) * n]))
                out = torch.empty(n, dtype=dtype, device=dev)
                with dist._coalescing_manager(group=group, device=dev):
                    reduce_scatter_single(out, inputs[rank].to(dev), op=OPS[op], group=group)
                errors.append(_nan_mismatch(f"coalesced reduce_scatter_tensor {algorithm} {dtype} {op}", out,
                                            want[rank * n:(rank + 1) * n]))
                got = inputs[rank].to(dev, copy=True)
                dist.reduce(got, dst=world - 1, op=OPS[op], group=group)
                if rank == world - 1:
                    errors.append(_nan_mismatch(f"reduce {algorithm} {dtype} {op}", got, want))
    return [e for e in errors if e]


def _nan_mismatch(what, got, want):
    got = got.cpu()
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        where = [t.nonzero().flatten().tolist()[:8] for t in (torch.isnan(got), nan)]
        return f"{what}: NaN at {where[0]}, want {where[1]}"
    return None if torch.equal(got[~nan], want[~nan]) else f"{what}: the elements without a NaN differ"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_nan_on_any_rank_wins_max_and_min(world, device):
    assert run_ranks(_nans_win, world, device, env=SMALL_CHUNKS) == [[]] * world


@pytest.mark.parametrize("nodes", ["aab", "abab"])
def test_a_nan_on_any_rank_wins_max_and_min_across_nodes(nodes):
    env = [{**SMALL_CHUNKS, "TORCH_HCA_NODE_ID": node} for node in nodes]
    assert run_ranks(_nans_win, len(nodes), "cpu", ("hierarchical_copy", "reduce_to_one_device"),
                     env_per_rank=env) == [[]] * len(nodes)


def _forms_nccl_takes(rank, world):
    return shaped_wholes(rank, world) + all_to_all_of_any_sizes(rank, world)


@pytest.mark.parametrize("where", ["default", "nccl", "2 nodes"])
def test_forms_that_nccl_takes_and_gloo_does_not(where):
    """Whole tensors of any shape with the parts' elements, all_to_all lists of any sizes: under the
    pass-through and across nodes gloo got them as given and refused them."""
    world = 4 if where == "2 nodes" else 3
    assert run_ranks(_forms_nccl_takes, world, **group_kind(where)) == [[]] * world


def _inputs_only_read(rank, world):
    return expanded_inputs(rank, world) + exchanged_in_place(rank, world) + inputs_among_outputs(rank, world)


@pytest.mark.parametrize("where", ["default", "nccl", "2 nodes"])
def test_inputs_the_call_only_reads(where):
    """Inputs whose elements share memory, all-to-alls in place, inputs among the outputs: inputs read
    as they were before the call wrote anything, never written back."""
    world = 4 if where == "2 nodes" else 3
    assert run_ranks(_inputs_only_read, world, **group_kind(where)) == [[]] * world
