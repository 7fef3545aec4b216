"""How well a cost model would have chosen, scored on the fixed settings' times of `bench.py --ops choice` runs.

    python benchmarks/score_choice.py benchmarks/results/cpu-choice-ranks2_3_4-2026-11-30.json
    python benchmarks/score_choice.py runs/*.json --cache ~/.cache/torch_hca   # a calibration beside the table

For every world size and message size of the runs, the model's choice (torch_hca.costs) is looked
up among the fixed settings timed there, and counted as good where it came within 1.05x of the
fastest fixed setting of that run. Scored on runs other than those a model was fitted to, this says
whether a calibration chooses better than the shipped table (docs/history/performance-log.md did so on
2026-11-30), without timing the defaults again.

Beside the models, two bounds that no model has to meet (each size chosen apart from its
neighbours): for each file, the fixed setting that missed least often at that world and message size
in the other files (sizes that no other file timed are left out); and the same picked on all files,
itself included. Where even these miss, the runs disagree with each other: the misses are noise.
"""
from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import statistics
from collections import defaultdict

from bench import fixed_label
from torch_hca import costs

WITHIN = 1.05


@functools.lru_cache(maxsize=None)
def choice_runs(path):
    """The alternating rows of each `--ops choice` run in a results file (one run, or {"runs": [...]}),
    with the run's CPU count; each file read once, however often the models and bounds score it."""
    record = json.loads(pathlib.Path(path).read_text())
    return tuple((run["meta"].get("cores"), run["choices"]) for run in record.get("runs", [record]))


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


def score(choose, paths):
    """world -> (good, sizes) of the fixed settings `choose(path, world, cpus, nbytes)` names (None: no
    choice there), each counted good where it came within WITHIN of the fastest fixed setting of its run."""
    tally = {}
    for path in paths:
        for cpus, choices in choice_runs(path):
            for (world, nbytes), times in fixed_times(choices).items():
                label = choose(path, world, cpus, nbytes)
                if label not in times:
                    continue
                good, sizes = tally.get(world, (0, 0))
                tally[world] = (good + (times[label] <= WITHIN * min(times.values())), sizes + 1)
    return tally


def model_choice(model_of):
    """A `choose` of score(): the fixed setting of the choice of `model_of(world, cpus)` (None: no model)."""
    def choose(path, world, cpus, nbytes):
        model = model_of(world, cpus)
        return fixed_label(model.choose(nbytes), world) if model else None
    return choose


def least_missed(paths):
    """(world, bytes) -> the fixed setting that came within WITHIN of the fastest least often over the runs
    in `paths` (a tie: the lower median time over the fastest)."""
    ratios = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for _, choices in choice_runs(path):
            for key, times in fixed_times(choices).items():
                fastest = min(times.values())
                for label, t in times.items():
                    ratios[key][label].append(t / fastest)
    return {key: min(by_label, key=lambda label: (sum(r > WITHIN for r in by_label[label]),
                                                   statistics.median(by_label[label])))
            for key, by_label in ratios.items()}


def bounds(paths):
    """The per-size bounds of the docstring (the held-out one where there are 2 files or more), by name,
    as `choose` functions of score()."""
    everywhere = least_missed(paths)
    found = {"the least-missed setting per size, picked on all files":
             lambda path, world, cpus, nbytes: everywhere.get((world, nbytes))}
    if len(set(paths)) > 1:
        others = {path: least_missed([p for p in paths if p != path]) for path in paths}
        found = {"the least-missed setting per size, picked on the other files":
                 lambda path, world, cpus, nbytes: others[path].get((world, nbytes)), **found}
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="results files of bench.py --ops choice (JSON)")
    parser.add_argument("--cache", action="append", default=[],
                        help="a folder of cached calibrations (TORCH_HCA_CACHE_DIR) to score beside the shipped table")
    args = parser.parse_args(argv)
    models = {"the shipped table": model_choice(lambda world, cpus: costs.shipped(world, cpus or world))}
    for folder in args.cache:
        cached = cached_models(folder)
        if not cached:
            parser.error(f"--cache {folder}: no calibration (costs-<N>ranks-*.json) there")
        models[f"the calibrations in {folder}"] = model_choice(lambda world, cpus, cached=cached: cached.get(world))
    models.update(bounds(args.runs))
    print(f"choices within {WITHIN}x of the fastest fixed setting, by world size:")
    for name, choose in models.items():
        tally = score(choose, args.runs)
        cells = [f"{world} ranks {good}/{sizes}" for world, (good, sizes) in sorted(tally.items())]
        total = [sum(t[i] for t in tally.values()) for i in (0, 1)]
        print(f"  {name}: " + ", ".join(cells) + f"; all {total[0]}/{total[1]}")


if __name__ == "__main__":
    main()
