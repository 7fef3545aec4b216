"""Training steps, not microbenchmarks: DDP and FSDP2 on CPU ranks, gloo beside hca.

    python benchmarks/training.py                    # 2 ranks, both models, DDP and FSDP2, 3 rounds
    python benchmarks/training.py --short            # what `make run` runs: 1 round, fewer steps
    python benchmarks/training.py --world-sizes 2,4  # 4 ranks on a 2-core machine: oversubscribed

Every contender (gloo; hca with its default options; hca with num_packs = ranks; the pass-through,
hca(algorithm=nccl), where --contenders names it) runs in a launch of its own, fresh processes
with one intra-op thread each; the launches alternate, in order and then in reverse, for
`--rounds` rounds. In each launch the ranks time, in batches that
alternate so that all see the same moments of the machine:

  step   a training step (forward, backward, optimizer) under the wrapper, with its communication
         (DDP's through torch's allreduce_hook, as below);
  local  the same step without communication: DDP under no_sync(); for FSDP2, the same model
         unsharded and unwrapped (FSDP2 has no step without its all-gathers), on the same batch;
  bookkeeping  the wrapper's step without a peer: DDP with a comm hook that communicates nothing
         (its bucket copies and hooks stay); FSDP2 sharding over this rank alone;
  alone  the collectives one step issued, replayed back-to-back on tensors of the same sizes, in
         the step's order and as it issued them: DDP's buckets (as DDP rebuilt them) all-reduced
         async, then waited; FSDP2's all-gathers and reduce-scatters (recorded during a step),
         each waited before the next as FSDP2 does on CPU.
  after_compute  (with --after-compute) `local`, then the collectives as `alone` replays them: they
         find the caches as a step's compute leaves them (in `alone` they find them warm from the
         replay before); only the collectives are timed at each call.

comm = step - local is what communication costs the step; share = comm / alone compares it with
the collectives' own time (1.0: nothing lost around them; below 1: overlapped with the backward
pass). It splits into the wrapper's own work (bookkeeping - local, the same for every backend in
principle) and the collectives inside the step (step - bookkeeping; in_step = that / alone).
Times are medians over batches of the slowest rank, then medians over rounds.

The collectives are also timed at each call, in the step and in the replay, on a clock all ranks
share: FSDP2's all-gathers and reduce-scatters, which it issues through torch.distributed's
functions, and DDP's all-reduces, which its step issues through torch's allreduce_hook (DDP's
default, written in Python) for that reason. The time inside them splits into waiting for the peers
to arrive (their compute ran longer; no backend can shorten that) and the time after the last rank
arrived, which is the backend's. DDP's run while the backward pass computes, so for them the part
after the last arrival is the step's wait: from the last rank's last bucket (its backward pass
done) to the end of the last all-reduce. The CPU time of the calling thread in them tells, where
ranks outnumber cores, work from waiting for a core (FSDP2's; DDP's is the time to issue them).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from bench import alternating_medians
from torch_hca.bench import int_list_arg
from torch_hca.ranks import start_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def transformer():
    """Many small parameters: a 6-layer encoder, d_model 256 (~4.7 M parameters in 98 tensors)."""
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False),
                                torch.nn.Linear(256, 256))
    return model, lambda g: (torch.randn(8, 32, 256, generator=g), torch.randn(8, 32, 256, generator=g))


def wide_mlp():
    """Few large parameters: three 2048x2048 layers (~12.6 M parameters in 6 tensors)."""
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 2048))
    return model, lambda g: (torch.randn(64, 2048, generator=g), torch.randn(64, 2048, generator=g))


def tiny():
    """For a quick check of the benchmark itself (tests): two small layers."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    return model, lambda g: (torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g))


MODELS = {"transformer": transformer, "wide-mlp": wide_mlp, "tiny": tiny}
BENCHMARKED = ["transformer", "wide-mlp"]


def shard_units(model):
    """The modules FSDP2 shards one by one before the root: the encoder layers, else the Linear layers."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.TransformerEncoderLayer)]
    return layers or [m for m in model if isinstance(m, torch.nn.Linear)]


def contenders(world, named=False):
    """(label, backend, hca options) for every contender a run has by default; with `named`, also
    those it runs only where --contenders names them: the pass-through, "hca(algorithm=nccl)"
    (on CPU tensors gloo after hca's packing, every call agreed on first)."""
    import torch_hca

    rows = [("gloo", "gloo", None), ("hca", "hca", torch_hca.Options())]
    if world != torch_hca.Options().num_packs:
        rows.append((f"hca(num_packs={world})", "hca", torch_hca.Options(num_packs=world)))
    if named:
        rows.append(("hca(algorithm=nccl)", "hca", torch_hca.Options("nccl")))
    return rows


@contextlib.contextmanager
def observed_collectives(observe):
    """Inside, each all-reduce / all-gather / reduce-scatter issued through torch.distributed's module
    (as FSDP2 and DDP's Python comm hooks issue them) runs as observe(kind, output, input, async_op,
    call), which returns call()'s work."""
    names = [n for n in ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                         "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def observed(name):
        if name == "all_reduce":
            def reduce(tensor, *args, **kwargs):
                return observe("allreduce", tensor, tensor, kwargs.get("async_op", False),
                               lambda: originals[name](tensor, *args, **kwargs))
            return reduce

        def call(output, input, *args, **kwargs):
            return observe("gather" if "gather" in name else "scatter", output, input, kwargs.get("async_op", False),
                           lambda: originals[name](output, input, *args, **kwargs))
        return call

    for n in names:
        setattr(dist, n, observed(n))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def recorded_collectives(calls):
    """Appends (kind, output numel, input numel, dtype, async_op) for each collective FSDP2 issues
    inside (on CPU it waits for each at once: async_op=False unless unshard_async_op is set)."""
    def record(kind, output, input, async_op, call):
        calls.append((kind, output.numel(), input.numel(), input.dtype, async_op))
        return call()
    return observed_collectives(record)


def timed_collectives(spans):
    """Appends [entered, left, cpu, async] for each collective issued inside: entry and end in
    time.monotonic_ns, one clock for every process of the machine (an async one's end is when its
    Future completes, filled in then), the ns of CPU time this thread spent issuing it (hca runs its
    blocking CPU collectives on the caller's thread; gloo on threads of its own, which this does not
    see), and 1 where it was async."""
    def time_it(kind, output, input, async_op, call):
        entered, cpu = time.monotonic_ns(), time.thread_time_ns()
        work = call()
        span = [entered, -1, time.thread_time_ns() - cpu, int(async_op)]
        if async_op:
            work.get_future().then(lambda _: span.__setitem__(1, time.monotonic_ns()))
        else:
            span[1] = time.monotonic_ns()
        spans.append(span)
        return work
    return observed_collectives(time_it)


def timed(spans, run):
    """run, its collectives timed into `spans` (timed_collectives)."""
    def call():
        with timed_collectives(spans):
            run()
    return call


def meeting_times(spans, calls_made, group):
    """meeting_split of every rank's spans (this rank's: as timed_collectives appended them)."""
    mine = torch.tensor(spans, dtype=torch.int64).view(-1, 4)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    *columns, issued_async = torch.stack(every).unbind(-1)
    return meeting_split(*columns, calls_made, overlapped=bool(issued_async.any()))


def meeting_split(entered, left, cpu, calls_made, overlapped=False):
    """From each rank's (rows) entry and end times and CPU time (ns) in each collective (columns,
    `calls_made` calls of a mode in a row, each issuing the same number): per call, ms, medians over
    the calls of the rank that spent longest, the time inside the collectives, the part of it after
    the last rank arrived (the rest is waiting for peers' compute, which no backend shortens), and
    the CPU time issuing them (where ranks outnumber cores, a rank waiting for a core inside a
    collective costs the step nothing while the core computes for another rank). Blocking
    collectives add up; `overlapped` ones (async, as DDP's buckets, in flight while the backward pass
    computes) do not: inside is from the first entry to the last end, and after the last arrival
    from the last rank's entry into the call's last collective (its backward pass done) to the last
    end: what the step waits for beyond its compute."""
    if entered.numel() == 0 or (left < 0).any():
        return dict.fromkeys(("inside_ms", "after_last_arrival_ms", "cpu_ms"), float("nan"))

    def per_call(ns):  # ranks x calls -> ms: the slowest rank's, median over the calls
        return ns.max(dim=0).values.double().median().item() / 1e6

    def calls(ns):
        return ns.view(len(ns), calls_made, -1)
    if overlapped:
        ends = calls(left).max(-1).values
        last_arrival = calls(entered)[..., -1].max(dim=0).values
        inside, after = ends - calls(entered).min(-1).values, (ends - last_arrival).clamp(min=0)
    else:
        inside, after = calls(left - entered).sum(-1), calls((left - entered.max(dim=0).values).clamp(min=0)).sum(-1)
    return dict(inside_ms=per_call(inside), after_last_arrival_ms=per_call(after), cpu_ms=per_call(calls(cpu).sum(-1)))


def replay(calls):
    """A function issuing `calls` (as recorded) in order, as the step did: a blocking call waited
    before the next, async ones issued back-to-back and waited at the end."""
    buffers = [(kind, torch.randn(out_numel, dtype=dtype), torch.randn(in_numel, dtype=dtype), async_op)
               for kind, out_numel, in_numel, dtype, async_op in calls]

    def run():
        # Looked up at each run, so that timed_collectives sees them as it sees FSDP2's.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        works = []
        for kind, out, inp, async_op in buffers:
            if kind == "allreduce":
                works.append(dist.all_reduce(out, async_op=async_op))
            elif kind == "gather":
                works.append(gather(out, inp, async_op=async_op))
            else:
                works.append(scatter(out, inp, async_op=async_op))
        for w in works:
            if w is not None:
                w.wait()
    return run


def replays(local, collectives, spans):
    """The modes `alone` and `after_compute` (module docstring), their collectives timed into spans."""
    alone, timed_after = timed(spans["alone"], collectives), timed(spans["after_compute"], collectives)

    def after_compute():
        local()
        timed_after()
    return dict(alone=alone, after_compute=after_compute)


def training_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def ddp_modes(model, batches, world, bucket_view=False):
    """DDP's step, its no_sync() step, its step with a comm hook that communicates nothing (DDP's own
    bucket copies and bookkeeping), and its buckets all-reduced alone. The step's hook is torch's
    allreduce_hook, DDP's default in Python (all-reduce each bucket, then divide), so that its
    all-reduces go through torch.distributed's function and are timed at each call."""
    import copy

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    bookkeeping = DDP(copy.deepcopy(model), gradient_as_bucket_view=bucket_view)
    bookkeeping.register_comm_hook(None, lambda state, bucket: completed(bucket.buffer()))
    bookkeeping_opt = torch.optim.SGD(bookkeeping.parameters(), lr=1e-4)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def local():
        with ddp.no_sync():
            training_step(ddp, opt, next(batches))

    step = lambda: training_step(ddp, opt, next(batches))  # noqa: E731
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        step()
    info = ddp._get_ddp_logging_data()
    sizes = [int(s) for s in str(info.get("rebuilt_bucket_sizes") or info["bucket_sizes"]).split(",")]
    calls = [("allreduce", nbytes // 4, nbytes // 4, torch.float32, True) for nbytes in sizes]
    spans = dict(step=[], alone=[], after_compute=[])
    return (dict(step=timed(spans["step"], step), local=local,
                 bookkeeping=lambda: training_step(bookkeeping, bookkeeping_opt, next(batches)),
                 **replays(local, replay(calls), spans)),
            dict(buckets=len(sizes), bytes=sum(sizes), bucket_bytes=sizes, spans=spans))


def completed(value):
    future = torch.futures.Future()
    future.set_result(value)
    return future


def fsdp2_modes(model, batches, world):
    """FSDP2's step, the unsharded model's plain step, FSDP2 over this rank alone (its own copies
    and hooks without a peer), and the step's all-gathers and reduce-scatters alone."""
    import copy

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def sharded(module, group):
        mesh = DeviceMesh.from_group(group, "cpu")
        for unit in shard_units(module):
            fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
        opt = torch.optim.SGD(module.parameters(), lr=1e-4)
        return lambda: training_step(module, opt, next(batches))

    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    # FSDP2's own work (copies in and out, hooks) without a peer: the model sharded over this rank alone.
    alone_groups = [dist.new_group([r]) for r in range(world)]
    bookkeeping = sharded(copy.deepcopy(model), alone_groups[dist.get_rank()])
    step = sharded(model, dist.group.WORLD)
    step()
    calls = []
    with recorded_collectives(calls):
        step()
    moved = sum(out * dtype.itemsize for kind, out, inp, dtype, async_op in calls)
    spans = dict(step=[], alone=[], after_compute=[])
    local = lambda: training_step(plain, plain_opt, next(batches))  # noqa: E731
    return (dict(step=timed(spans["step"], step), local=local, bookkeeping=bookkeeping,
                 **replays(local, replay(calls), spans)),
            dict(collectives=len(calls), bytes=moved, spans=spans,
                 calls=[[kind, out, inp, str(dtype), async_op] for kind, out, inp, dtype, async_op in calls]))


WRAPPERS = {"ddp": ddp_modes, "ddp-bucket-view": lambda *a: ddp_modes(*a, bucket_view=True), "fsdp2": fsdp2_modes}


def measure(rank, world, model_name, wrapper, steps, batches, after_compute=False):
    """(seconds per mode, what one step sent) for this rank."""
    torch.manual_seed(0)
    model, make_batch = MODELS[model_name]()
    g = torch.Generator().manual_seed(rank)
    data = [make_batch(g) for _ in range(4)]
    stream = (data[i % len(data)] for i in range(1 << 30))
    modes, traffic = WRAPPERS[wrapper](model, stream, world)
    if not after_compute:
        del modes["after_compute"]
    seconds = alternating_medians(modes, dict.fromkeys(modes, steps), dist.group.WORLD, batches)
    for mode, spans in traffic.pop("spans", {}).items():
        for what, ms in meeting_times(spans, steps * batches, dist.group.WORLD).items():
            traffic[f"{mode}_collectives_{what}"] = ms
    return seconds, traffic


def worker(rank, world, init, contender, model_name, wrapper, steps, batches, after_compute, out_path):
    import torch_hca  # noqa: F401

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2's, about our Sequential
    label, backend, options = [c for c in contenders(world, named=True) if c[0] == contender][0]
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, pg_options=options)
    seconds, traffic = measure(rank, world, model_name, wrapper, steps, batches, after_compute)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(model=model_name, wrapper=wrapper, contender=label, world_size=world,
                           **{f"{m}_ms": s * 1e3 for m, s in seconds.items()}, **traffic), f)
    # The models, DDP's reducers and FSDP2's meshes hold the group: with them gone (measure
    # returned; gc for their cycles) destroy_process_group ends it and joins its threads now.
    # Otherwise gloo's thread may free its last Work's tensors while Python exits, and abort.
    gc.collect()
    dist.destroy_process_group()


def launch(world, contender, model_name, wrapper, steps, batches, after_compute=False):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        start_ranks(worker, (world, f"file://{tmp}/store", contender, model_name, wrapper, steps, batches,
                             after_compute, out), world)
        with open(out) as f:
            return json.load(f)


TIMED_AT_EACH_CALL = [f"{mode}_collectives_{what}_ms" for mode in ("step", "alone", "after_compute")
                      for what in ("inside", "after_last_arrival", "cpu")]


def summarize(rows):
    """Medians over rounds per (world, model, wrapper, contender), with comm, share and gloo's gap."""
    keys = dict.fromkeys((r["world_size"], r["model"], r["wrapper"], r["contender"]) for r in rows)
    table = []
    for world, model, wrapper, contender in keys:
        runs = [r for r in rows if (r["world_size"], r["model"], r["wrapper"], r["contender"]) ==
                (world, model, wrapper, contender)]
        row = dict(world_size=world, model=model, wrapper=wrapper, contender=contender, rounds=len(runs))
        for m in ("step_ms", "local_ms", "bookkeeping_ms", "alone_ms"):
            row[m] = statistics.median(r[m] for r in runs)
        row["comm_ms"] = statistics.median(r["step_ms"] - r["local_ms"] for r in runs)
        row["wrapper_ms"] = statistics.median(r["bookkeeping_ms"] - r["local_ms"] for r in runs)
        row["in_step_ms"] = statistics.median(r["step_ms"] - r["bookkeeping_ms"] for r in runs)
        row["share"] = row["comm_ms"] / row["alone_ms"]
        row["in_step_share"] = row["in_step_ms"] / row["alone_ms"]
        for m in TIMED_AT_EACH_CALL:
            row[m] = statistics.median(r.get(m, float("nan")) for r in runs)
        # after_arrival_share: the key earlier result files have, in step / alone
        for key, mode in (("after_arrival_share", "alone"), ("after_arrival_share_after_compute", "after_compute")):
            row[key] = row["step_collectives_after_last_arrival_ms"] / row[f"{mode}_collectives_after_last_arrival_ms"]
        table.append(row)
    for row in table:
        gloo = next((r for r in table if r["contender"] == "gloo" and
                     (r["world_size"], r["model"], r["wrapper"]) == (row["world_size"], row["model"], row["wrapper"])),
                    None)
        row["step_vs_gloo_ms"] = row["step_ms"] - gloo["step_ms"] if gloo else float("nan")
        row["alone_vs_gloo_ms"] = row["alone_ms"] - gloo["alone_ms"] if gloo else float("nan")
    return table


def print_table(table):
    print("| ranks | model | wrapper | contender | step ms | local ms | comm ms | alone ms | comm/alone "
          "| wrapper's own ms | collectives in step ms | in step/alone | step - gloo's | alone - gloo's |")
    print("|" + "---|" * 14)
    for r in table:
        print(f"| {r['world_size']} | {r['model']} | {r['wrapper']} | {r['contender']} | {r['step_ms']:.1f} "
              f"| {r['local_ms']:.1f} | {r['comm_ms']:.1f} | {r['alone_ms']:.1f} | {r['share']:.2f} "
              f"| {r['wrapper_ms']:.1f} | {r['in_step_ms']:.1f} | {r['in_step_share']:.2f} "
              f"| {r['step_vs_gloo_ms']:+.1f} | {r['alone_vs_gloo_ms']:+.1f} |")


def print_meetings(table):
    """The collectives timed at each call, where the wrapper issues them through torch.distributed."""
    rows = [r for r in table if not math.isnan(r["step_collectives_inside_ms"])]
    if not rows:
        return
    after_compute = any(not math.isnan(r["after_compute_collectives_after_last_arrival_ms"]) for r in rows)
    print("\n# collectives timed at each call, ms per step: inside them, after the last rank arrived (the rest "
          "waited for peers' compute; DDP: from the last rank's last bucket to the last all-reduce's end), and their "
          "CPU time on the calling thread (gloo's is on threads of its own; DDP: issuing them)")
    header = ["ranks", "model", "wrapper", "contender", "in step: inside", "waiting for peers", "after last arrival",
              "CPU", "alone: inside", "after last arrival", "CPU", "after last arrival, in step/alone",
              "CPU, in step/alone"]
    if after_compute:
        header += ["after compute: after last arrival", "after last arrival, in step/after compute"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        inside, after = r["step_collectives_inside_ms"], r["step_collectives_after_last_arrival_ms"]
        cells = [r["world_size"], r["model"], r["wrapper"], r["contender"], f"{inside:.1f}", f"{inside - after:.1f}",
                 f"{after:.1f}", f"{r['step_collectives_cpu_ms']:.1f}", f"{r['alone_collectives_inside_ms']:.1f}",
                 f"{r['alone_collectives_after_last_arrival_ms']:.1f}", f"{r['alone_collectives_cpu_ms']:.1f}",
                 f"{r['after_arrival_share']:.2f}",
                 f"{r['step_collectives_cpu_ms'] / r['alone_collectives_cpu_ms']:.2f}"]
        if after_compute:
            cells += [f"{r['after_compute_collectives_after_last_arrival_ms']:.1f}",
                      f"{r['after_arrival_share_after_compute']:.2f}"]
        print("| " + " | ".join(map(str, cells)) + " |")


def plot(table, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["world_size"], r["model"], r["wrapper"]) for r in table))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        rows = [r for r in table if (r["world_size"], r["model"], r["wrapper"]) == panel]
        x = range(len(rows))
        ax.bar(x, [r["local_ms"] for r in rows], color="0.75", label="step without communication")
        ax.bar(x, [r["wrapper_ms"] for r in rows], bottom=[r["local_ms"] for r in rows], color="tab:orange",
               label="the wrapper's own copies and hooks")
        ax.bar(x, [r["in_step_ms"] for r in rows], bottom=[r["local_ms"] + r["wrapper_ms"] for r in rows],
               color="tab:red", label="the collectives in the step")
        ax.scatter(x, [r["local_ms"] + r["wrapper_ms"] + r["alone_ms"] for r in rows], marker="_", s=400,
                   color="k", label="... had they taken their time alone", zorder=3)
        ax.set_xticks(list(x), [r["contender"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{panel[0]} ranks, {panel[1]}, {panel[2]}", fontsize=9)
        ax.set_ylabel("ms per step")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def checked_arguments(parser, args):
    """Each world's contenders' labels, or the parser's error naming a wrong argument, before any launch."""
    for name, given, known in (("--models", args.models, MODELS), ("--wrappers", args.wrappers, WRAPPERS)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            parser.error(f"{name}: unknown {unknown[0]!r} (expected some of {', '.join(known)})")
    if min(args.rounds, args.steps, args.batches) < 1:
        parser.error("--rounds, --steps and --batches: need 1 or more each")
    labels_by_world = {}
    for world in args.world_sizes:
        labels = [c[0] for c in contenders(world, named=bool(args.contenders))]
        chosen = [label for label in labels if not args.contenders or label in args.contenders.split(",")]
        if not chosen:
            parser.error(f"--contenders: none of {args.contenders!r} runs at {world} ranks "
                         f"(the contenders there: {', '.join(labels)})")
        labels_by_world[world] = chosen
    return labels_by_world


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # FSDP2 issues no collectives on one rank
    parser.add_argument("--world-sizes", type=int_list_arg("integers such as 2,4", 2), default="2")
    parser.add_argument("--models", default=",".join(BENCHMARKED), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--wrappers", default=",".join(WRAPPERS),
                        help="ddp, ddp-bucket-view (DDP(gradient_as_bucket_view=True)), fsdp2")
    parser.add_argument("--tag", default="", help="added to the result files' names")
    parser.add_argument("--contenders", help='a comma-separated subset of the contenders\' labels, e.g. "hca"')
    parser.add_argument("--rounds", type=int, default=3, help="launches of each contender, alternating")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed batch")
    parser.add_argument("--batches", type=int, default=6, help="timed batches per mode in a launch")
    parser.add_argument("--short", action="store_true",
                        help="1 round, 2 steps x 4 batches, DDP and FSDP2 only (what make run runs)")
    parser.add_argument("--after-compute", action="store_true",
                        help="also time the collectives right after a step's compute (mode after_compute)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.short:
        args.rounds, args.steps, args.batches, args.wrappers = 1, 2, 4, "ddp,fsdp2"
    labels_by_world = checked_arguments(parser, args)
    rows = []
    for world in args.world_sizes:
        labels = labels_by_world[world]
        for model in args.models.split(","):
            for wrapper in args.wrappers.split(","):
                for rnd in range(args.rounds):
                    for contender in labels[::1 if rnd % 2 == 0 else -1]:
                        row = launch(world, contender, model, wrapper, args.steps, args.batches, args.after_compute)
                        print(f"  {world} ranks {model} {wrapper} {contender} round {rnd}: step {row['step_ms']:.1f} "
                              f"local {row['local_ms']:.1f} alone {row['alone_ms']:.1f} ms", flush=True)
                        rows.append(dict(row, round=rnd))
    table = summarize(rows)
    print()
    print_table(table)
    print_meetings(table)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    name = f"cpu-training-ranks{'_'.join(map(str, args.world_sizes))}{'-short' if args.short else ''}{args.tag}-{stamp}"
    meta = dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=torch.__version__,
                date=stamp, command=" ".join(sys.argv),
                environment={k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "TORCH_HCA_"))})
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(dict(meta=meta, table=table, launches=rows), f, indent=1)
    plot(table, os.path.join(args.out, name + ".png"), f"training steps, CPU ranks, {stamp} ({os.cpu_count()} cores)")
    print(f"\nwrote {os.path.join(args.out, name)}.json and .png")
    return dict(table=table, launches=rows)


if __name__ == "__main__":
    main()
