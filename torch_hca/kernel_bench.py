"""`python -m torch_hca.bench --kernels`: hca's data kernels alone, beside torch's own, in one process.

A collective's data operations are copies and sums of k staged inputs into one (k = 2 .. 8: the
ranks of a direct step or of a group); this times them on one device, float32 and bfloat16, beside
torch's `copy_` and `add` on the same tensors. Columns:
  size    bytes of one tensor
  kernel  copy, or sum of k inputs
  time    microseconds per call, the median of batches (CUDA events on a GPU, the host's clock on CPU)
  GB/s    bytes read and written per second: 2 x size for a copy, (k + 1) x size for a sum
  torch   torch's GB/s on the same tensors: `copy_`, and `add` (a sum of 2, 3 x size) for every k
  ratio   hca's GB/s over torch's
  #wrong  elements of hca's result unlike the reference: float32 summed in order, rounded once
On CPU tensors (`--device cpu` or `model`) the kernels are the host's, which the CPU model of the
device runs too; on CUDA tensors those of the CUDA executor, on the current stream.
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import torch

from . import _C

DTYPES = (torch.float32, torch.bfloat16)
SOURCES = range(2, 9)
BATCH_S = 0.01  # each timed batch runs about this long


def _timer(dev):
    """seconds(fn, calls): the time of `calls` calls of fn, by CUDA events on a GPU."""
    if dev.type == "cuda":
        def seconds(fn, calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def seconds(fn, calls):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            return time.perf_counter() - start
    return seconds


def per_call_s(fn, seconds, batches=5):
    """Median seconds per call over `batches` batches of about BATCH_S, after a warm call."""
    one = max(seconds(fn, 1), 1e-7)
    calls = max(1, min(1000, int(BATCH_S / one)))
    return statistics.median(seconds(fn, calls) / calls for _ in range(batches))


def reference_sum(inputs):
    """float32 sums in hca's order, rounded once to the inputs' dtype."""
    acc = inputs[0].float()
    for t in inputs[1:]:
        acc = acc + t.float()
    return acc.to(inputs[0].dtype)


def sweep(dev, sizes, progress=None):
    """Rows: for each dtype and size, the copy and the sums of 2..8 inputs, hca's and torch's."""
    seconds = _timer(dev)
    rows = []
    for dtype in DTYPES:
        for nbytes in sizes:
            n = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
            inputs = [torch.randn(n, device=dev).to(dtype) for _ in range(max(SOURCES))]
            out = torch.empty_like(inputs[0])
            size = n * out.element_size()
            torch_copy = 2 * size / per_call_s(lambda: out.copy_(inputs[0]), seconds)
            torch_add = 3 * size / per_call_s(lambda: torch.add(inputs[0], inputs[1], out=out), seconds)
            out.zero_()
            _C._kernels.copy(out, inputs[0])
            wrong = int((out != inputs[0]).sum())
            t = per_call_s(lambda: _C._kernels.copy(out, inputs[0]), seconds)
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), size=size, kernel="copy", us=t * 1e6,
                             gbps=2 * size / t / 1e9, torch_gbps=torch_copy / 1e9, wrong=wrong))
            for k in SOURCES:
                out.zero_()
                _C._kernels.sum(out, inputs[:k])
                wrong = int((out != reference_sum(inputs[:k])).sum())
                t = per_call_s(lambda: _C._kernels.sum(out, inputs[:k]), seconds)
                rows.append(dict(dtype=str(dtype).removeprefix("torch."), size=size, kernel=f"sum of {k}",
                                 us=t * 1e6, gbps=(k + 1) * size / t / 1e9, torch_gbps=torch_add / 1e9, wrong=wrong))
            if progress:
                progress.update()
            del inputs, out
    return rows


def run(args, sizes, dev):
    """The sweep, printed and written to args.json; returns the wrong elements' count."""
    from tqdm import tqdm

    with tqdm(total=len(DTYPES) * len(sizes), file=sys.stderr, desc="kernels", unit="size", leave=False) as progress:
        rows = sweep(dev, sizes, progress)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "host kernels (the CPU model's too)"
    print(f"# torch_hca.bench --kernels  {dev.type}  {where}  torch {torch.__version__}")
    print(f"{'dtype':>9} {'size':>11} {'kernel':>9} {'time':>10} {'GB/s':>8} {'torch':>8} {'ratio':>6} {'#wrong':>6}")
    for r in rows:
        print(f"{r['dtype']:>9} {r['size']:>11} {r['kernel']:>9} {r['us']:>10.1f} {r['gbps']:>8.1f} "
              f"{r['torch_gbps']:>8.1f} {r['gbps'] / r['torch_gbps']:>6.2f} {r['wrong']:>6}")
    wrong = sum(r["wrong"] for r in rows)
    print(f"\n# {'wrong elements: ' + str(wrong) if wrong else 'every element checked was right'}")
    meta = dict(mode="kernels", device=dev.type, gpu=where if dev.type == "cuda" else None, torch=torch.__version__,
                date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv))
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows, wrong=wrong), f, indent=1)
    print(f"# wrote {args.json}")
    return wrong
