"""benchmarks/bench.py's table of the defaults beside the fastest fixed setting: the held-out ratio
picks the fastest on some batches and times it on others, so that settings taking the same time do
not make the defaults look slower (the fastest of several draws is the luckiest)."""
import os
import sys

import pytest
import torch.distributed as dist

from harness import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench  # noqa: E402


def row(backend, time_us, halves_us=None):
    return dict(op="all_reduce", world_size=3, size=64, backend=backend, time_us=time_us,
                **({"halves_us": halves_us} if halves_us else {}))


def test_held_out_ratio_is_free_of_the_luckiest_draw():
    # Two fixed settings as fast as the defaults, each lucky in one half of the batches.
    rows = [row(bench.DEFAULTS, 11.0, [11.0, 11.0]), row("hca/a", 10.5, [10.0, 12.0]), row("hca/b", 10.5, [12.0, 10.0])]
    [t] = bench.defaults_vs_best(rows)
    assert t["ratio"] == pytest.approx(11 / 10.5)  # the luckiest draw's bias
    assert t["held_out"] == pytest.approx(11 / 12)  # a picked on half 0, timed on half 1; b the other way


def test_held_out_ratio_still_sees_slower_defaults():
    rows = [row(bench.DEFAULTS, 15.0, [15.0, 16.0]), row("hca/a", 10.0, [10.0, 10.0]), row("hca/b", 12.0, [12.0, 11.0])]
    [t] = bench.defaults_vs_best(rows)
    assert t["best_fixed"] == "hca/a" and t["ratio"] == pytest.approx(1.5)
    assert t["held_out"] == pytest.approx((16 / 10 + 15 / 10) / 2)


def test_no_held_out_ratio_without_halves():
    [t] = bench.defaults_vs_best([row(bench.DEFAULTS, 11.0), row("hca/a", 10.0)])
    assert t["held_out"] is None


def test_the_summary_blames_noise_only_where_the_fastest_setting_ran_the_defaults_plan():
    def table(same_plan):
        return bench.defaults_vs_best([{**row(bench.DEFAULTS, 11.0, [11.0, 11.0]), "same_plan": same_plan},
                                       row("hca/a", 10.0, [10.0, 10.0]), row("hca/b", 10.5, [10.5, 10.5])])
    [same] = table(["hca/a"])
    assert same["same_plan"] is True
    assert bench.within_summary([same]).startswith("the defaults within 1.05x of the fastest fixed setting at 0 of 1 "
                                                   "sizes; of the 1 others, 1 ran the very plan of that setting")
    [other] = table(["hca/b"])  # the defaults ran b's plan, and a, another plan, was faster
    assert other["same_plan"] is False and ", 0 ran the very plan of that setting" in bench.within_summary([other])
    swept = bench.defaults_vs_best([row(bench.DEFAULTS, 11.0), row("hca/a", 10.0)])
    assert swept[0]["same_plan"] is None
    assert "timed each setting after the other" in bench.within_summary(swept) and "noise" not in bench.within_summary(swept)
    assert bench.within_summary(bench.defaults_vs_best([row(bench.DEFAULTS, 10.0), row("hca/a", 10.0)])) == \
        "the defaults within 1.05x of the fastest fixed setting at 1 of 1 sizes"


def plans_of_the_choice_settings(rank, world):
    """What time_choices records of the plans: at 2 ranks a small all-reduce's one pack and
    reduce_to_one_device are one plan; a broadcast's is every setting's on one node."""
    options = bench.hca_settings(world, "cpu")
    groups = {label: dist.new_group(backend="hca", pg_options=opts) for label, opts in options.items()}
    out = {}
    for op, numel in (("all_reduce", 16), ("broadcast", 1 << 20)):
        plans = bench.plans_of(groups, options, op, numel, "cpu")
        one_pack = plans["hca/hierarchical_copy"]
        out[op] = sorted(label for label in options if bench.same_schedule(plans[label], one_pack))
    return out


def test_settings_that_run_one_plan_are_found_alike():
    [plans, _] = run_ranks(plans_of_the_choice_settings, 2)
    assert plans["all_reduce"] == sorted([bench.DEFAULTS, "hca/hierarchical_copy", "hca/reduce_to_one_device"])
    assert plans["broadcast"] == sorted(bench.hca_settings(2, "cpu"))


def test_the_table_takes_the_alternating_timings_of_their_op_and_the_sweep_for_the_others():
    choices = [dict(row(bench.DEFAULTS, 10.0), timing="alternating"), dict(row("hca/a", 9.0), timing="alternating")]
    swept = [row(bench.DEFAULTS, 30.0), row("hca/a", 1.0), dict(row(bench.DEFAULTS, 5.0), op="broadcast"),
             dict(row("hca/a", 4.0), op="broadcast")]
    table = bench.defaults_vs_best(bench.compared_rows(choices, swept))
    assert [(t["op"], t["default_us"], t["best_fixed_us"]) for t in table] == [("all_reduce", 10.0, 9.0),
                                                                                ("broadcast", 5.0, 4.0)]


def halves_of_known_samples(rank, world):
    # The slowest rank's time in each batch (rank 1 is slower in odd batches), split 0,1,4,5,.. / 2,3,6,7,..
    samples = {"m": [float(b + (100 if rank == 1 and b % 2 else 0)) for b in range(8)]}
    return bench.split_halves(samples, dist.group.WORLD)


def test_split_halves_takes_each_batchs_slowest_rank_and_both_orders_in_each_half():
    halves = run_ranks(halves_of_known_samples, 2, backend="gloo")
    # half 0: batches 0, 1, 4, 5 -> 0, 101, 4, 105; half 1: 2, 3, 6, 7 -> 2, 103, 6, 107
    assert halves == [{"m": [(4 + 101) / 2, (6 + 103) / 2]}] * 2


@pytest.mark.parametrize("args, needle", [
    (["--ops", "allreduce,nope"], "--ops: unknown 'nope' (expected some of all_reduce, broadcast"),  # a KeyError in every rank
    (["--world-sizes", "0"], "--world-sizes: expected integers such as 2,4, each 1 or more, got '0'"),  # a missing file
    (["--latency-world-sizes", "1,x"], "--latency-world-sizes: expected integers such as 2,4, each 1 or more"),
    (["--choice-world-sizes", "1,2"], "--choice-world-sizes: expected integers such as 2,4, each 2 or more"),
    (["--busy", "-1"], "--busy: expected 0 or more processes, got -1"),
    (["--step", "1"], "--min-bytes, --max-bytes, --step: sizes grow by this factor, so it must be 2 or more"),
])
def test_the_benchmark_names_a_wrong_argument_before_any_launch(args, needle, capsys):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert needle in capsys.readouterr().err


def test_score_choice_counts_where_a_models_choice_came_within_5_percent_of_the_fastest(tmp_path, capsys):
    """One run of 2 ranks: one pack fastest at 4 B, a pack per rank 1.2x faster at 1 MiB, direct within
    5% at 64 KiB. The shipped table (a pack per rank from a few KiB) scores all three; a cached model
    that always keeps one pack, the 4 B size only. The defaults' own rows are not settings, and the
    broadcasts timed beside the all-reduces are not what the model chooses for."""
    import json

    import score_choice
    from torch_hca import costs

    times = {4: {"hierarchical_copy": 5.0, "hierarchical_copy(num_packs=2)": 6.0, "direct": 5.5},
             64 << 10: {"hierarchical_copy": 12.0, "hierarchical_copy(num_packs=2)": 10.4, "direct": 10.0},
             1 << 20: {"hierarchical_copy": 120.0, "hierarchical_copy(num_packs=2)": 100.0, "direct": 110.0}}
    choices = [dict(op="all_reduce", backend=f"hca/{label}", world_size=2, size=size, time_us=t)
               for size, by_label in times.items() for label, t in by_label.items()]
    choices += [dict(op="all_reduce", backend=bench.DEFAULTS, world_size=2, size=size, time_us=1.0) for size in times]
    # Broadcasts where one pack is the slowest by far: scored as all-reduces, the shipped table's 4 B would miss.
    choices += [dict(op="broadcast", backend=f"hca/{label}", world_size=2, size=size, time_us=100.0 if label ==
                     "hierarchical_copy" else 1.0) for size, by_label in times.items() for label in by_label]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"cores": 2}, "choices": choices}))
    one_pack_always = costs.CostModel({name: costs.Line(0.0 if name == "one_pack" else 1e6, 1e9)
                                       for name in costs.CANDIDATES}, "test")
    costs.save(one_pack_always, {}, tmp_path / "cache" / "costs-2ranks-2cpus-test.json")
    score_choice.main([str(run), "--cache", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert "the shipped table: 2 ranks 3/3; all 3/3" in out, out
    assert f"the calibrations in {tmp_path / 'cache'}: 2 ranks 1/3; all 1/3" in out, out
    with pytest.raises(SystemExit):
        score_choice.main([str(run), "--cache", str(tmp_path / "empty")])
    assert "no calibration" in capsys.readouterr().err


def test_score_choice_bounds_a_model_by_the_setting_that_missed_least_at_each_size(tmp_path, capsys):
    """Two runs of 2 ranks that disagree at 4 B (one pack 1.2x faster in one, direct 1.3x faster in the
    other) and agree at 1 MiB (a pack per rank). Picked on the other file, each run gets the other's
    winner at 4 B: 2 of 4. Picked on both, direct (as often missed, the lower median ratio): 3 of 4."""
    import json

    import score_choice

    def run(name, at_4_bytes):
        times = {4: at_4_bytes, 1 << 20: {"hierarchical_copy": 120.0, "hierarchical_copy(num_packs=2)": 100.0,
                                          "direct": 110.0}}
        choices = [dict(op="all_reduce", backend=f"hca/{label}", world_size=2, size=size, time_us=t)
                   for size, by_label in times.items() for label, t in by_label.items()]
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"cores": 2}, "choices": choices}))
        return str(path)

    runs = [run("a.json", {"hierarchical_copy": 5.0, "direct": 6.0}),
            run("b.json", {"hierarchical_copy": 6.5, "direct": 5.0})]
    score_choice.main(runs)
    out = capsys.readouterr().out
    assert "the least-missed setting per size, picked on the other files: 2 ranks 2/4; all 2/4" in out, out
    assert "the least-missed setting per size, picked on all files: 2 ranks 3/4; all 3/4" in out, out
    score_choice.main(runs[:1])
    out = capsys.readouterr().out
    assert "picked on the other files" not in out and "picked on all files: 2 ranks 2/2" in out, out


def test_shared_cpu_counts_slow_batches_and_those_that_ended_on_one_cpu():
    import shared_cpu

    rows = [dict(median_us=6.0, cpus_before=[0, 1], cpus_after=[0, 1]),
            dict(median_us=25.0, cpus_before=[0, 1], cpus_after=[1, 1]),  # met during the batch
            dict(median_us=7.0, cpus_before=[0, 0], cpus_after=[1, 0]),  # parted during it
            dict(median_us=13.0, cpus_before=[1, 0], cpus_after=[1, 0])]
    assert shared_cpu.summary(rows) == dict(batches=4, median_us=10.0, max_us=25.0, over_twice_the_median=1,
                                            ended_sharing_a_cpu=1)
