"""hca beside gloo (and NCCL on a GPU): nccl-tests' columns, a JSON file and a PNG plot.

    python benchmarks/bench.py                      # 2 ranks, 4 B .. 64 MiB, CUDA tensors if a GPU is present
                                                    # (the defaults-vs-best table: 2, 3 and 4 ranks)
    python benchmarks/bench.py --world-sizes 2,3,4 --max-bytes 16M --device cpu
    python benchmarks/bench.py --ops all_reduce --device cpu --busy 2   # beside 2 processes busy on the CPUs

On CUDA, ranks share the GPUs round-robin (several ranks on one GPU), every timed call ends
with a device synchronize, and stock NCCL joins where it can run (one rank per GPU).

Every backend runs in the same processes, one after the other, on float32 tensors. The sweep is
the installed `python -m torch_hca.bench`'s (its timing, columns and element check); this script
puts hca's configurations side by side and adds a batch of 100 tensors, the small-message latency
table, the speed-ups over gloo and the plot. `choice` (in the default --ops, at
--choice-world-sizes) times hca's all-reduce and broadcast under its defaults and under each fixed
setting at every size with their batches alternating, for the table of the defaults beside the
fastest fixed setting; without it, that table compares the sweep's rows, taken minutes apart.
`--busy N` runs everything beside N processes that keep a CPU busy each, as a compile beside the
job would: the defaults must stay ahead of gloo there too.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch_hca.bench import (OPS, alternating_samples, bus_factor, busy_processes, calls_per_batch, int_list_arg,
                             iterations, measure, median_seconds, parse_size, print_table, size_sweep)
from torch_hca.costs import CANDIDATES
from torch_hca.ranks import rows_from_ranks, write_rows
from torch_hca.reference import rank_device

HERE = os.path.dirname(os.path.abspath(__file__))


def backends(world, device):
    """(label, backend, hca options) for every contender."""
    import torch_hca

    rows = [("gloo", "gloo", None), (DEFAULTS, "hca", torch_hca.Options())]
    # Each candidate of the cost model as a fixed setting (one rank: a pack per rank is one pack).
    for name, (algorithm, per_rank) in CANDIDATES.items():
        if not (per_rank and world == 1):
            rows.append((f"hca/{fixed_label(name, world)}", "hca",
                         torch_hca.Options(algorithm, num_packs=world if per_rank else 1)))
    if device == "cuda" and dist.is_nccl_available() and world <= torch.cuda.device_count():
        rows.append(("nccl", "nccl", None))
    return rows


def hca_settings(world, device):
    """label -> torch_hca.Options of every hca contender of backends(): the defaults and each fixed setting."""
    return {label: options for label, backend, options in backends(world, device) if backend == "hca"}


def synchronized(fn, dev):
    """fn, then (on CUDA) a wait for the device: the time a caller sees its result in."""
    if dev.type != "cuda":
        return fn
    return lambda: (fn(), torch.cuda.synchronize(dev))


def batch_shapes(count=100, smallest=4 << 10, largest=4 << 20):
    """`count` float32 tensor sizes spread geometrically from `smallest` to `largest` bytes."""
    ratio = (largest / smallest) ** (1 / (count - 1))
    return [max(1, int(smallest * ratio ** i) // 4) for i in range(count)]


def time_batches(rank, world, timer_group):
    """A batch of 100 tensors (4 KiB-4 MiB): gloo once per tensor vs hca's packed modes."""
    import torch_hca

    tensors = [torch.zeros(n) for n in batch_shapes()]
    nbytes = sum(t.numel() * 4 for t in tensors)
    contenders = [("gloo, one call per tensor", None),
                  ("hca/nccl(num_packs=1) (gloo engine)", torch_hca.Options("nccl", num_packs=1)),
                  ("hca/nccl(agg_small_grads 256 KiB x 10)", torch_hca.Options(
                      "nccl", num_packs=0, agg_small_grads_max_bytes=256 << 10, agg_small_grads_max_group=10)),
                  (f"hca/hierarchical_copy(num_packs={world})", torch_hca.Options("hierarchical_copy", num_packs=world))]
    rows = []
    for label, options in contenders:
        if options is None:
            group = timer_group
            fn = lambda: [dist.all_reduce(t, group=group) for t in tensors]  # noqa: E731
        else:
            group = dist.new_group(backend="hca", pg_options=options)
            fn = lambda: torch_hca.batch_allreduce(tensors, group=group)  # noqa: E731
        seconds, _ = median_seconds(fn, iterations(nbytes), 3, torch.device("cpu"), timer_group)
        rows.append(dict(backend=label, op="batch100", world_size=world, size=nbytes, count=len(tensors),
                         time_us=seconds * 1e6))
    return rows


LATENCY_SIZES = [4, 256, 4 << 10, 64 << 10]


# (label, num_packs of the hca group; None: gloo)
LATENCY_BACKENDS = (("gloo", None), ("hca", 1), ("hca num_packs=2", 2))


def time_latency(rank, world, timer_group, device, report):
    """Small allreduces, blocking and async + wait(), for gloo, hca (default options) and hca with
    num_packs=2: mean microseconds per call over a batch of back-to-back calls (median of 15
    batches, slowest rank). The two modes' batches alternate, so that both see the same moments of
    a machine whose speed drifts (on a VM, with where the host runs its vCPUs) and their ratio is
    the async cost, not the drift."""
    import torch_hca

    dev = rank_device(device, rank)
    rows = []
    for label, num_packs in LATENCY_BACKENDS:
        if num_packs is None:
            group = timer_group
        else:
            group = dist.new_group(backend="hca", pg_options=torch_hca.Options(num_packs=num_packs))
        for nbytes in LATENCY_SIZES:
            t = torch.zeros(max(1, nbytes // 4), device=dev)
            modes = {"blocking": synchronized(lambda: dist.all_reduce(t, group=group), dev),
                     "async": synchronized(lambda: dist.all_reduce(t, group=group, async_op=True).wait(), dev)}
            calls = calls_per_batch(modes, slowest_over_ranks(timer_group), probe=20, least=5)
            for mode, seconds in alternating_medians(modes, calls, timer_group).items():
                rows.append(dict(backend=label, mode=mode, world_size=world, size=nbytes, time_us=seconds * 1e6))
                report(rows[-1])
    return rows


CHOICE_OPS = {"all_reduce": lambda t, g: dist.all_reduce(t, group=g),
              "broadcast": lambda t, g: dist.broadcast(t, 0, group=g)}


def time_choices(rank, world, timer_group, device, sizes, report):
    """all_reduce and broadcast at every size under hca's defaults and under each fixed setting
    (backends()), their batches alternating (alternating_samples): the sweep times each contender
    after the other, minutes apart, and on a VM whose speed drifts that alone made two identical
    schedules differ 1.4x. This is what the defaults-vs-best table compares; a second group with
    the defaults gives its noise column."""
    import torch_hca

    dev = rank_device(device, rank)
    options = hca_settings(world, device)
    groups = {label: dist.new_group(backend="hca", pg_options=opts) for label, opts in options.items()}
    # The defaults again, in a group of their own: how far two runs of one setting differ here.
    groups[DEFAULTS_AGAIN] = dist.new_group(backend="hca", pg_options=torch_hca.Options())
    rows = []
    for op, call in CHOICE_OPS.items():
        for nbytes in sizes:
            t = torch.zeros(max(1, nbytes // 4), device=dev)
            modes = {label: synchronized(lambda g=g: call(t, g), dev) for label, g in groups.items()}
            for fn in modes.values():
                fn()  # a warm-up call each: the probe below is only 3 calls, for the large sizes' sake
            calls = calls_per_batch(modes, slowest_over_ranks(timer_group), probe=3, least=1)
            # What the defaults ran at this size, as the fixed setting's label (CPU all-reduces: chosen
            # per call; a broadcast's defaults are fixed, and explain names no choice for them), the
            # cost model they chose by, and the fixed settings that run the very same plan here.
            plans = plans_of(groups, options, op, t.numel(), dev.type)
            chosen = plans[DEFAULTS].chosen
            ran = f"hca/{fixed_label(chosen, world)}" if chosen else None
            same_plan = [label for label in options
                         if label != DEFAULTS and same_schedule(plans[label], plans[DEFAULTS])]
            model = plans[DEFAULTS].cost_model
            about_defaults = dict(ran=ran, same_plan=same_plan, cost_model=model.origin if model else None)
            samples = alternating_samples(modes, calls, 16, lambda: dist.barrier(group=timer_group))
            halves = split_halves(samples, timer_group)
            for label, seconds in slowest_medians(samples, timer_group).items():
                rows.append(dict(op=op, backend=label, world_size=world, size=nbytes, time_us=seconds * 1e6,
                                 halves_us=[h * 1e6 for h in halves[label]], timing="alternating",
                                 **(about_defaults if label == DEFAULTS else {})))
                report(rows[-1])
    return rows


EXPLAINED_OPS = {"all_reduce": "allreduce", "broadcast": "broadcast"}


def plans_of(groups, options, op, numel, device):
    """label -> the plan (torch_hca.explain) that the group of each setting in `options` (label ->
    torch_hca.Options) runs for `op` (CHOICE_OPS) on `numel` float32 elements of `device`'s."""
    import torch_hca

    return {label: torch_hca.explain(numels=[numel], group=groups[label], device=device, algorithm=opts.algorithm,
                                     num_packs=opts.num_packs, collective=EXPLAINED_OPS[op])
            for label, opts in options.items()}


def same_schedule(a, b):
    """Whether two plans (torch_hca.explain) move the same pieces between the same ranks in the same
    steps and rounds: two settings that run one plan differ in their timings by noise alone."""
    return a.packs == b.packs and a.rounds == b.rounds and a.roles == b.roles


def fixed_label(candidate, world):
    """The fixed setting of backends() that runs what a candidate of the cost model runs."""
    algorithm, per_rank = CANDIDATES[candidate]
    return f"{algorithm}(num_packs={world})" if per_rank else algorithm


def slowest_over_ranks(timer_group):
    """Each of this rank's numbers replaced by the largest of the ranks' (calls_per_batch's `slowest`)."""
    def slowest(numbers):
        t = torch.tensor(numbers, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=timer_group)
        return t.tolist()
    return slowest


def slowest_medians(samples, timer_group):
    """Each mode's median seconds per call over its batches, the slowest rank's."""
    medians = torch.tensor([statistics.median(samples[mode]) for mode in samples], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=timer_group)
    return dict(zip(samples, medians.tolist()))


def alternating_medians(modes, calls, timer_group, batches=15):
    """Seconds per call of each mode: the median of its alternating batches, slowest rank."""
    return slowest_medians(alternating_samples(modes, calls, batches, lambda: dist.barrier(group=timer_group)),
                           timer_group)


def split_halves(samples, timer_group):
    """Each mode's median seconds per call over two disjoint halves of its batches (the slowest
    rank's time in each batch): batches 0, 1, 4, 5, ... and 2, 3, 6, 7, ..., so that each half holds
    both orders of the alternation."""
    per_batch = torch.tensor([samples[mode] for mode in samples], dtype=torch.float64)
    dist.all_reduce(per_batch, op=dist.ReduceOp.MAX, group=timer_group)
    halves = {}
    for mode, row in zip(samples, per_batch.tolist()):
        halves[mode] = [statistics.median(t for b, t in enumerate(row) if b % 4 // 2 == half) for half in (0, 1)]
    return halves


def print_latency(latency):
    """One line per (ranks, size): each backend's blocking and async time; for hca, async / blocking."""
    if not latency:
        return
    cell = {(r["backend"], r["mode"], r["world_size"], r["size"]): r["time_us"] for r in latency}
    print("\n# small allreduce latency (us per call; async = async_op=True then wait())")
    header = ["ranks", "size"]
    for b, num_packs in LATENCY_BACKENDS:
        header += [f"{b} blocking", f"{b} async"] + ([f"{b} async/blocking"] if num_packs else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for world, size in dict.fromkeys((r["world_size"], r["size"]) for r in latency):
        line = [str(world), f"{size} B"]
        for b, num_packs in LATENCY_BACKENDS:
            blocking, async_ = cell[(b, "blocking", world, size)], cell[(b, "async", world, size)]
            line += [f"{blocking:.1f}", f"{async_:.1f}"] + ([f"{async_ / blocking:.2f}"] if num_packs else [])
        print("| " + " | ".join(line) + " |")


def progress_line(row):
    """One measured row, printed at once: a run cut short (a device call's time limit) still shows
    what it measured, where the tables come only at the end."""
    what = row.get("op") or f"allreduce {row['mode']}"
    print(f"measured: {what} {row['backend']} ranks={row['world_size']} {row['size']} B: {row['time_us']:.1f} us",
          flush=True)


def worker(rank, world, init, sizes, ops, out_path, device, pin):
    import torch_hca  # noqa: F401

    torch.set_num_threads(1)
    if pin:  # before any thread starts, so that the backends' threads stay on the rank's core too
        os.sched_setaffinity(0, {pin[rank % len(pin)]})
    dev = rank_device(device, rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    timer_group = dist.group.WORLD
    rows = []
    report = progress_line if rank == 0 else lambda row: None
    if "batch" in ops:
        rows += time_batches(rank, world, timer_group)
        for row in rows:
            report(row)
        ops = [op for op in ops if op != "batch"]
    if "latency" in ops:
        rows += time_latency(rank, world, timer_group, device, report)
        ops = [op for op in ops if op != "latency"]
    if "choice" in ops:
        rows += time_choices(rank, world, timer_group, device, sizes, report)
        ops = [op for op in ops if op != "choice"]
    for label, backend, options in backends(world, device):
        group = dist.new_group(backend=backend, pg_options=options) if backend != "gloo" else timer_group
        for op in ops:
            rows += measure(label, op, group, sizes, torch.float32, dev, timer_group, on_row=report)
    write_rows(rank, rows, out_path)
    dist.destroy_process_group()


def memcpy_bandwidth(device, nbytes=64 << 20):
    """Bytes copied per second by one memcpy: one core's on CPU, device-to-device on CUDA."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    src, dst = torch.ones(nbytes // 4, device=dev), torch.empty(nbytes // 4, device=dev)
    copy = synchronized(lambda: dst.copy_(src), dev)
    copy()
    best = min(_timed(copy) for _ in range(5))
    return nbytes / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ratios(rows):
    """Per (op, world, size): gloo's time / each hca row's time."""
    gloo = {(r["op"], r["world_size"], r["size"]): r for r in rows if r["backend"] == "gloo"}
    out = []
    for r in rows:
        g = gloo.get((r["op"], r["world_size"], r["size"]))
        if r["backend"] != "gloo" and g:
            out.append(dict(op=r["op"], world_size=r["world_size"], size=r["size"], backend=r["backend"],
                            speedup_vs_gloo=g["time_us"] / r["time_us"]))
    return out


def print_batches(batches):
    for r in batches:
        base = next(b for b in batches if b["world_size"] == r["world_size"] and b["backend"].startswith("gloo"))
        print(f"batch of {r['count']} tensors ({r['size'] / 2**20:.1f} MiB), ranks={r['world_size']}: "
              f"{r['backend']:<42} {r['time_us'] / 1e3:9.2f} ms  ({base['time_us'] / r['time_us']:.2f}x gloo)")


DEFAULTS = "hca (defaults: algorithm and packs chosen per call)"
DEFAULTS_AGAIN = "hca (the defaults again, another group)"


def defaults_vs_best(rows):
    """Per (op, ranks, size): hca's defaults beside the fastest fixed hca setting, and their ratio;
    with the defaults timed twice (--ops choice), also the ratio of the two (the noise). The fastest
    of several settings is the luckiest of several draws, so where they take the same time the
    ratio is above 1 by noise alone; with each time split in two halves of its batches (--ops
    choice), `held_out` picks the fastest on one half and compares on the other (both ways, the
    mean), which that bias does not touch."""
    out = []
    for key in dict.fromkeys((r["op"], r["world_size"], r["size"]) for r in rows):
        here = [r for r in rows if (r["op"], r["world_size"], r["size"]) == key]
        default = next((r for r in here if r["backend"] == DEFAULTS), None)
        again = next((r for r in here if r["backend"] == DEFAULTS_AGAIN), None)
        fixed = [r for r in here if r["backend"].startswith("hca/")]
        if default and fixed:
            best = min(fixed, key=lambda r: r["time_us"])
            out.append(dict(op=key[0], world_size=key[1], size=key[2], default_us=default["time_us"],
                            best_fixed=best["backend"], best_fixed_us=best["time_us"],
                            ratio=default["time_us"] / best["time_us"], ran=default.get("ran"),
                            same_plan=best["backend"] in default["same_plan"] if "same_plan" in default else None,
                            cost_model=default.get("cost_model"),
                            noise=max(default["time_us"], again["time_us"]) / min(default["time_us"], again["time_us"])
                            if again else None, held_out=held_out_ratio(default, fixed)))
    return out


def compared_rows(choices, swept):
    """What the defaults-vs-best table compares: the alternating timings (--ops choice) for their
    op, the sweep's rows for every other op."""
    alternated = {c["op"] for c in choices}
    return choices + [r for r in swept if r["op"] not in alternated]


def held_out_ratio(default, fixed):
    """The defaults' time over the fastest fixed setting's, that setting picked on one half of the
    batches and both timed on the other; the mean of the two ways round. None without halves."""
    if "halves_us" not in default or any("halves_us" not in r for r in fixed):
        return None
    ratios = []
    for pick, judge in ((0, 1), (1, 0)):
        best = min(fixed, key=lambda r: r["halves_us"][pick])
        ratios.append(default["halves_us"][judge] / best["halves_us"][judge])
    return statistics.mean(ratios)


def within_summary(table):
    """How many sizes the defaults are within 1.05x at, and what the others' gap is where that is known:
    in a sweep (no --ops choice) each setting was timed after the other, and what
    the defaults ran is not recorded."""
    behind = [t for t in table if t["ratio"] > 1.05]
    text = f"the defaults within 1.05x of the fastest fixed setting at {len(table) - len(behind)} of {len(table)} sizes"
    if not behind:
        return text
    if any(t.get("same_plan") is None for t in behind):
        return (text + f"; the sweep timed each setting after the other, so the {len(behind)} others' "
                "gaps include the machine's drift (--ops choice alternates them)")
    same = [t for t in behind if t["same_plan"]]
    return (text + f"; of the {len(behind)} others, {len(same)} ran the very plan of that setting (their gap is "
            "noise between two groups); the held-out column says whether the rest hold up")


def print_defaults_vs_best(table):
    if not table:
        return
    print("\n# hca's defaults beside its fastest fixed setting (ratio > 1: the defaults are slower; held out: the\n"
          "# fastest picked on half the batches, both timed on the other half; noise: the defaults against\n"
          "# themselves in another group, slower / faster)")
    for world, origin in dict.fromkeys((t["world_size"], t.get("cost_model")) for t in table):
        if origin:
            print(f"# {world} ranks: the defaults chose by the cost model of {origin}")
    print("| op | ranks | size | defaults (us) | they ran | fastest fixed | same plan | its time (us) | ratio "
          "| held out | noise |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        noise = f"{t['noise']:.2f}" if t["noise"] else ""
        held_out = f"{t['held_out']:.2f}" if t.get("held_out") else ""
        same = {True: "yes", False: "no"}.get(t.get("same_plan"), "")
        print(f"| {t['op']} | {t['world_size']} | {t['size']} | {t['default_us']:.1f} | {(t['ran'] or '')[4:]} | "
              f"{t['best_fixed'][4:]} | {same} | {t['best_fixed_us']:.1f} | {t['ratio']:.2f} | {held_out} | {noise} |")
    print()
    for op in dict.fromkeys(t["op"] for t in table):
        print(f"{op}: " + within_summary([t for t in table if t["op"] == op]))
    judged = [t for t in table if t.get("held_out")]
    if judged:
        print(f"held out (the fastest picked on other batches than it is timed on): within 1.05x at "
              f"{sum(t['held_out'] <= 1.05 for t in judged)} of {len(judged)} sizes")


def print_speedups(speedups):
    """A markdown table: per op, ranks and size, gloo's time over each hca row's time."""
    if not speedups:
        return
    labels = list(dict.fromkeys(s["backend"] for s in speedups))
    print("\n# hca speed-up over gloo (gloo time / hca time; busbw ratio is the same number)")
    print("| op | ranks | size | " + " | ".join(labels) + " |")
    print("|---" * (3 + len(labels)) + "|")
    cells = {(s["op"], s["world_size"], s["size"], s["backend"]): s["speedup_vs_gloo"] for s in speedups}
    for op, world, size in dict.fromkeys((s["op"], s["world_size"], s["size"]) for s in speedups):
        row = [f"{cells[(op, world, size, b)]:.1f}x" if (op, world, size, b) in cells else "" for b in labels]
        print(f"| {op} | {world} | {size} | " + " | ".join(row) + " |")


def plot(rows, path, title, memcpy_gbps, bound_label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["op"], r["world_size"]) for r in rows})
    fig, axes = plt.subplots(2, len(keys), figsize=(5.5 * len(keys), 8), squeeze=False)
    for col, (op, world) in enumerate(keys):
        for label in dict.fromkeys(r["backend"] for r in rows):
            pts = [r for r in rows if r["backend"] == label and r["op"] == op and r["world_size"] == world]
            if not pts:
                continue
            style = "--" if label == "gloo" else "-"
            axes[0][col].plot([p["size"] for p in pts], [p["busbw"] for p in pts], style, marker=".", label=label)
            axes[1][col].plot([p["size"] for p in pts], [p["time_us"] for p in pts], style, marker=".", label=label)
        # The physical bound: busbw at the copy bandwidth measured in this run (nccl-tests' busbw
        # counts the bytes each rank must move), and the time that takes at each size.
        sizes = sorted({r["size"] for r in rows if r["op"] == op and r["world_size"] == world})
        factor = bus_factor(op, world)
        axes[0][col].axhline(memcpy_gbps, color="black", linestyle=":", label=bound_label)
        if factor > 0:
            axes[1][col].plot(sizes, [s * factor / memcpy_gbps / 1e3 for s in sizes], ":", color="black",
                              label=bound_label)
            fastest = min(r["time_us"] for r in rows if r["op"] == op and r["world_size"] == world)
            axes[1][col].set_ylim(bottom=fastest / 4)  # the bound of tiny messages would flatten the rest
        axes[0][col].set_title(f"{op}, {world} ranks")
        axes[0][col].set_ylabel("busbw (GB/s)")
        axes[1][col].set_ylabel("time (us)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.grid(True, alpha=0.3)
        axes[1][col].set_yscale("log")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


MODES = ("batch", "latency", "choice")  # beside the ops of python -m torch_hca.bench


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int_list_arg("integers such as 2,4", 1), default="2")
    parser.add_argument("--min-bytes", default="4")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--step", type=int, default=4, help="size multiplier between points")
    parser.add_argument("--ops", default="all_reduce,broadcast,latency,choice",
                        help="all_reduce, broadcast (or any op of python -m torch_hca.bench), batch (100 tensors of 4 KiB-4 MiB), latency "
                             "(4 B-64 KiB allreduce, blocking and async), choice (allreduce and broadcast under hca's "
                             "defaults and each fixed setting, alternating: the defaults-vs-best table)")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r to core r %% cores (steadier runs; see docs/history/performance-log.md on bimodal runs)")
    parser.add_argument("--pin-cores", type=int_list_arg("integers such as 0,32,1,33", 0),
                        help='pin rank r to the r-th of these cores, e.g. "0,32,1,33" to alternate '
                             "sockets (groups='auto' then groups the ranks by socket)")
    parser.add_argument("--latency-world-sizes", type=int_list_arg("integers such as 2,4", 1), default="1,2,3,4",
                        help="world sizes of the latency table")
    parser.add_argument("--choice-world-sizes", type=int_list_arg("integers such as 2,4", 2), default="2,3,4",
                        help="world sizes of the defaults-vs-best table (--ops choice)")
    parser.add_argument("--busy", type=int, default=0, help="processes that keep a CPU busy each beside the ranks")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="tensors' device (auto: cuda when a GPU is present)")
    args = parser.parse_args(argv)
    try:
        sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.step)
    except ValueError as e:
        parser.error(f"--min-bytes, --max-bytes, --step: {e}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ops = [{"allreduce": "all_reduce"}.get(op, op) for op in args.ops.split(",")]  # the old name, in recorded commands
    unknown = [op for op in ops if op not in OPS + MODES]
    if unknown:
        parser.error(f"--ops: unknown {unknown[0]!r} (expected some of {', '.join(OPS + MODES)})")
    if args.busy < 0:
        parser.error(f"--busy: expected 0 or more processes, got {args.busy}")
    pin = args.pin_cores or (list(range(os.cpu_count())) if args.pin else None)
    runs = [(w, [op for op in ops if op not in ("latency", "choice")]) for w in args.world_sizes]
    for mode, worlds in (("latency", args.latency_world_sizes), ("choice", args.choice_world_sizes)):
        if mode in ops:
            runs += [(w, [mode]) for w in worlds]
    rows = []
    with busy_processes(args.busy):
        for world, run_ops in runs:
            if not run_ops:
                continue
            rows += rows_from_ranks(worker, world,
                                    lambda init, out: (world, init, sizes, run_ops, out, device, pin))
    batches = [r for r in rows if r.get("op") == "batch100"]
    latency = [r for r in rows if "mode" in r]
    choices = [r for r in rows if r.get("timing") == "alternating"]
    rows = [r for r in rows if r.get("op") not in ("batch100", None) and r not in choices]
    print_table(rows)
    print_batches(batches)
    print_latency(latency)
    memcpy = memcpy_bandwidth(device)
    speedups = ratios(rows)
    print(f"\nmemcpy bandwidth ({'device to device' if device == 'cuda' else 'one core'}): {memcpy:.2f} GB/s")
    print_speedups(speedups)
    defaults = defaults_vs_best(compared_rows(choices, rows))
    print_defaults_vs_best(defaults)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") + "-" if device == "cuda" else ""
    busy = f"-busy{args.busy}" if args.busy else ""
    name = f"{gpu}{device}-ranks{'_'.join(map(str, args.world_sizes))}{busy}-{stamp}"
    meta = dict(device=device, cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), busy=args.busy,
                torch=torch.__version__, date=stamp, memcpy_GBps=memcpy, command=" ".join(sys.argv))
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, batches=batches, latency=latency, choices=choices,
                       speedup_vs_gloo=speedups, defaults_vs_best=defaults), f, indent=1)
    if rows:
        bound = f"bound: {'device-to-device copy' if device == 'cuda' else 'one core memcpy'} {memcpy:.1f} GB/s"
        plot(rows, os.path.join(args.out, name + ".png"), f"hca vs gloo, {device} ranks, {stamp}", memcpy, bound)
    print(f"\nwrote {os.path.join(args.out, name)}.json and .png")


if __name__ == "__main__":
    main()
