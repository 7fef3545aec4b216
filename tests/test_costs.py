"""The cost model that chooses num_packs per call (torch_hca.costs): its lines and the choice they
make, the shipped table, a calibration cached per machine and world shape, and rank 0's model
used by every rank whatever the others have cached or asked for."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torch_hca
from torch_hca import costs
from harness import RankFailed, run_ranks
from reference import make_input, mismatch, reduce_reference


def test_a_fit_recovers_the_line_through_its_points():
    line = costs.fit([(b, 20 + b / 1500) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)])
    assert line.fixed_us == pytest.approx(20) and line.bytes_per_us == pytest.approx(1500)


@pytest.mark.parametrize("one_pack, per_rank, expect", [
    ((30, 1000), (40, 3000), "crossover"),  # dearer to start, faster per byte: from some size
    ((30, 1000), (20, 3000), 1),            # ahead everywhere
    ((30, 3000), (40, 1000), costs.NEVER),  # behind everywhere
    ((30, 3000), (10, 1000), costs.NEVER),  # ahead only for small calls: noise, one pack kept
])
def test_a_pack_per_rank_is_chosen_where_it_is_predicted_5_percent_faster(one_pack, per_rank, expect):
    model = costs.CostModel(costs.Line(*one_pack), costs.Line(*per_rank), "test")
    threshold = model.pack_per_rank_from_bytes()

    def ahead(nbytes):
        t = model.predict_us(nbytes)
        return t["pack_per_rank"] <= 0.95 * t["one_pack"]

    if expect == "crossover":
        assert 1 < threshold < costs.NEVER and ahead(threshold) and not ahead(threshold - 1), threshold
        assert ahead(64 << 20) and not ahead(4)
    else:
        assert threshold == expect


@pytest.mark.parametrize("world, cpus", [(2, 2), (3, 2), (4, 2), (4, 8), (8, 2)])
def test_explain_shows_each_candidates_predicted_time_and_the_choice(world, cpus):
    model = costs.shipped(world, cpus)
    threshold = model.pack_per_rank_from_bytes()
    sizes = [4, 1 << 20, 64 << 20] + ([threshold - 4, threshold] if 4 < threshold < costs.NEVER else [])
    for nbytes in sizes:
        plan = torch_hca.explain(world, numels=[nbytes // 4], cpus=cpus)
        want = model.predict_us(nbytes // 4 * 4)
        assert plan.predicted_us == pytest.approx(want), (nbytes, plan.predicted_us, want)
        faster = want["pack_per_rank"] <= 0.95 * want["one_pack"]
        assert len(plan.packs) == (min(world, nbytes // 4) if faster else 1), (nbytes, plan.text)
        assert f"predicted: one pack {want['one_pack']:.1f} us, a pack per rank {want['pack_per_rank']:.1f} us" \
            in plan.text and model.origin in plan.text


def test_the_shipped_table_gives_what_its_machine_measured():
    """2 ranks with a CPU each: a pack per rank from a few KiB (measured ahead from 64 KiB on, and
    level at 4 KiB); 3 ranks taking turns on 2 CPUs: a pack per rank was never 5% ahead for long."""
    assert 1 << 10 < costs.shipped(2, 2).pack_per_rank_from_bytes() < 64 << 10
    assert costs.shipped(3, 2).pack_per_rank_from_bytes() == costs.NEVER
    assert "shipped table (2 ranks" in costs.shipped(8, 16).origin  # a CPU each: the 2-rank lines
    with pytest.raises(ValueError, match="TORCH_HCA_CALIBRATE"):
        costs.calibrate_mode({"TORCH_HCA_CALIBRATE": "yes"})


def _model_in_use(rank, world):
    """The model this rank's group uses, how many packs it gives 1000 floats, and an all-reduce's
    result checked against the float64 reference."""
    model = torch_hca.hierarchy()["cost_model"]
    inputs = [make_input(7, r, 1000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    packs = len(torch_hca.explain(numels=[1000], group=dist.group.WORLD).packs)
    return model.origin, packs, mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), world)


def test_a_calibration_is_cached_and_rank_0s_model_is_everyones(tmp_path):
    mine, theirs = tmp_path / "rank0", tmp_path / "rank1"
    env = {**os.environ, "TORCH_HCA_CACHE_DIR": str(mine)}
    out = subprocess.run([sys.executable, "-m", "torch_hca.calibrate", "--world-size", "2"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [cached] = mine.glob("costs-2ranks-*.json")
    assert "calibrated on this machine" in out.stdout and str(cached) in out.stdout, out.stdout
    points = json.loads(cached.read_text())["points"]
    for name in costs.CANDIDATES:
        assert [b for b, _ in points[name]] == list(costs.CALIBRATION_BYTES)
        assert all(us > 0 for _, us in points[name]), points
    # Rank 0's cache says a pack per rank always, rank 1's never; rank 1 also asks to calibrate.
    record = json.loads(cached.read_text())
    record["model"] = costs.CostModel(costs.Line(100, 100), costs.Line(0, 1e6), "rank 0's cache").to_json()
    cached.write_text(json.dumps(record))
    theirs.mkdir()
    record["model"] = costs.CostModel(costs.Line(0, 1e6), costs.Line(100, 100), "rank 1's cache").to_json()
    (theirs / cached.name).write_text(json.dumps(record))
    before = (theirs / cached.name).read_text()
    results = run_ranks(_model_in_use, 2, env_per_rank=[
        {"TORCH_HCA_CACHE_DIR": str(mine)}, {"TORCH_HCA_CACHE_DIR": str(theirs), "TORCH_HCA_CALIBRATE": "force"}])
    assert results == [("rank 0's cache", 2, None)] * 2, results
    assert (theirs / cached.name).read_text() == before  # rank 1 measured nothing


def _nothing(rank, world):
    return None


def test_a_wrong_calibrate_value_on_rank_0_fails_every_rank_at_init():
    """Only rank 0's variable counts: the others raise its error at once instead of waiting for it."""
    with pytest.raises(RankFailed) as failed:
        run_ranks(_nothing, 2, env_per_rank=[{"TORCH_HCA_CALIBRATE": "yes"}, {}], pg_timeout_s=600, deadline_s=60)
    assert str(failed.value).count("ValueError: hca: rank 0's TORCH_HCA_CALIBRATE='yes'") == 2, failed.value
