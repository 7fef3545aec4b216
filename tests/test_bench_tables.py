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


def test_the_summary_blames_noise_only_where_it_knows_what_the_defaults_ran():
    chosen = bench.defaults_vs_best([{**row(bench.DEFAULTS, 11.0), "ran": "hca/a"}, row("hca/a", 10.0)])
    assert bench.within_summary(chosen).endswith("at 0 of 1 sizes; of the 1 others, 1 ran that very setting "
                                                 "(the gap is noise)")
    swept = bench.defaults_vs_best([row(bench.DEFAULTS, 11.0), row("hca/a", 10.0)])
    assert "timed each setting after the other" in bench.within_summary(swept) and "noise" not in bench.within_summary(swept)
    assert bench.within_summary(bench.defaults_vs_best([row(bench.DEFAULTS, 10.0), row("hca/a", 10.0)])) == \
        "the defaults within 1.05x of the fastest fixed setting at 1 of 1 sizes"


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
    (["--busy", "-1"], "--busy: expected 0 or more processes, got -1"),
    (["--step", "1"], "--min-bytes, --max-bytes, --step: sizes grow by this factor, so it must be 2 or more"),
])
def test_the_benchmark_names_a_wrong_argument_before_any_launch(args, needle, capsys):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert needle in capsys.readouterr().err
