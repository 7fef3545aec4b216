"""The nccl algorithm: hca's packing in front of the stock engine (gloo for CPU tensors)."""
import pytest
import torch
import torch.distributed as dist

import torch_hca
from harness import NCCL_SHARED_GPU_ENV, nccl_fits, raises, run_ranks, shared_mappings
from node_cases import (ddp_hca_and_gloo, empty_tensors, forwarded_ops, fsdp2_hca_and_gloo, mismatched_calls,
                        messages_through_gloo, strided_engine_ops)
from reference import (OPS, all_gather_single, make_input, mismatch, rank_device, reduce_reference,
                       reduce_scatter_single, supported)

# (dtype, numel): mixed dtypes in one batch, small and large, a zero-element tensor.
SPECS = [(torch.float32, 13), (torch.int64, 7), (torch.float32, 0), (torch.float64, 1001), (torch.float32, 5),
         (torch.float16, 300), (torch.float32, 20_000), (torch.int32, 1), (torch.float64, 3)]
TINY = [(torch.float32, 3), (torch.int64, 2), (torch.float64, 4)]
PACKINGS = {  # name: (options, batch)
    "num_packs=1": (dict(num_packs=1), SPECS),
    "num_packs=3": (dict(num_packs=3), SPECS),
    "more packs than elements": (dict(num_packs=20), TINY),
    "aggregate small": (dict(num_packs=0, agg_small_grads_max_bytes=4096, agg_small_grads_max_group=3), SPECS),
    "no packing": (dict(num_packs=0), SPECS),
}


def _batches(rank, world, device="cpu"):
    dev = rank_device(device, rank)
    errors, case = [], 0
    for name, (packing, batch) in PACKINGS.items():
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl", **packing))
        # BXOR of CUDA tensors is refused (NCCL has no bitwise ops): test_what_nccl_lacks_is_refused
        for op in ("SUM", "AVG", "MAX") + (("BXOR",) if dev.type == "cpu" else ()):
            specs = [(d, n) for d, n in batch if supported(d, op)]
            case += 1
            inputs = [[make_input(case * 100 + i, r, n, d, op) for i, (d, n) in enumerate(specs)] for r in range(world)]
            mine = [t.to(dev, copy=True) for t in inputs[rank]]
            torch_hca.batch_allreduce(mine, op=OPS[op], group=group)
            for i, t in enumerate(mine):
                want = reduce_reference([inputs[r][i] for r in range(world)], op)
                errors.append(mismatch(f"{name} {op} tensor {i} {t.dtype}", t, want, world))
        t = make_input(999, rank, 777, torch.float32, "SUM").to(dev)
        dist.all_reduce(t, group=group)  # one tensor through the plain entry point
        errors.append(mismatch(f"{name} all_reduce", t, reduce_reference(
            [make_input(999, r, 777, torch.float32, "SUM") for r in range(world)], "SUM"), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_packing_branch_against_reference(world):
    assert run_ranks(_batches, world) == [[]] * world


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_packing_branch_on_cuda_through_nccl(world):
    """CUDA packs to ProcessGroupNCCL: world 1 anywhere with a GPU, several ranks where NCCL
    accepts them (a GPU each, or NCCL 2.30+ sharing one)."""
    if not nccl_fits(world):
        pytest.skip("needs a CUDA device and NCCL that accepts these ranks")
    assert run_ranks(_batches, world, "cuda", env=NCCL_SHARED_GPU_ENV) == [[]] * world


def _forwarded(rank, world):
    """Everything but allreduce goes straight to the engine (float8 as bytes, which gloo moves)."""
    errors = forwarded_ops(rank, world, dist.group.WORLD, 11, to_oneself=False)  # gloo refuses those
    eights = [make_input(6, r, 100, torch.float8_e4m3fn, "SUM") for r in range(world)]
    inputs = [make_input(5, r, 100, torch.float32, "SUM") for r in range(world)]
    for moved in (inputs, eights):
        t = moved[rank].clone()
        dist.broadcast(t, src=world - 1)
        errors.append(mismatch(f"broadcast {t.dtype}", t, moved[world - 1], world))
        outs = [torch.empty(100, dtype=t.dtype) for _ in range(world)]
        dist.all_gather(outs, moved[rank])
        errors += [mismatch(f"all_gather {r} {t.dtype}", outs[r], moved[r], world) for r in range(world)]
        flat = torch.empty(100 * world, dtype=t.dtype)
        all_gather_single(flat, moved[rank])
        errors.append(mismatch(f"all_gather_single {t.dtype}", flat, torch.cat(moved), world))
    # Slots of different sizes (as gloo and NCCL take them): each rank's output is its own slot.
    slots = [[make_input(12, q * world + r, r + 3, torch.float32, "SUM") for r in range(world)] for q in range(world)]
    for op in ("SUM", "AVG"):
        out = torch.zeros(rank + 3)
        dist.reduce_scatter(out, slots[rank], op=OPS[op])
        errors.append(mismatch(f"reduce_scatter {op}, slots of different sizes", out,
                               reduce_reference([slots[q][rank] for q in range(world)], op), world))
    # An all_gather into slots of different sizes (gloo's refuses them): async, and in place
    mine = [make_input(13, r, 2 * r + 1, torch.float32, "SUM") for r in range(world)]
    outs = [torch.zeros(2 * r + 1) for r in range(world)]
    dist.all_gather(outs, mine[rank], async_op=True).wait()
    errors += [mismatch(f"all_gather slot {r} of {2 * r + 1}", outs[r], mine[r], world) for r in range(world)]
    outs = [mine[r].clone() if r == rank else torch.zeros(2 * r + 1) for r in range(world)]
    dist.all_gather(outs, outs[rank])
    errors += [mismatch(f"all_gather in place, slot {r}", outs[r], mine[r], world) for r in range(world)]
    for dst in range(world):  # a non-root's tensor stays as given, as with NCCL (gloo wrote in it)
        t = inputs[rank].clone()
        dist.reduce(t, dst=dst)
        want = reduce_reference(inputs, "SUM") if rank == dst else inputs[rank]
        errors.append(mismatch(f"reduce to {dst}{'' if rank == dst else ', kept by a non-root'}", t, want, world))
    dist.barrier()
    ops = torch_hca.AllReduceCrossDeviceOps("nccl", num_packs=2)
    summed = ops.batch_reduce("mean", [(inputs[rank], None), (inputs[rank][:7], None)])
    errors.append(mismatch("tf mean", summed[0], reduce_reference(inputs, "AVG"), world))
    errors.append(mismatch("tf mean slice", summed[1], reduce_reference([x[:7] for x in inputs], "AVG"), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_other_collectives_reach_the_engine(world):
    assert run_ranks(_forwarded, world, pg_options=torch_hca.Options("nccl")) == [[]] * world


def _views_and_a_receive_into_one(rank, world):
    refused = raises(lambda: dist.irecv(torch.zeros(8)[::2], (rank + 1) % world), ValueError)
    return strided_engine_ops(rank, world, premul=True), refused


@pytest.mark.parametrize("world", [1, 2, 3])
def test_views_that_are_not_contiguous_reach_the_engine_as_copies(world):
    for wrong, refused in run_ranks(_views_and_a_receive_into_one, world, pg_options=torch_hca.Options("nccl")):
        assert wrong == []
        assert refused.startswith("hca recv: a non-contiguous CPU tensor (sizes [4], strides [2]) to receive into"), \
            refused


@pytest.mark.parametrize("world", [1, 3])
def test_empty_tensors_reach_the_engine(world):
    assert run_ranks(empty_tensors, world, pg_options=torch_hca.Options("nccl")) == [[]] * world


def _mismatched_calls_and_where_agreed(rank, world, odd_ranks):
    return mismatched_calls(rank, world, odd_ranks), dist.group.WORLD._get_backend(torch.device("cpu")).agreements


@pytest.mark.parametrize("world, where", [(2, "one node"), (3, "one node"), (4, "2 nodes")])
def test_ranks_that_disagree_on_a_call_all_raise_before_gloo_gets_it(world, where):
    """Other sizes, dtypes or calls on the last rank: gloo would abort the process (all_reduce,
    reduce, all-gathers, gather), write a broadcast short, or wait until its timeout and close its
    connections. Every rank raises "mismatched calls" within seconds, and the group goes on. The
    ranks of one node agree through its shared memory, those of several nodes through gloo."""
    env = [{"TORCH_HCA_NODE_ID": node} for node in "abab"] if where == "2 nodes" else None
    agreed = "gloo" if where == "2 nodes" else "shared memory"
    assert run_ranks(_mismatched_calls_and_where_agreed, world, [world - 1], pg_options=torch_hca.Options("nccl"),
                     pg_timeout_s=30, env_per_rank=env) == [([], agreed)] * world


def _dies_or_waits_for_a_dead_peer(rank, world, timeout_s):
    """Rank 1 leaves its process while the others agree on an all_reduce (or wait to)."""
    import os
    import time

    dist.barrier()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
        return "no error"
    except dist.DistBackendError as e:
        took = time.monotonic() - start
        return None if "rank 1" in str(e) and "died" in str(e) and took < timeout_s / 3 else f"{took:.1f} s: {e}"


def _agreements_ended(rank, world):
    """A pass-through group agrees on an all_reduce, then rank 1 aborts it while rank 0 waits
    for the next agreement; a second group is destroyed after a checked all_reduce. What rank 0
    raised, how long it took, and the shared mappings before, with and after the second group."""
    import time

    aborted = dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl"))
    dist.all_reduce(torch.ones(2), group=aborted)
    dist.barrier()
    seen = None
    if rank == 1:
        time.sleep(0.5)
        aborted._get_backend(torch.device("cpu")).abort()
    elif rank == 0:
        start = time.monotonic()
        seen = (raises(lambda: dist.all_reduce(torch.ones(2), group=aborted), dist.DistBackendError),
                time.monotonic() - start)
    dist.barrier()
    mappings = [shared_mappings()]
    kept = dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl"))
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=kept)
    mappings.append(shared_mappings())
    dist.barrier()
    dist.destroy_process_group(kept)
    mappings.append(shared_mappings())
    return seen, mappings, t.tolist()


def test_an_abort_reaches_peers_waiting_to_agree_and_a_shutdown_lets_go_of_the_shared_memory():
    results = run_ranks(_agreements_ended, 3, pg_timeout_s=60)
    message, took = results[0][0]
    assert "rank 1 aborted its process group" in message and took < 20, (message, took)
    for seen, (before, during, after), t in results:
        assert t == [6.0] * 5 and during > before and after == before, (t, before, during, after)


@pytest.mark.parametrize("world", [2, 3])
def test_a_peer_that_died_is_named_at_once(world):
    """Where the ranks agree through shared memory, a rank waiting there for a peer whose process
    is gone names it at once (gloo's own error, from the agreement through it, named no rank:
    "Connection reset by peer")."""
    results = run_ranks(_dies_or_waits_for_a_dead_peer, world, 60, pg_options=torch_hca.Options("nccl"),
                        pg_timeout_s=60, allow_missing=[1])
    assert [r for i, r in enumerate(results) if i != 1] == [None] * (world - 1), results


@pytest.mark.parametrize("world", [2, 3])
def test_receives_get_their_messages_however_many_are_posted_and_misfits_raise(world):
    """A receive its message does not fit raises and the channel goes on; receives posted ahead
    from one sender and tag each get their own message (gloo gave a second one the first one's
    bytes as its description, and aborted)."""
    options = torch_hca.Options("nccl")
    assert run_ranks(messages_through_gloo, world, pg_options=options, pg_timeout_s=30) == [[]] * world


def _ddp_and_fsdp2_beside_gloo(rank, world):
    ddp, fsdp2 = ddp_hca_and_gloo(rank, world), fsdp2_hca_and_gloo(rank, world)
    return [all(torch.equal(a, b) for a, b in zip(*run)) for run in (ddp, fsdp2)]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_and_fsdp2_match_gloo_bit_for_bit(world):
    """DDP (its async bucket all-reduces and their futures) and FSDP2 (all_gather_into_tensor,
    reduce_scatter_tensor) through the pass-through's queue, where every CPU call is agreed on
    before gloo gets it: the same parameters as over gloo itself, bit for bit."""
    env = {"TORCH_HCA_ALGORITHM": "nccl"}
    assert run_ranks(_ddp_and_fsdp2_beside_gloo, world, env=env) == [[True, True]] * world


# Dtypes gloo neither moves nor reduces ("Invalid scalar type"), as torch names them: hca moves
# them through gloo as views of a dtype of their width (test_dtypes.py), and refuses their reductions.
NOT_FOR_GLOO = {torch.int16: "Short", torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64"}


def _refused_before_the_engine(rank, world):
    """What gloo cannot take gets hca's own error, as under the other algorithms, before gloo sees
    it: gloo says only "Invalid scalar type", and an AVG of integers it sums, then fails to divide,
    and leaves the sums in the tensors. A message to oneself, which gloo refuses, is named as such."""
    msgs = {}
    for dtype, name in NOT_FOR_GLOO.items():
        t = torch.ones(4 * world, dtype=dtype)
        calls = {
            "all_reduce": lambda: dist.all_reduce(t),
            "reduce": lambda: dist.reduce(t, dst=0),
            "reduce_scatter_single": lambda: reduce_scatter_single(torch.empty(4, dtype=dtype), t),
            "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(4, dtype=dtype), list(t.chunk(world))),
        }
        for call, fn in calls.items():
            msgs[f"{call} {name}"] = (raises(fn, TypeError),
                                      f"dtype {name} is not reduced where a stock engine carries the reduction")
    eight = torch.ones(2 * world).to(torch.float8_e4m3fn)
    for call, fn in {"reduce": lambda: dist.reduce(eight, dst=0),
                     "reduce_scatter_single": lambda: reduce_scatter_single(torch.empty(2).to(eight.dtype), eight),
                     }.items():
        msgs[f"{call} float8"] = (raises(fn, TypeError), "dtype Float8_e4m3fn is not supported in reductions")
    ints = torch.full((2 * world,), rank + 1, dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)
    for call, fn in {"reduce": lambda: dist.reduce(ints, dst=0, op=dist.ReduceOp.AVG),
                     "reduce_scatter_single": lambda: reduce_scatter_single(out, ints, op=dist.ReduceOp.AVG),
                     "reduce_scatter": lambda: dist.reduce_scatter(out, list(ints.chunk(world)), op=dist.ReduceOp.AVG),
                     }.items():
        msgs[f"{call} AVG int32"] = (raises(fn, ValueError), "ReduceOp.AVG is not supported for int32")
    floats = torch.full((2 * world,), float(rank + 1))
    float_out = torch.zeros(2)
    for op in ("BAND", "BOR", "BXOR"):  # gloo: a RuntimeError that names no dtype
        for call, fn in {"all_reduce": lambda: dist.all_reduce(floats, op=OPS[op]),
                         "reduce": lambda: dist.reduce(floats, dst=0, op=OPS[op]),
                         "reduce_scatter_single": lambda: reduce_scatter_single(float_out, floats, op=OPS[op]),
                         "reduce_scatter": lambda: dist.reduce_scatter(float_out, list(floats.chunk(world)), op=OPS[op]),
                         }.items():
            msgs[f"{call} {op} float32"] = (raises(fn, ValueError), f"ReduceOp.{op} is not supported for float32")
    for call, fn, expected in (  # as hca's own algorithms name them, at the call (gloo: its own RuntimeError)
            ("all_gather_single of the wrong size",
             lambda: all_gather_single(torch.zeros(world * 6 + 1), torch.ones(6)),
             f"the output has {world * 6 + 1} elements, expected {world * 6}"),
            ("reduce_scatter_single of the wrong size", lambda: reduce_scatter_single(torch.zeros(6), torch.ones(5)),
             f"the input has 5 elements, expected {world * 6}")):
        msgs[call] = (raises(fn, ValueError), expected)
    msgs["all_to_all of two dtypes"] = (  # the group's own call: torch's all_to_all checks dtypes first
        raises(lambda: dist.group.WORLD.alltoall([torch.zeros(2, dtype=torch.float64)] * world,
                                                 [torch.ones(2)] * world), TypeError),
        "an output tensor has dtype Double but the first input has Float")
    if world > 1:  # slots of different sizes, every rank's input fitting none (so the ranks agree on the call)
        msgs["all_gather of inputs that fit no slot"] = (
            raises(lambda: dist.all_gather([torch.zeros(r + 1) for r in range(world)], torch.ones(world + 1)),
                   ValueError),
            f"hca allgather: this rank's output tensor has {rank + 1} elements, expected {world + 1}")
    own = torch.ones(3)  # gloo would fail with "Pair is not connected"
    for call, fn in {"isend to itself": lambda: dist.isend(own, rank),
                     "irecv from itself": lambda: dist.irecv(own, rank)}.items():
        msgs[call] = (raises(fn, NotImplementedError), f"a message of CPU tensors from rank {rank} to itself: gloo")
    untouched = (torch.equal(ints, torch.full((2 * world,), rank + 1, dtype=torch.int32)) and not out.any()
                 and torch.equal(floats, torch.full((2 * world,), float(rank + 1))) and not float_out.any())
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)  # nothing was started: the group goes on
    return msgs, untouched, t.tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_what_gloo_cannot_take_gets_hcas_error_first(world):
    for msgs, untouched, summed in run_ranks(_refused_before_the_engine, world, pg_options=torch_hca.Options("nccl")):
        for call, (msg, expected) in msgs.items():
            assert expected in msg and not msg.startswith("UNEXPECTED"), (call, msg)
        assert untouched
        assert summed == [world * (world + 1) / 2] * 3


def _bitwise_of_cuda_tensors(rank, world):
    t = torch.full((4,), rank + 1, dtype=torch.int32, device=rank_device("cuda", rank))
    message = raises(lambda: dist.all_reduce(t, op=dist.ReduceOp.BXOR), ValueError)
    dist.all_reduce(t)  # refused before NCCL saw it: the group goes on
    return message, t.tolist()


@pytest.mark.parametrize("world", [1, 2])
def test_what_nccl_lacks_is_refused(world):
    """BAND, BOR and BXOR of CUDA tensors would reach NCCL, which has none: hca's ValueError first."""
    if not nccl_fits(world):
        pytest.skip("needs a CUDA device and NCCL that accepts these ranks")
    for message, summed in run_ranks(_bitwise_of_cuda_tensors, world, pg_options=torch_hca.Options("nccl"),
                                     env=NCCL_SHARED_GPU_ENV):
        assert 'ReduceOp.BXOR of CUDA tensors is not supported with algorithm="nccl"' in message, message
        assert summed == [world * (world + 1) / 2] * 4


def _after_the_engine(rank, world):
    """AVG and PREMUL_SUM: gloo sums and hca divides or scales after. An async call then a call on
    the same tensor: the second must see the first's division, not the engine's bare sum (at
    be511c3 it did not: the engine started the second call before hca had divided)."""
    errors = []
    for op, scale in ((dist.ReduceOp.AVG, 1.0 / world), (dist._make_nccl_premul_sum(0.5), 0.5)):
        inputs = [make_input(30, r, 100_003, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        first = dist.all_reduce(t, op=op, async_op=True)
        dist.all_reduce(t, op=op)  # blocking: returns with both done
        first.wait()
        want = (sum(x.double() for x in inputs) * scale * world * scale).float()
        errors.append(mismatch(f"two calls {op}", t, want, world))
        t = inputs[rank].clone()
        first = dist.all_reduce(t, op=op, async_op=True)
        dist.broadcast(t, src=0)  # another op the engine takes at once
        first.wait()
        errors.append(mismatch(f"then broadcast {op}", t, (sum(x.double() for x in inputs) * scale).float(), world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_after_an_averaging_call_sees_its_result(world):
    assert run_ranks(_after_the_engine, world, pg_options=torch_hca.Options("nccl", num_packs=2)) == [[]] * world


@pytest.mark.parametrize("world", [1, 3])
def test_the_coalescing_manager_through_the_engine(world):
    """The window's Work (startCoalescing/endCoalescing) stands for the engine's calls in it."""
    from test_collectives import _coalescing_manager
    assert run_ranks(_coalescing_manager, world, "cpu", pg_options=torch_hca.Options("nccl")) == [[]] * world


def test_tf_style_argument_check():
    with pytest.raises(ValueError, match="all_reduce_alg"):
        torch_hca.AllReduceCrossDeviceOps(all_reduce_alg="ring")
    with pytest.raises(ValueError, match="num_packs"):
        torch_hca.AllReduceCrossDeviceOps(num_packs=-2)
