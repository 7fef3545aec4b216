"""`python -m torch_hca.check`: is hca right on this machine? A self-test to run on a new one.

    python -m torch_hca.check                        # ranks of its own: worlds 1, 2 and 3
    python -m torch_hca.check --world-sizes 2,4 --device cuda
    torchrun --nproc-per-node 4 -m torch_hca.check

Every collective (all_reduce with each reduction, broadcast, reduce, all_gather, gather, scatter,
reduce_scatter, all_to_all, send/recv, barrier), every dtype and every algorithm (hierarchical_copy
with one pack and with a pack per rank, reduce_to_one_device, nccl pass-through), each result
compared on every element with a reference (float64; BAND, BOR, BXOR in the dtype) built from every
rank's seeded input, without hca. It prints the hierarchy hca found, the plan `explain` gives for a
1 MiB all_reduce, and a verdict; every check's line goes to a log, the counts to a JSON file. Exit
status 1 on any failure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from .bench import call, int_list_arg, stock_refusal
from .options import Options
from .ranks import launched_by_torchrun, rank_device, run_on_ranks
from .reference import (BITWISE, DTYPES, OPS as REDOPS, collective_reference, make_input, mismatch,
                        reduce_reference, supported)

SMALL_NUMELS = (1, 1001)
LARGE_NUMEL = 600_001  # 2.4 MB of float32: more than one staging slot, so that rounds are checked too
SHOWN_FAILURES = 10


def modes(world):
    """(name, Options) of every algorithm checked."""
    return [("defaults (packs chosen per call)", Options()),
            ("hierarchical_copy", Options("hierarchical_copy", num_packs=1)),
            (f"hierarchical_copy num_packs={world}", Options("hierarchical_copy", num_packs=world)),
            ("reduce_to_one_device", Options("reduce_to_one_device")),
            ("direct", Options("direct")),
            ("nccl pass-through", Options("nccl", num_packs=2))]


def cases(world, bitwise=True):
    """(op, dtype, numel, redop) of every check on one group (`bitwise`: with BAND, BOR and BXOR,
    which NCCL lacks)."""
    out = []
    for dtype in DTYPES:
        numels = SMALL_NUMELS + ((LARGE_NUMEL,) if dtype in (torch.float32, torch.bfloat16) else ())
        for numel in numels:
            out += [("all_reduce", dtype, numel, redop) for redop in REDOPS
                    if supported(dtype, redop) and (redop == "SUM" or numel != LARGE_NUMEL)
                    and (bitwise or redop not in BITWISE)]
            out += [(op, dtype, numel, "SUM") for op in ("broadcast", "reduce", "all_gather", "gather", "scatter",
                                                        "reduce_scatter", "all_to_all", "send_recv")
                    if op != "send_recv" or world > 1]
    return out + [("barrier", torch.float32, 0, "SUM")]


def one_check(op, group, dev, dtype, numel, redop, seed):
    """Run `op` once on seeded inputs; None if this rank's result is right, else what differs."""
    rank, world = group.rank(), group.size()
    last = world - 1  # the root of rooted ops: not rank 0, which a default would hide
    per_rank = op in ("all_gather", "gather")
    in_numel = numel if per_rank or op in ("all_reduce", "broadcast", "reduce", "send_recv") else numel * world

    def input_of(r):
        return make_input(seed, r, in_numel, dtype, redop)

    mine = input_of(rank).to(dev)
    name = f"{op} {str(dtype)[6:]} x{in_numel}" + (f" {redop}" if op in ("all_reduce", "reduce", "reduce_scatter") else "")
    if op == "barrier":
        dist.barrier(group=group)
        return None
    if op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"):
        out = torch.empty(in_numel * world if op == "all_gather" else numel if op == "reduce_scatter" else in_numel,
                          dtype=dtype, device=dev)
        got = call(op, group, mine, out, redop, last)
        return mismatch(name, got, collective_reference(op, input_of, rank, world, redop, last), world)
    root = dist.get_global_rank(group, last)
    if op == "reduce":
        dist.reduce(mine, dst=root, op=REDOPS[redop], group=group)
        return mismatch(name, mine, reduce_reference(map(input_of, range(world)), redop), world) if rank == last else None
    if op == "gather":
        outs = [torch.empty(in_numel, dtype=dtype, device=dev) for _ in range(world)] if rank == last else None
        dist.gather(mine, outs, dst=root, group=group)
        return mismatch(name, torch.cat(outs), torch.cat([input_of(r) for r in range(world)]), world) if outs else None
    if op == "scatter":
        out = torch.empty(numel, dtype=dtype, device=dev)
        dist.scatter(out, list(mine.chunk(world)) if rank == last else None, src=root, group=group)
        return mismatch(name, out, input_of(last).chunk(world)[rank], world)
    # send_recv: a ring, each rank's input to the next rank
    out = torch.empty(in_numel, dtype=dtype, device=dev)
    to, frm = (rank + 1) % world, (rank - 1) % world
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, dist.get_global_rank(group, to), group),
                                    dist.P2POp(dist.irecv, out, dist.get_global_rank(group, frm), group)])
    for w in works:
        w.wait()
    return mismatch(name, out, input_of(frm), world)


def run_checks(group, dev, world, bitwise=True):
    """Every case on `group`: [(name, failure or None)] of this rank. Stops at the first exception
    (the ranks no longer agree on which call comes next), recording it."""
    results = []
    for seed, (op, dtype, numel, redop) in enumerate(cases(world, bitwise)):
        name = f"{op} {str(dtype)[6:]} {numel} {redop if op in ('all_reduce', 'reduce', 'reduce_scatter') else ''}".strip()
        try:
            results.append((name, one_check(op, group, dev, dtype, numel, redop, seed)))
        except Exception as e:  # noqa: BLE001  (recorded in the verdict, with its traceback in the log)
            results.append((name, f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}"))
            break
    return results


def world_report(args):
    """One world's checks, on every rank; rank 0 writes what all found to args.report."""
    import torch_hca

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device(args.device)
    report = dict(world_size=world, device=str(dev), modes={})
    started = time.perf_counter()
    for label, options in modes(world):
        # The pass-through hands CUDA tensors to stock NCCL, which refuses several ranks on one GPU.
        refusal = stock_refusal("nccl", dev, world) if options.algorithm == "nccl" and dev.type == "cuda" else None
        if refusal:
            report["modes"][label] = dict(checks=[], failures={}, incomplete=False, skipped=refusal)
            continue
        group = dist.new_group(backend="hca", pg_options=options, timeout=datetime.timedelta(seconds=args.timeout))
        # CUDA tensors under the pass-through go to NCCL, which has no bitwise reductions.
        results = run_checks(group, dev, world, bitwise=not (options.algorithm == "nccl" and dev.type == "cuda"))
        if label == "hierarchical_copy":
            found = torch_hca.hierarchy(group)
            report["hierarchy"] = str(found["cuda" if dev.type == "cuda" else "cpu"])
            report["places"] = found["places"]
        dist.destroy_process_group(group)
        everyone = [None] * world
        dist.all_gather_object(everyone, results)
        failures = {}
        for r, mine in enumerate(everyone):
            for name, failure in mine:
                if failure:
                    failures.setdefault(name, f"rank {r}: {failure}")
        report["modes"][label] = dict(checks=[name for name, _ in everyone[0]], failures=failures,
                                      incomplete=len({len(m) for m in everyone}) > 1 or any(
                                          "raised" in f for f in failures.values()))
    report["seconds"] = time.perf_counter() - started
    report["explain"] = explained(Options.from_env(), world, dev, args.timeout)
    if rank == 0:
        with open(args.report, "w") as f:
            json.dump(report, f)


def explained(shown, world, dev, timeout_s):
    """explain's plan of a 1 MiB all_reduce under the options `shown`, for a running group of them that
    has staged once: its slot, its staging and (CUDA tensors) its choice depend on where the ranks
    run, which explain alone cannot know. The nccl pass-through has no such group: its packing."""
    import torch_hca

    group = None
    if shown.algorithm != "nccl":
        group = dist.new_group(backend="hca", pg_options=shown, timeout=datetime.timedelta(seconds=timeout_s))
        dist.all_reduce(torch.ones(1, device=dev), group=group)
    text = str(torch_hca.explain(world, shown.algorithm, shown.num_packs, numels=[1 << 18], device=dev.type,
                                 group=group))
    if group is not None:
        dist.destroy_process_group(group)
    return text


def verdict(reports, log_path):
    """The screen's text: per world, the hierarchy, checks and failures; then PASS or FAIL."""
    lines, failed, total = [], 0, 0
    for rep in reports:
        checks = sum(len(m["checks"]) for m in rep["modes"].values())
        bad = {f"{mode}: {name}": f for mode, m in rep["modes"].items() for name, f in m["failures"].items()}
        total, failed = total + checks, failed + len(bad)
        lines.append(f"  {rep['world_size']} ranks on {rep['device']}: {checks - len(bad)} of {checks} checks right "
                     f"in {rep['seconds']:.1f} s; hierarchy: {rep['hierarchy']}")
        lines += [f"    skipped {mode}: {m['skipped']}" for mode, m in rep["modes"].items() if m.get("skipped")]
        for (key, failure) in list(bad.items())[:SHOWN_FAILURES]:
            lines.append(f"    FAILED {key}: {failure.splitlines()[0]}")
        if len(bad) > SHOWN_FAILURES:
            lines.append(f"    ... and {len(bad) - SHOWN_FAILURES} more (in the log)")
    explain = reports[-1]["explain"].splitlines()
    lines.append(f"  what explain plans for a 1 MiB float all_reduce on {reports[-1]['world_size']} ranks "
                 f"(default options):")
    lines += ["    " + line for line in explain[:8]] + (["    ..."] if len(explain) > 8 else [])
    word = "PASS" if failed == 0 else "FAIL"
    lines.append(f"{word}: {total - failed} of {total} checks right; full log: {log_path}")
    return "\n".join(lines), failed


def new_log(stamp):
    """A log file of this user's alone, under a name no one else can plant first (a file or a link
    put in the shared temporary folder at a predictable name would be written into)."""
    fd, path = tempfile.mkstemp(prefix=f"torch_hca_check-{stamp}-", suffix=".log")  # O_EXCL, mode 0600
    os.close(fd)
    return path


def write_log(reports, path):
    with open(path, "w") as f:
        for rep in reports:
            f.write(f"# {rep['world_size']} ranks on {rep['device']}\n# places: {rep['places']}\n"
                    f"# hierarchy: {rep['hierarchy']}\n")
            for mode, m in rep["modes"].items():
                if m.get("skipped"):
                    f.write(f"# skipped {mode}: {m['skipped']}\n")
                for name in m["checks"]:
                    failure = m["failures"].get(name)
                    f.write(f"{'FAILED' if failure else 'ok':6} {mode}: {name}{': ' + failure if failure else ''}\n")
            f.write(f"# explain:\n{rep['explain']}\n\n")


def parser():
    p = argparse.ArgumentParser(prog="python -m torch_hca.check", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int_list_arg("rank counts such as 1,2,3", 1), default="1,2,3",
                   help="ranks to spawn, one run each (not under torchrun)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda where a GPU is")
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait for its peers")
    p.add_argument("--log", help="every check's line (default: a new file in the temporary directory)")
    p.add_argument("--json", default="torch_hca_check.json", help="the counts and failures")
    return p


def main(argv=None):
    from tqdm import tqdm

    args = parser().parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_path = os.path.abspath(args.log) if args.log else None
    worlds = [int(os.environ["WORLD_SIZE"])] if launched_by_torchrun() else args.world_sizes
    reports = []
    with tempfile.TemporaryDirectory(prefix="torch_hca-check-") as tmp:
        for world in tqdm(worlds, desc="worlds", unit="world", file=sys.stderr, disable=None, leave=False):
            args.report = os.path.join(tmp, f"report-{world}.json")
            run_on_ranks(world_report, args, world)
            if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
                return 0
            with open(args.report) as f:
                reports.append(json.load(f))
    log_path = log_path or new_log(stamp)
    text, failed = verdict(reports, log_path)
    write_log(reports, log_path)
    with open(args.json, "w") as f:
        json.dump(dict(torch=torch.__version__, date=stamp, log=log_path, failed=failed, reports=reports), f, indent=1)
    print(f"torch_hca.check: torch {torch.__version__}, {os.cpu_count()} cores, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}\n{text}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
