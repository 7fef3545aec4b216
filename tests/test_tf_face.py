"""The tf.distribute face with TensorFlow's signatures, mapped onto ranks: reduce, batch_reduce and
broadcast with destinations, ReductionToOneDevice's accumulation_fn, CommunicationOptions (ours and a
stand-in for TensorFlow's), the ReduceOp names, and the errors TensorFlow documents; 1-4 ranks,
against references computed with torch alone."""
import enum
import re
import time

import pytest
import torch
import torch.distributed as dist

import torch_hca
from harness import raises, run_ranks
from reference import make_input, mismatch, reduce_reference
from torch_hca import CommunicationOptions, ReduceOp

WORLD_SIZES = [1, 2, 3, 4]


def _destination_sets(world):
    return [None, world - 1, [0], list(range(world)), [r for r in range(world) if r % 2 == 0]]


def _wanted(rank, destinations, world, value):
    ranks = range(world) if destinations is None else [destinations] if isinstance(destinations, int) else destinations
    return value if rank in ranks else None


def _check(name, got, want, world):
    if want is None:
        return None if got is None else f"{name}: got a tensor on a rank outside the destinations"
    return f"{name}: got None on a destination" if got is None else mismatch(name, got, want, world)


def _signatures(rank, world):
    """reduce, batch_reduce and broadcast of every class, with TensorFlow's argument names."""
    errors = []
    every = [[make_input(30 + i, r, n, torch.float32, "SUM") for r in range(world)] for i, n in enumerate((5, 300, 1))]
    mine = [e[rank] for e in every]
    originals = [m.clone() for m in mine]
    objects = [torch_hca.HierarchicalCopyAllReduce(num_packs=2), torch_hca.ReductionToOneDevice(),
               torch_hca.ReductionToOneDevice(reduce_to_device=world - 1), torch_hca.AllReduceCrossDeviceOps("nccl")]
    for ops in objects:
        label = f"{type(ops).__name__}({ops.options.reduce_to_device})"
        for destinations in _destination_sets(world):
            for op, ref in ((ReduceOp.SUM, "SUM"), ("mean", "AVG"), (dist.ReduceOp.SUM, "SUM")):
                got = ops.reduce(reduce_op=op, per_replica_value=mine[1], destinations=destinations, options=None)
                want = _wanted(rank, destinations, world, reduce_reference(every[1], ref))
                errors.append(_check(f"{label} reduce {op} to {destinations}", got, want, world))
        # pairs 0 and 2 share one destination (one packed reduce), 1 and 3 others
        pairs = [(mine[0], world - 1), (mine[1], None), (mine[2], world - 1), (mine[1], [0])]
        got = ops.batch_reduce(reduce_op=ReduceOp.MEAN, value_destination_pairs=pairs)
        for i, ((value, destinations), which) in enumerate(zip(pairs, (0, 1, 2, 1))):
            want = _wanted(rank, destinations, world, reduce_reference(every[which], "AVG"))
            errors.append(_check(f"{label} batch_reduce pair {i}", got[i], want, world))
        got = ops.broadcast(tensor=mine[1], destinations=[world - 1])
        errors.append(_check(f"{label} broadcast", got, _wanted(rank, [world - 1], world, every[1][0]), world))
    errors += [None if torch.equal(m, o) else "an input was changed" for m, o in zip(mine, originals)]
    return [e for e in errors if e]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_tensorflows_signatures_on_ranks(world):
    assert run_ranks(_signatures, world) == [[]] * world


def _accumulation(rank, world):
    """accumulation_fn on the reducing rank: an elementwise max and a weighted sum (MEAN divides
    after it); a function returning the wrong shape or dtype is a ValueError on every rank, and the
    object goes on."""
    every = [make_input(50, r, 257, torch.float64, "SUM") for r in range(world)]
    errors = []
    largest = torch_hca.ReductionToOneDevice(accumulation_fn=lambda xs: torch.stack(xs).amax(0))
    got = largest.reduce(ReduceOp.SUM, every[rank], destinations=None)
    errors.append(mismatch("max", got, torch.stack(every).amax(0), world))
    weighted = torch_hca.ReductionToOneDevice(reduce_to_device=world - 1,
                                              accumulation_fn=lambda xs: sum((i + 1) * x for i, x in enumerate(xs)))
    want = sum((r + 1) * every[r] for r in range(world))
    got = weighted.batch_reduce("mean", [(every[rank], 0), (every[rank], None)])
    errors.append(_check("weighted mean to 0", got[0], _wanted(rank, 0, world, want / world), world))
    errors.append(_check("weighted mean to all", got[1], want / world, world))
    messages = {}
    for name, fn in (("shape", lambda xs: xs[0][:3]), ("dtype", lambda xs: xs[0].float()),
                     ("raises", lambda xs: 1 / 0)):
        bad = torch_hca.ReductionToOneDevice(accumulation_fn=fn)
        messages[name] = raises(lambda: bad.reduce("sum", every[rank]), ValueError)
    errors.append(mismatch("after the errors", largest.reduce("sum", every[rank]), torch.stack(every).amax(0), world))
    return [e for e in errors if e], messages


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_accumulation_fn_runs_on_the_reducing_rank(world):
    for errors, messages in run_ranks(_accumulation, world):
        assert errors == []
        assert "accumulation_fn on rank 0 failed: ValueError: returned Tensor of shape (3,) and dtype " \
               "torch.float64, expected a tensor of shape (257,)" in messages["shape"], messages
        assert "dtype torch.float32, expected a tensor of shape (257,) and dtype torch.float64" in messages["dtype"]
        assert "ZeroDivisionError: division by zero" in messages["raises"], messages


class _Implementation(enum.Enum):  # TensorFlow's CommunicationImplementation, as duck-typing meets it
    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class _TFCommunicationOptions:
    def __init__(self, bytes_per_pack=0, timeout_seconds=None, implementation=_Implementation.AUTO):
        self.bytes_per_pack, self.timeout_seconds, self.implementation = bytes_per_pack, timeout_seconds, implementation


def _packed_by_bytes(rank, world):
    """bytes_per_pack sets the call's packs (as explain shows them), TensorFlow's own object too;
    results stay right; implementation NCCL runs the pass-through."""
    every = [[make_input(60 + i, r, n, torch.float32, "SUM") for r in range(world)] for i, n in enumerate((1000, 24))]
    ops = torch_hca.HierarchicalCopyAllReduce(num_packs=1)
    found, errors = {}, []
    for label, options in (("ours", CommunicationOptions(bytes_per_pack=1024)),
                           ("tf's", _TFCommunicationOptions(bytes_per_pack=1024, implementation=_Implementation.NCCL))):
        chosen = ops.options_for([e[rank] for e in every], options)
        plan = str(torch_hca.explain(world, chosen.algorithm, chosen.num_packs, numels=[1000, 24]))
        found[label] = (chosen.algorithm, chosen.num_packs, len(re.findall(r"^pack \d+ ", plan, re.M)))
        got = ops.batch_reduce("sum", [(e[rank], None) for e in every], options=options)
        errors += [mismatch(f"{label} {i}", g, reduce_reference(e, "SUM"), world) for i, (g, e) in enumerate(zip(got, every))]
    return found, [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 3])
def test_bytes_per_pack_sets_the_packs_explain_shows(world):
    for found, errors in run_ranks(_packed_by_bytes, world):
        assert errors == []
        packs = -(-(1000 + 24) * 4 // 1024)  # ceil: 4 packs
        assert found["ours"] == ("hierarchical_copy", packs, packs if world > 1 else found["ours"][2]), found
        assert found["tf's"][:2] == ("nccl", packs), found


def _timeout(rank, world):
    """timeout_seconds bounds the call's waits: rank 1 comes 3 s late to a 1 s call."""
    ops = torch_hca.HierarchicalCopyAllReduce()
    ops.reduce("sum", torch.ones(4))  # the group made, on every rank
    if rank == 1:
        time.sleep(3)
    start = time.monotonic()
    message = raises(lambda: ops.reduce("sum", torch.ones(4), options=CommunicationOptions(timeout_seconds=1)),
                     RuntimeError)
    return message, time.monotonic() - start


def test_timeout_seconds_bounds_the_call():
    message, seconds = run_ranks(_timeout, 2)[0]
    assert "Timed out after 1000 ms" in message and seconds < 2.5, (message, seconds)


def _errors(rank, world):
    ops = torch_hca.HierarchicalCopyAllReduce()
    t = torch.ones(3)
    return {
        "empty batch": raises(lambda: ops.batch_reduce("sum", []), ValueError),
        "not pairs": raises(lambda: ops.batch_reduce("sum", [t, t]), ValueError),
        "a pair of three": raises(lambda: ops.batch_reduce("sum", [(t, None, 0)]), ValueError),
        "destination outside": raises(lambda: ops.reduce("sum", t, destinations=world), ValueError),
        "no destinations": raises(lambda: ops.reduce("sum", t, destinations=[]), ValueError),
        "reduce op": raises(lambda: ops.reduce("max", t), ValueError),
        "bytes_per_pack": raises(lambda: CommunicationOptions(bytes_per_pack=-1), ValueError),
        "implementation": raises(lambda: CommunicationOptions(implementation="mpi"), ValueError),
        "accumulation_fn": raises(lambda: torch_hca.ReductionToOneDevice(accumulation_fn=3), ValueError),
        "still works": mismatch("sum", ops.reduce("sum", t), torch.full((3,), float(world)), world) or "",
    }


def test_what_tensorflow_refuses_is_a_value_error():
    for msgs in run_ranks(_errors, 2):
        assert msgs.pop("still works") == ""
        for name, msg in msgs.items():
            assert not msg.startswith("UNEXPECTED"), (name, msg)
        assert "value_destination_pairs should be a non-empty list" in msgs["empty batch"]
        assert "destinations: expected a rank" in msgs["destination outside"]
        assert "reduce_op: expected 'sum' or 'mean'" in msgs["reduce op"]
