"""Seeded inputs for every rank, and float64 references computed from them without hca.

The tests, `python -m torch_hca.check` and `python -m torch_hca.bench -c 1` all compare hca's
results with these: each rank regenerates every rank's input from the seed, so that a reference
needs no communication."""
from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
# Integer dtypes gloo neither moves nor reduces, which hca's own algorithms reduce.
WIDE_INTS = [torch.int16, torch.uint16, torch.uint32, torch.uint64]
# Reduced part by part (SUM, AVG, PREMUL_SUM only), as torch's all_reduce has them.
COMPLEX = [torch.complex64, torch.complex128]
# Moved (broadcast, gathers, scatter, all-to-all, messages) but never reduced: compared as bytes.
MOVED_ONLY = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
              torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn); an older torch (2.11 on the GPU machine) has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "PRODUCT": dist.ReduceOp.PRODUCT,
       "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX, "BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR,
       "BXOR": dist.ReduceOp.BXOR}
# Integer and bool dtypes only (as gloo has them; NCCL has none): computed in the dtype itself.
BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def rank_device(device, rank):
    """The torch.device rank `rank` uses for `device`: CUDA ranks share the GPUs round-robin,
    so that 2-4 ranks on one GPU run too."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def supported(dtype, op):
    if op in BITWISE:
        return dtype not in FLOATS
    return op != "AVG" or dtype in FLOATS


def make_input(case, rank, numel, dtype, op):
    """Random non-zero data, in ranges where every op stays exact or representable (MOVED_ONLY
    dtypes, which are never reduced: random bytes, every bit pattern possible, NaNs too)."""
    g = torch.Generator().manual_seed(case * 7919 + rank)
    if dtype in MOVED_ONLY:
        return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8).view(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if op in BITWISE:  # values over the whole range of the dtype, so that every bit takes part
        if dtype == torch.uint64:
            return torch.randint(-2**63, 2**63 - 1, (numel,), generator=g, dtype=torch.int64).view(dtype)
        info = torch.iinfo(dtype)
        wide = info.bits == 64 or info.max > 2**31 - 1
        return torch.randint(info.min, info.max, (numel,), generator=g, dtype=torch.int64 if wide else
                             torch.int32).to(dtype)
    if dtype.is_complex:
        parts = torch.randn(numel, 2, generator=g, dtype=torch.float64) * 3
        return torch.view_as_complex(parts).to(dtype)
    if dtype in FLOATS:
        if op == "PRODUCT":
            x = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 3
        return x.to(dtype)
    lo, hi = (1, 3) if op == "PRODUCT" else (-20 if dtype.is_signed else 1, 21)
    return torch.randint(lo, hi, (numel,), generator=g).to(dtype)


def reduce_reference(inputs, op):
    """float64 reduction of the ranks' inputs (any iterable), cast back to their dtype; one
    rank's input at a time, so that large references take two float64 copies, not world.
    Bitwise ops reduce in the inputs' own dtype (float64 holds no int64 exactly)."""
    if op in BITWISE:
        acc = None
        for t in inputs:
            acc = t.clone() if acc is None else BITWISE[op](acc, t)
        return acc
    acc, count, dtype = None, 0, None
    for t in inputs:
        x, dtype, count = t.to(torch.complex128 if t.is_complex() else torch.float64), t.dtype, count + 1
        if acc is None:
            acc = x.clone()  # to() returns a float64 input itself: never sum into the caller's tensor
        elif op in ("SUM", "AVG"):
            acc += x
        elif op == "PRODUCT":
            acc *= x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == "AVG":
        acc /= count
    if dtype == torch.bool:
        return acc != 0
    return acc.to(dtype)


def tolerance(dtype, world_size):
    if dtype.is_complex:
        return tolerance(dtype.to_real(), world_size)
    if dtype == torch.float16:
        return dict(rtol=2e-3, atol=2e-3 * world_size)
    if dtype == torch.bfloat16:
        return dict(rtol=1.6e-2, atol=1.6e-2 * world_size)
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5 * world_size)
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    return dict(rtol=0, atol=0)


def wrong_elements(got, want, world_size, exact=False):
    """A bool tensor: which elements of `got` differ from `want` beyond the dtype's tolerance (at all
    where `exact`)."""
    got, want = got.cpu(), want.cpu()
    if not (want.dtype.is_floating_point or want.dtype.is_complex):  # in the dtype: float64 holds no int64 exactly
        return (got != want).flatten()
    tol = tolerance(want.dtype, world_size)
    a, b = (torch.view_as_real(t.to(torch.complex128)) if t.is_complex() else t.to(torch.float64) for t in (got, want))
    a, b = a.flatten(), b.flatten()
    bad = ~torch.isclose(a, b, **tol) if (tol["rtol"] or tol["atol"]) and not exact else a != b
    return bad.view(-1, 2).any(1) if want.is_complex() else bad


def mismatch(name, got, want, world_size, exact=False):
    """None if every element of `got` matches `want` (bit for bit where `exact`), else a description."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    if got.dtype in MOVED_ONLY:
        got, want, exact = got.view(torch.uint8), want.view(torch.uint8), True
    bad = wrong_elements(got, want, world_size, exact)
    if bad.any():
        wide = torch.complex128 if got.is_complex() else torch.float64
        a, b = got.to(wide).flatten(), want.to(wide).flatten()  # first bad element by flat index
        i = int(bad.nonzero()[0])
        return f"{name}: {int(bad.sum())} of {got.numel()} elements differ, first at {i}: got {a[i].item()} want {b[i].item()}"
    return None


def collective_reference(op, input_of, rank, world, redop="SUM", root=0):
    """What collective `op` leaves on `rank`, given input_of(r), rank r's input (1-D):
    all_reduce, broadcast (from root), all_gather, reduce_scatter or all_to_all."""
    ranks = range(world)
    if op == "all_reduce":
        return reduce_reference((input_of(r) for r in ranks), redop)
    if op == "broadcast":
        return input_of(root)
    if op == "all_gather":
        return torch.cat([input_of(r) for r in ranks])
    if op == "reduce_scatter":
        return reduce_reference((input_of(r) for r in ranks), redop).chunk(world)[rank]
    if op == "all_to_all":
        return torch.cat([input_of(r).chunk(world)[rank] for r in ranks])
    raise ValueError(f"op: no reference for {op!r}")
