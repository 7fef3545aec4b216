"""Dtypes past gloo's: int16, uint16, uint32 and uint64 moved by every op that moves data and
reduced by hca's own algorithms and across nodes (SUM, PRODUCT, MIN, MAX, bitwise); complex tensors in every
reduction that SUM and AVG define, on every route (shared memory, the stream executor the CUDA
path runs, the pass-through's gloo, across nodes), against references computed with torch alone."""
import pytest
import torch
import torch.distributed as dist

from harness import STREAMS_ENV, group_kind, raises, run_ranks
from reference import (BITWISE, OPS, all_gather_single, make_input, mismatch, reduce_reference,
                       reduce_scatter_single)
from torch_hca.reference import COMPLEX, WIDE_INTS

SIZES = [1, 13, 1000]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
# Where a stock engine carries the whole reduction (the pass-through), the wide integers are moved
# but not reduced; between nodes, the leaders' engine reduces them widened.
ENGINE_ROUTES = {"nccl"}
ROUTES = {"default": {}, "streams": dict(env=STREAMS_ENV), "nccl": group_kind("nccl"),
          "2 nodes": group_kind("2 nodes")}


def _moves(rank, world, dtype, case):
    """Every op that moves data, on `dtype`: what went wrong, as descriptions."""
    errors = []
    for n in SIZES:
        case += 1
        x = [make_input(case, r, n * world, dtype, "SUM") for r in range(world)]
        mine = x[rank].clone()
        dist.broadcast(mine, src=world - 1)
        errors.append(mismatch(f"broadcast {dtype} {n}", mine, x[world - 1], world, exact=True))
        slots = [torch.empty_like(x[rank]) for _ in range(world)]
        dist.all_gather(slots, x[rank])
        errors.append(mismatch(f"all_gather {dtype} {n}", torch.cat(slots), torch.cat(x), world, exact=True))
        flat = torch.empty(n * world * world, dtype=dtype)
        all_gather_single(flat, x[rank])
        errors.append(mismatch(f"all_gather_single {dtype} {n}", flat, torch.cat(x), world, exact=True))
        gathered = [torch.empty_like(x[rank]) for _ in range(world)] if rank == 0 else None
        dist.gather(x[rank], gathered, dst=0)
        if rank == 0:
            errors.append(mismatch(f"gather {dtype} {n}", torch.cat(gathered), torch.cat(x), world, exact=True))
        part = torch.empty(n, dtype=dtype)
        dist.scatter(part, list(x[0].chunk(world)) if rank == 0 else None, src=0)
        errors.append(mismatch(f"scatter {dtype} {n}", part, x[0].chunk(world)[rank], world, exact=True))
        swapped = torch.empty_like(x[rank])
        dist.all_to_all_single(swapped, x[rank])
        want = torch.cat([x[r].chunk(world)[rank] for r in range(world)])
        errors.append(mismatch(f"all_to_all_single {dtype} {n}", swapped, want, world, exact=True))
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, list(x[rank].chunk(world)))
        errors.append(mismatch(f"all_to_all {dtype} {n}", torch.cat(outs), want, world, exact=True))
        if world > 1:
            got = torch.empty_like(x[rank])
            ops = [dist.P2POp(dist.isend, x[rank], (rank + 1) % world),
                   dist.P2POp(dist.irecv, got, (rank - 1) % world)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            errors.append(mismatch(f"send/recv {dtype} {n}", got, x[(rank - 1) % world], world, exact=True))
    return errors


def _reductions(rank, world, dtype, op, case):
    """all_reduce, reduce, reduce_scatter_single and the list reduce_scatter of `op` on `dtype`."""
    errors = []
    for n in SIZES:
        case += 1
        x = [make_input(case, r, n * world, dtype, op) for r in range(world)]
        want = reduce_reference(x, op)
        mine = x[rank].clone()
        dist.all_reduce(mine, op=OPS[op])
        errors.append(mismatch(f"all_reduce {dtype} {op} {n}", mine, want, world))
        mine = x[rank].clone()
        dist.reduce(mine, dst=world - 1, op=OPS[op])
        errors.append(mismatch(f"reduce {dtype} {op} {n}", mine, want if rank == world - 1 else x[rank], world))
        out = torch.empty(n, dtype=dtype)
        reduce_scatter_single(out, x[rank].clone(), op=OPS[op])
        errors.append(mismatch(f"reduce_scatter_single {dtype} {op} {n}", out, want.chunk(world)[rank], world))
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, list(x[rank].clone().chunk(world)), op=OPS[op])
        errors.append(mismatch(f"reduce_scatter {dtype} {op} {n}", out, want.chunk(world)[rank], world))
    return errors


def _premul_sum(rank, world, dtype, case):
    """PREMUL_SUM of complex tensors: the factor times the sum, in all_reduce and reduce."""
    x = [make_input(case, r, 6 * world, dtype, "SUM") for r in range(world)]
    want = reduce_reference(x, "SUM") * 0.5
    mine = x[rank].clone()
    dist.all_reduce(mine, op=dist._make_nccl_premul_sum(0.5))
    errors = [mismatch(f"all_reduce {dtype} PREMUL_SUM", mine, want, world)]
    mine = x[rank].clone()
    dist.reduce(mine, dst=0, op=dist._make_nccl_premul_sum(0.5))
    errors.append(mismatch(f"reduce {dtype} PREMUL_SUM", mine, want if rank == 0 else x[rank], world))
    return errors


def _refusals(rank, world, route):
    """What no route reduces names the dtype or the op, at the call, and the group goes on."""
    z = torch.ones(2 * world, dtype=torch.complex64)
    msgs = {}
    for op in ("MIN", "MAX", "PRODUCT"):
        msgs[f"reduce complex {op}"] = raises(lambda: dist.reduce(z.clone(), dst=0, op=OPS[op]), ValueError)
        msgs[f"reduce_scatter complex {op}"] = raises(
            lambda: reduce_scatter_single(torch.empty(2, dtype=z.dtype), z.clone(), op=OPS[op]), ValueError)
    if route in ENGINE_ROUTES:
        for dtype in WIDE_INTS:
            msgs[f"all_reduce {dtype}"] = raises(lambda: dist.all_reduce(torch.ones(3, dtype=dtype)), TypeError)
    t = torch.ones(3)
    dist.all_reduce(t)
    msgs["still works"] = "" if torch.equal(t, torch.full((3,), float(world))) else f"UNEXPECTED {t}"
    return msgs


def _every_case(rank, world, route):
    errors, case = [], 0
    for dtype in WIDE_INTS + COMPLEX:
        errors += _moves(rank, world, dtype, case)
        case += 100
    for dtype in WIDE_INTS if route not in ENGINE_ROUTES else []:
        for op in INT_OPS:
            errors += _reductions(rank, world, dtype, op, case)
            case += 100
    for dtype in COMPLEX:
        for op in ("SUM", "AVG"):
            errors += _reductions(rank, world, dtype, op, case)
            case += 100
        if route != "nccl":  # gloo has no PREMUL_SUM; the pass-through scales floating dtypes only
            errors += _premul_sum(rank, world, dtype, case)
            case += 100
    return [e for e in errors if e], _refusals(rank, world, route)


@pytest.mark.parametrize("route,world", [("default", 1), ("default", 2), ("default", 3), ("default", 4),
                                         ("streams", 2), ("streams", 3), ("nccl", 2), ("nccl", 3), ("2 nodes", 4)])
def test_wide_integers_and_complex_on_every_route(route, world):
    for errors, msgs in run_ranks(_every_case, world, route, **ROUTES[route]):
        assert errors == []
        assert msgs.pop("still works") == "", msgs
        for name, msg in msgs.items():
            if "complex" in name:
                op = name.split()[-1]
                assert f"ReduceOp.{op} is not supported for ComplexFloat" in msg, (name, msg)
            else:
                assert "is not reduced where a stock engine carries the reduction" in msg, (name, msg)


def _of(values, dtype):
    """`values` (Python ints in the dtype's range) as a tensor of `dtype`, through their bits."""
    bits = torch.iinfo(dtype).bits
    signed = [v - 2**bits if v > 2**(bits - 1) - 1 else v for v in values]  # the same bits, as a signed int
    carrier = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
    return torch.tensor(signed, dtype=carrier).view(dtype)


def _ints(t):
    """A tensor of a wide integer dtype as Python ints (uint64 through its bits)."""
    if t.dtype != torch.uint64:
        return t.tolist()
    return [v + 2**64 if v < 0 else v for v in t.view(torch.int64).tolist()]


def _near_the_top(dtype, rank):
    """Every rank near the dtype's top (a sum wraps), and, for MIN and MAX, odd ranks' values with
    the top bit set where even ranks' are small (a signed order would pick the wrong one)."""
    info = torch.iinfo(dtype)
    top = 2**info.bits - 1 if not dtype.is_signed else info.max
    high = 2**(info.bits - 1) + rank if not dtype.is_signed else info.min + rank
    return [top - rank, high if rank % 2 else rank + 1, rank + 1]


def _wrapping(rank, world):
    """Sums wrap around as the dtype does (modulo 2**bits); MIN and MAX follow the dtype's order."""
    got = {}
    for dtype in WIDE_INTS:
        for op in ("SUM", "MIN", "MAX"):
            t = _of(_near_the_top(dtype, rank), dtype)
            dist.all_reduce(t, op=OPS[op])
            got[f"{dtype} {op}"] = _ints(t)
    return got


@pytest.mark.parametrize("route,world", [("default", 2), ("default", 3), ("2 nodes", 4)])
def test_wide_integer_sums_wrap_around_as_the_dtype(route, world):
    for got in run_ranks(_wrapping, world, **ROUTES[route]):
        for dtype in WIDE_INTS:
            info = torch.iinfo(dtype)
            columns = list(zip(*(_near_the_top(dtype, r) for r in range(world))))
            wrapped = [sum(c) % 2**info.bits for c in columns]
            wrapped = [w - 2**info.bits if w > info.max else w for w in wrapped]
            assert got[f"{dtype} SUM"] == wrapped, (dtype, got)
            assert got[f"{dtype} MIN"] == [min(c) for c in columns], (dtype, got)
            assert got[f"{dtype} MAX"] == [max(c) for c in columns], (dtype, got)
