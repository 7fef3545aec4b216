"""How well a cost model would have chosen, scored on the fixed settings' times of `bench.py --ops choice` runs.

    python benchmarks/score_choice.py benchmarks/results/cpu-choice-ranks2_3_4-2026-11-30.json
    python benchmarks/score_choice.py runs/*.json --cache ~/.cache/torch_hca   # a calibration beside the table

For every world size and message size of the runs, the model's choice (torch_hca.costs) is looked
up among the fixed settings timed there, and counted as good where it came within 1.05x of the
fastest fixed setting of that run. Scored on runs other than those a model was fitted to, this says
whether a calibration chooses better than the shipped table (docs/performance.md did so on
2026-11-30), without timing the defaults again.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re

from bench import fixed_label
from torch_hca import costs

WITHIN = 1.05


def choice_runs(path):
    """The alternating rows of each `--ops choice` run in a results file (one run, or {"runs": [...]}),
    with the run's CPU count."""
    record = json.loads(pathlib.Path(path).read_text())
    for run in record.get("runs", [record]):
        yield run["meta"].get("cores"), run["choices"]


def fixed_times(choices):
    """(world, bytes) -> {label: µs} of the fixed settings' all-reduces, which the cost model chooses for (the
    defaults' rows left out, and the broadcasts that runs since 2026-11-30 time beside them)."""
    times = {}
    for row in choices:
        if row["backend"].startswith("hca/") and row.get("op", "all_reduce") == "all_reduce":
            times.setdefault((row["world_size"], row["size"]), {})[row["backend"][len("hca/"):]] = row["time_us"]
    return times


def cached_models(folder):
    """world -> the cached calibration of that many ranks in `folder` (costs-<world>ranks-*.json)."""
    models = {}
    for path in sorted(pathlib.Path(folder).glob("costs-*ranks-*.json")):
        world = int(re.match(r"costs-(\d+)ranks-", path.name).group(1))
        model = costs.load(path)
        if model:
            models[world] = model
    return models


def score(model_of, paths):
    """world -> (good, sizes) of the choices `model_of(world, cpus)` makes (None: no model for that world)."""
    tally = {}
    for path in paths:
        for cpus, choices in choice_runs(path):
            for (world, nbytes), times in fixed_times(choices).items():
                model = model_of(world, cpus)
                label = fixed_label(model.choose(nbytes), world) if model else None
                if label not in times:
                    continue
                good, sizes = tally.get(world, (0, 0))
                tally[world] = (good + (times[label] <= WITHIN * min(times.values())), sizes + 1)
    return tally


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="results files of bench.py --ops choice (JSON)")
    parser.add_argument("--cache", action="append", default=[],
                        help="a folder of cached calibrations (TORCH_HCA_CACHE_DIR) to score beside the shipped table")
    args = parser.parse_args(argv)
    models = {"the shipped table": lambda world, cpus: costs.shipped(world, cpus or world)}
    for folder in args.cache:
        cached = cached_models(folder)
        if not cached:
            parser.error(f"--cache {folder}: no calibration (costs-<N>ranks-*.json) there")
        models[f"the calibrations in {folder}"] = lambda world, cpus, cached=cached: cached.get(world)
    print(f"choices within {WITHIN}x of the fastest fixed setting, by world size:")
    for name, model_of in models.items():
        tally = score(model_of, args.runs)
        cells = [f"{world} ranks {good}/{sizes}" for world, (good, sizes) in sorted(tally.items())]
        total = [sum(t[i] for t in tally.values()) for i in (0, 1)]
        print(f"  {name}: " + ", ".join(cells) + f"; all {total[0]}/{total[1]}")


if __name__ == "__main__":
    main()
