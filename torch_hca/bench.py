"""`python -m torch_hca.bench`: nccl-tests' sweep for torch.distributed, hca beside stock backends.

    python -m torch_hca.bench                          # 2 ranks of its own, all_reduce, 8 B .. 64 MiB
    python -m torch_hca.bench -b 8 -e 256M -f 2 -o all_gather -d bfloat16 --compare gloo
    python -m torch_hca.bench --kernels                # hca's copy and sum kernels beside torch's (kernel_bench.py)
    torchrun --nproc-per-node 4 -m torch_hca.bench -o reduce_scatter --compare nccl,gloo

Columns, as nccl-tests prints them:
  size    bytes of the largest buffer a rank holds: the tensor of all_reduce and broadcast, the
          gathered output of all_gather, the input of reduce_scatter, the buffer of all_to_all
  count   elements: of the tensor; for all_gather, reduce_scatter and all_to_all, of one rank's part
  time    microseconds per call: the median over iterations of the slowest rank's time, a call
          ending when its result is on the host (on CUDA, when the device has finished it)
  algbw   size / time;  busbw: algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather,
          reduce_scatter and all_to_all, x 1 for broadcast
  #wrong  elements, summed over ranks, that differ from a float64 reference built from every
          rank's seeded input (-c 1); the exit status is 1 if any did
  host    microseconds per call that the caller's thread is held, the mean over the timed calls
          of the rank held longest: where the device runs calls after the host (CUDA, the model
          of the device), how far the host runs ahead; with --late-rank R:MS, rank R comes MS
          milliseconds late to every size's timed calls, and the others' host column shows whether
          their threads wait for it (a lockstep) or go on
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from .ranks import launched_by_torchrun, rank_device, run_on_ranks
from .reference import (FLOATS, OPS as REDOPS, all_gather_single, collective_reference, make_input,
                        reduce_scatter_single, wrong_elements)

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
REDUCING = ("all_reduce", "reduce_scatter")
DTYPES = {"float": torch.float32, "float32": torch.float32, "half": torch.float16, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "double": torch.float64, "float64": torch.float64, "int8": torch.int8,
          "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
TYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bf16", torch.float64: "double",
              torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64"}
STOCK = ("gloo", "nccl")
REDOP_NAMES = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}  # nccl-tests' names


def parse_size(text: str) -> int:
    """ "8", "64K", "16M", "1G" -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    suffix = text[-1:].upper()
    return int(text[:-1]) * units[suffix] if suffix in units else int(text)


def size_arg(text: str) -> int:
    """argparse's type of -b and -e: a positive size in bytes, with an optional K, M or G."""
    try:
        size = parse_size(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 8, 64K or 1M, got {text!r}")
    return size


def late_rank_arg(text: str):
    """argparse's type of --late-rank: "R:MS" -> (rank R, MS milliseconds as seconds)."""
    try:
        rank, ms = text.split(":")
        if int(rank) < 0 or float(ms) < 0:
            raise ValueError
        return int(rank), float(ms) / 1e3
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R:MS, a rank and milliseconds such as 1:200, got {text!r}") from None


def int_list_arg(what: str, least=None):
    """An argparse type: "2,3,4" -> [2, 3, 4], each `least` or more where given; else an error that
    says what was expected (`what`, e.g. "rank counts such as 1,2,3")."""
    def parse(text):
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = None
        if values is None or (least is not None and min(values) < least):
            bound = "" if least is None else f", each {least} or more"
            raise argparse.ArgumentTypeError(f"expected {what}{bound}, got {text!r}")
        return values
    return parse


def size_sweep(smallest: int, largest: int, factor: int) -> list:
    """smallest, smallest * factor, ... up to largest; ValueError unless the sizes grow (factor 2 or more)."""
    if factor < 2:
        raise ValueError(f"sizes grow by this factor, so it must be 2 or more, got {factor}")
    sizes = []
    while smallest <= largest:
        sizes.append(smallest)
        smallest *= factor
    return sizes


def bus_factor(op: str, world: int) -> float:
    if op == "broadcast":
        return 1.0
    return (2.0 if op == "all_reduce" else 1.0) * (world - 1) / world


def shapes(op: str, nbytes: int, itemsize: int, world: int):
    """(input numel, output numel, count column, size column) of `op` at about `nbytes`."""
    if op in ("all_reduce", "broadcast"):
        n = max(1, nbytes // itemsize)
        return n, n, n, n * itemsize
    part = max(1, nbytes // itemsize // world)
    total = part * world
    inputs = {"all_gather": part, "reduce_scatter": total, "all_to_all": total}[op]
    outputs = {"all_gather": total, "reduce_scatter": part, "all_to_all": total}[op]
    return inputs, outputs, part, total * itemsize


def call(op, group, inp, out, redop="SUM", root=0):
    """One blocking collective; the tensor that holds this rank's result."""
    if op == "all_reduce":
        dist.all_reduce(inp, op=REDOPS[redop], group=group)
        return inp
    if op == "broadcast":
        dist.broadcast(inp, src=dist.get_global_rank(group, root), group=group)
        return inp
    if op == "all_gather":
        all_gather_single(out, inp, group=group)
    elif op == "reduce_scatter":
        reduce_scatter_single(out, inp, op=REDOPS[redop], group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp, group=group)
    else:
        raise ValueError(f"op: unknown collective {op!r} (expected one of {', '.join(OPS)})")
    return out


def synchronize(dev):
    """The host waits for the caller's stream: CUDA's, or the CPU model's where its host runs ahead."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif os.environ.get("TORCH_HCA_MODEL_RUN_AHEAD") == "1":
        from . import _C

        _C._model.synchronize()


def wrong_count(op, group, dev, dtype, numels, redop, root, seed):
    """Elements of this rank's result that differ from the reference, for seeded inputs."""
    rank, world = group.rank(), group.size()

    def input_of(r):
        return make_input(seed, r, numels[0], dtype, redop)

    result = call(op, group, input_of(rank).to(dev), torch.empty(numels[1], dtype=dtype, device=dev), redop, root)
    synchronize(dev)
    want = collective_reference(op, input_of, rank, world, redop, root)
    return int(wrong_elements(result, want, world).sum())


def median_seconds(fn, iters, warmup, dev, timer_group, late=None):
    """Median seconds per call of the slowest rank, after `warmup` calls, and the mean seconds per
    call the caller's thread was held on the rank held longest. `late`: (rank, seconds) that rank
    sleeps before the timed calls."""
    for _ in range(warmup):
        fn()
    synchronize(dev)
    dist.barrier(group=timer_group)
    if late is not None and late[0] == dist.get_rank():
        time.sleep(late[1])
    samples, held = [], 0.0
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        held += time.perf_counter() - start
        synchronize(dev)
        samples.append(time.perf_counter() - start)
    times = torch.tensor([statistics.median(samples), held / max(iters, 1)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=timer_group)
    return times[0].item(), times[1].item()


def calls_per_batch(modes, slowest, probe, least, batch_s=5e-3):
    """How many back-to-back calls make a batch of about `batch_s` (from `least` to 200), one count
    for every mode (name -> function): the median of the modes' estimates, each timed over `probe`
    calls, the slowest rank's (`slowest(estimates)`: each mode's largest over the ranks). A batch's
    first call absorbs how far apart the ranks left the barrier before it, so a mode given fewer
    calls pays more of that per call: with a count of its own, the first mode probed at the first
    size (its probe cold) got a third of the others' count and looked 3-5 us slower at 3 ranks."""
    estimates = []
    for fn in modes.values():
        start = time.perf_counter()
        for _ in range(probe):
            fn()
        estimates.append((time.perf_counter() - start) / probe)
    count = int(min(200, max(least, batch_s / statistics.median(slowest(estimates)))))
    return dict.fromkeys(modes, count)


def alternating_samples(modes, calls, batches, barrier):
    """Seconds per call of each mode (name -> function) in each of `batches` batches of calls[mode]
    back-to-back calls, this rank's, every batch after a `barrier()` (so that its first call does
    not absorb how far apart the ranks left the last one). The modes' batches alternate, in order
    and then in reverse, so that all see the same moments of a machine whose speed drifts."""
    samples = {mode: [] for mode in modes}
    for batch in range(batches):
        for mode in list(modes)[::1 if batch % 2 == 0 else -1]:
            barrier()
            start = time.perf_counter()
            for _ in range(calls[mode]):
                modes[mode]()
            samples[mode].append((time.perf_counter() - start) / calls[mode])
    return samples


@contextlib.contextmanager
def busy_processes(count):
    """`count` processes that each keep a CPU busy (plain Python spinning), for as long as the block
    runs; yields them (benchmarks and tests of waits beside other busy processes)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def iterations(nbytes: int) -> int:
    """Enough calls for a steady median, fewer as they grow (about 0.2 GB moved per size)."""
    return max(5, min(200, int(2e8 // max(nbytes, 1))))


def measure(label, op, group, sizes, dtype, dev, timer_group, iters=0, warmup=3, check=True, redop="SUM",
            root=0, on_row=None, late=None):
    """nccl-tests' rows for `op` on `group` at every size (bytes); `on_row(row)` as each is measured."""
    world, itemsize = group.size(), torch.empty(0, dtype=dtype).element_size()
    rows = []
    for index, nbytes in enumerate(sizes):
        in_numel, out_numel, count, size = shapes(op, nbytes, itemsize, world)
        wrong = 0
        if check:
            mine = torch.tensor([wrong_count(op, group, dev, dtype, (in_numel, out_numel), redop, root, index)])
            dist.all_reduce(mine, group=timer_group)
            wrong = int(mine.item())
        inp = make_input(index, group.rank(), in_numel, dtype, redop).to(dev)
        out = torch.empty(out_numel, dtype=dtype, device=dev)
        seconds, held = median_seconds(lambda: call(op, group, inp, out, redop, root), iters or iterations(size),
                                       warmup, dev, timer_group, late)
        algbw = size / seconds / 1e9
        rows.append(dict(backend=label, op=op, world_size=world, size=size, count=count, type=TYPE_NAMES[dtype],
                         redop=redop.lower() if op in REDUCING else "none", root=root if op == "broadcast" else -1,
                         time_us=seconds * 1e6, algbw=algbw, busbw=algbw * bus_factor(op, world), wrong=wrong,
                         host_us=held * 1e6))
        if on_row is not None:
            on_row(rows[-1])
    return rows


HEADER = (f"{'size(B)':>12} {'count':>11} {'type':>6} {'redop':>6} {'root':>4} {'time(us)':>10} "
          f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'host(us)':>10}")


def format_row(r) -> str:
    return (f"{r['size']:>12} {r['count']:>11} {r['type']:>6} {r['redop']:>6} {r['root']:>4} {r['time_us']:>10.1f} "
            f"{r['algbw']:>11.3f} {r['busbw']:>11.3f} {r['wrong']:>6} {r.get('host_us', float('nan')):>10.1f}")


def print_table(rows, describe=None, file=None):
    """nccl-tests' table, one block per (backend, op, ranks), then each block's average busbw."""
    file = file or sys.stdout
    blocks = {}
    for r in rows:
        blocks.setdefault((r["backend"], r["op"], r["world_size"]), []).append(r)
    for (backend, op, world), block in blocks.items():
        what = f" ({describe[backend]})" if describe and backend in describe else ""
        print(f"\n# {op}  {backend}{what}  ranks={world}\n{HEADER}", file=file)
        for r in block:
            print(format_row(r), file=file)
        print(f"# avg busbw: {statistics.mean(r['busbw'] for r in block):.3f} GB/s", file=file)


def print_comparison(rows, file=None):
    """Per size: every backend's time, and each stock backend's time over hca's."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    if len(backends) < 2:
        return
    file = file or sys.stdout
    cell = {(r["backend"], r["size"]): r["time_us"] for r in rows}
    others = [b for b in backends if b != "hca"]
    print("\n| size (B) | " + " | ".join(f"{b} (us)" for b in backends) + " | "
          + " | ".join(f"{b} / hca" for b in others) + " |", file=file)
    print("|---" * (1 + len(backends) + len(others)) + "|", file=file)
    for size in dict.fromkeys(r["size"] for r in rows):
        times = [f"{cell[(b, size)]:.1f}" if (b, size) in cell else "-" for b in backends]
        ratios = [f"{cell[(b, size)] / cell[('hca', size)]:.2f}x" if (b, size) in cell and ("hca", size) in cell
                  else "-" for b in others]
        print(f"| {size} | " + " | ".join(times + ratios) + " |", file=file)


def stock_refusal(backend, dev, world):
    """Why a stock backend cannot run here (the same answer on every rank), or None."""
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "this torch has no NCCL"
        if dev.type != "cuda":
            return "NCCL takes CUDA tensors only"
        if world > torch.cuda.device_count():
            return f"NCCL refuses several ranks on one GPU ({world} ranks, {torch.cuda.device_count()} GPUs)"
    return None


def hca_options(args):
    """The Options the user asked for on the command line, else None: what init_process_group("hca")
    would give (TORCH_HCA_* variables, then the defaults)."""
    from .options import Options

    given = {k: v for k, v in (("algorithm", args.algorithm), ("num_packs", args.num_packs)) if v is not None}
    return Options(**given) if given else None


def run(args):
    """One rank's sweep (the default group is up): every backend, one after another, on the same sizes."""
    from tqdm import tqdm

    from .options import Options

    rank, world = dist.get_rank(), dist.get_world_size()
    dev, dtype = rank_device("cpu" if args.device == "model" else args.device), DTYPES[args.datatype]
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    timer_group = dist.group.WORLD
    options = hca_options(args)
    shown = options or Options.from_env()
    per_call = shown.num_packs is None
    describe = {"hca": f"algorithm={shown.algorithm or ('per call' if per_call else 'hierarchical_copy')}, "
                       f"num_packs={'per call' if per_call else shown.num_packs}"}
    backends = ["hca"] + [b for b in args.compare.split(",") if b]
    rows, skipped = [], []
    with tqdm(total=len(backends) * len(sizes), disable=rank != 0 or None, file=sys.stderr,
              desc=f"{args.op} {args.datatype}", unit="size", leave=False) as progress:
        for backend in backends:
            refusal = stock_refusal(backend, dev, world)
            if refusal:
                skipped.append(dict(backend=backend, reason=refusal))
                progress.update(len(sizes))
                continue
            group = dist.new_group(backend=backend, pg_options=options if backend == "hca" else None)
            try:
                rows += measure(backend, args.op, group, sizes, dtype, dev, timer_group, args.iters,
                                args.warmup_iters, bool(args.check), REDOP_NAMES[args.redop], args.root,
                                lambda row: progress.update(), args.late_rank)
            except (RuntimeError, NotImplementedError, ValueError) as e:
                if backend == "hca":
                    raise
                # A stock backend refusing an op or dtype refuses it on every rank, at its first call.
                skipped.append(dict(backend=backend, reason=str(e).splitlines()[0]))
                progress.update(len(sizes) - sum(r["backend"] == backend for r in rows))
            dist.destroy_process_group(group)  # its threads and memory, before the next backend runs
    wrong = sum(r["wrong"] for r in rows)
    if rank == 0:
        launch = "torchrun" if launched_by_torchrun() else "spawned"
        late = f"  rank {args.late_rank[0]} {args.late_rank[1] * 1e3:g} ms late" if args.late_rank else ""
        print(f"# torch_hca.bench  {args.op}  {args.datatype}  {args.redop if args.op in REDUCING else ''}  "
              f"{world} ranks ({launch})  {args.device if args.device == 'model' else dev.type}{late}  "
              f"torch {torch.__version__}")
        print_table(rows, describe)
        for s in skipped:
            print(f"\n# {s['backend']}: not run: {s['reason']}")
        print_comparison(rows)
        print(f"\n# {'wrong elements: ' + str(wrong) if wrong else 'every element checked was right' if args.check else 'not checked (-c 0)'}")
        meta = dict(op=args.op, datatype=args.datatype, redop=args.redop, world_size=world, launch=launch,
                    device="model" if args.device == "model" else dev.type, late_rank=args.late_rank, gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                    cores=os.cpu_count(), torch=torch.__version__, hca=describe["hca"],
                    date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, skipped=skipped, wrong=wrong), f, indent=1)
        print(f"# wrote {args.json}")
    return wrong


def parser():
    p = argparse.ArgumentParser(prog="python -m torch_hca.bench", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=size_arg, help="smallest size (bytes; K, M, G suffixes; default 8, "
                   "with --kernels 1M)")
    p.add_argument("-e", "--maxbytes", type=size_arg, help="largest size (default 64M; with --kernels 1G on a GPU, "
                   "16M on CPU)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between points (2 or more)")
    p.add_argument("-o", "--op", default="all_reduce", choices=OPS)
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
    p.add_argument("--redop", default="sum", choices=list(REDOP_NAMES), help="of all_reduce and reduce_scatter")
    p.add_argument("-r", "--root", type=int, default=0, help="of broadcast")
    p.add_argument("-n", "--iters", type=int, default=0, help="timed calls per size (0: fewer as sizes grow, 5-200)")
    p.add_argument("-w", "--warmup_iters", type=int, default=3)
    p.add_argument("-c", "--check", type=int, default=1, choices=[0, 1], help="check every element (1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "model"],
                   help="auto: cuda where a GPU is; model: CPU tensors through the stream executor CUDA's run on "
                        "(the CPU model of the device)")
    p.add_argument("--late-rank", type=late_rank_arg, help="R:MS: rank R comes MS ms late to every size's timed calls")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--compare", default="", help="stock backends to sweep too, e.g. nccl,gloo")
    p.add_argument("--algorithm", help="hca's algorithm (default: TORCH_HCA_ALGORITHM, else hca's default)")
    p.add_argument("--num-packs", type=int, help="hca's num_packs")
    p.add_argument("--json", default="torch_hca_bench.json", help="where the rows go (rank 0 writes it)")
    p.add_argument("--kernels", action="store_true",
                   help="time hca's copy and sum kernels beside torch's copy_ and add, in this process, float32 and "
                        "bfloat16 (-b, -e, -f, --device and --json apply)")
    return p


def kernels(args):
    """--kernels: the sweep of the data kernels on this process's device."""
    from . import kernel_bench

    dev = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                       else "cpu")
    smallest = 1 << 20 if args.minbytes is None else args.minbytes
    largest = args.maxbytes if args.maxbytes is not None else (1 << 30 if dev.type == "cuda" else 16 << 20)
    try:
        sizes = size_sweep(smallest, largest, args.stepfactor)
    except ValueError as e:
        raise SystemExit(f"-b, -e, -f: {e}") from None
    args.json = os.path.abspath(args.json)
    return 1 if kernel_bench.run(args, sizes, dev) else 0


def main(argv=None):
    args = parser().parse_args(argv)
    if args.kernels:
        return kernels(args)
    args.minbytes = 8 if args.minbytes is None else args.minbytes
    args.maxbytes = 64 << 20 if args.maxbytes is None else args.maxbytes
    unknown = [b for b in args.compare.split(",") if b and b not in STOCK]
    if unknown:
        raise SystemExit(f"--compare: unknown backend {unknown[0]!r} (expected some of {', '.join(STOCK)})")
    if args.redop == "avg" and DTYPES[args.datatype] not in FLOATS:
        raise SystemExit(f"--redop avg: integer datatype {args.datatype!r} has no average (NCCL's rule too)")
    if args.nprocs < 1 or args.maxbytes < args.minbytes:
        raise SystemExit("--nprocs, -b and -e: need 1 <= nprocs and minbytes <= maxbytes")
    try:
        size_sweep(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as e:
        raise SystemExit(f"-f/--stepfactor: {e}") from None
    if args.iters < 0 or args.warmup_iters < 0:
        raise SystemExit(f"-n and -w: need 0 or more calls, got {args.iters} and {args.warmup_iters}")
    try:
        hca_options(args)
    except ValueError as e:
        raise SystemExit(f"--algorithm / --num-packs: {e}") from None
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else args.nprocs
    if not 0 <= args.root < world:
        raise SystemExit(f"-r/--root: rank {args.root} is not in a world of {world} ranks")
    if args.late_rank and args.late_rank[0] >= world:
        raise SystemExit(f"--late-rank: rank {args.late_rank[0]} is not in a world of {world} ranks")
    if args.device == "model":  # read by every rank's groups at creation (the ranks inherit it)
        os.environ["TORCH_HCA_CPU_EXECUTOR"] = "streams"
        os.environ["TORCH_HCA_MODEL_RUN_AHEAD"] = "1"  # its host runs ahead of its streams, as a GPU's
    args.json = os.path.abspath(args.json)
    if launched_by_torchrun():
        wrong = run_on_ranks(run, args, 0)
    else:
        run_on_ranks(run, args, args.nprocs)
        with open(args.json) as f:
            wrong = json.load(f)["wrong"]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
