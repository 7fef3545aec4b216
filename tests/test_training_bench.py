"""benchmarks/training.py measures what it says: the collectives it replays are the ones DDP and
FSDP2 issued in a step (sizes from the model's parameters), and every contender gives every mode."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import training  # noqa: E402


@pytest.mark.parametrize("args, needle", [
    (["--models", "bogus"], "--models: unknown 'bogus' (expected some of transformer, wide-mlp, tiny)"),
    (["--wrappers", "ddp,nope"], "--wrappers: unknown 'nope'"),
    (["--world-sizes", "1"], "--world-sizes: expected integers such as 2,4, each 2 or more, got '1'"),
    (["--steps", "0"], "--rounds, --steps and --batches: need 1 or more each"),  # a division by zero before
    (["--contenders", "nope"], "--contenders: none of 'nope' runs at 2 ranks (the contenders there: gloo, hca"),
])
def test_training_benchmark_names_a_wrong_argument_before_any_launch(args, needle, capsys):
    with pytest.raises(SystemExit):
        training.main(args)
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("world", [2, 3])  # FSDP2 issues no collectives at 1
def test_training_benchmark_replays_the_steps_collectives(world, tmp_path):
    # At 2 ranks every contender is named, the pass-through (run only where named) among them.
    named = world == 2
    result = training.main(["--models", "tiny", "--world-sizes", str(world), "--wrappers", "ddp,fsdp2",
                            "--rounds", "1", "--steps", "1", "--batches", "2", "--out", str(tmp_path)]
                           + ["--after-compute"] * (world == 3)
                           + ["--contenders", ",".join(c[0] for c in training.contenders(world, named=True))] * named)
    model, _ = training.tiny()
    numels = [sum(p.numel() for p in layer.parameters()) for layer in model if list(layer.parameters())]
    # FSDP2 pads each parameter's dim 0 to a multiple of the world size.
    padded = [sum(math.ceil(p.shape[0] / world) * world * p[0].numel() for p in layer.parameters())
              for layer in model if list(layer.parameters())]
    launches = result["launches"]
    assert {(r["wrapper"], r["contender"]) for r in launches} == {
        (w, c) for w in ("ddp", "fsdp2") for c, _, _ in training.contenders(world, named=named)}
    replays = ("alone", "after_compute") if world == 3 else ("alone",)
    for r in launches:
        assert all(r[f"{m}_ms"] > 0 for m in ("step", "local", "bookkeeping") + replays), r
        assert ("after_compute_ms" in r) == (world == 3), r  # timed where asked for only
        if r["wrapper"] == "ddp":
            assert sum(r["bucket_bytes"]) == r["bytes"] == 4 * sum(numels)
            for mode in ("step",) + replays:  # DDP's buckets, timed at each call through torch's allreduce_hook
                assert 0 <= r[f"{mode}_collectives_after_last_arrival_ms"] <= r[f"{mode}_collectives_inside_ms"], r
        else:
            gathers = [c for c in r["calls"] if c[0] == "gather"]
            scatters = [c for c in r["calls"] if c[0] == "scatter"]
            assert sorted(c[2] for c in scatters) == sorted(padded)  # each layer's gradients, once
            assert {c[1] for c in gathers} == set(padded) and len(gathers) >= len(padded)
            assert all(c[1] * world == c[2] for c in scatters) and all(c[2] * world == c[1] for c in gathers)
            for mode in ("step",) + replays:  # FSDP2's collectives, timed at each call
                assert 0 <= r[f"{mode}_collectives_after_last_arrival_ms"] <= r[f"{mode}_collectives_inside_ms"], r
                assert 0 <= r[f"{mode}_collectives_cpu_ms"] <= r[f"{mode}_collectives_inside_ms"] + 1, r
    table = result["table"]
    assert len(table) == len(launches)
    for row in table:
        assert row["comm_ms"] == pytest.approx(row["step_ms"] - row["local_ms"])
    assert (tmp_path / f"cpu-training-ranks{world}-{training.datetime.date.today().isoformat()}.png").exists()


def test_meeting_split_separates_waiting_for_peers_from_the_collectives_time():
    # 2 ranks, 2 calls of a mode, 2 collectives each (ns). Rank 1 arrives 3 ms late at the first
    # collective of each call; both leave 1 ms after the last arrival; at the second they meet.
    ms = 1_000_000
    entered = torch.tensor([[0, 10, 100, 110], [3, 10, 103, 110]]) * ms
    left = torch.tensor([[4, 12, 104, 112], [4, 12, 104, 113]]) * ms
    cpu = torch.tensor([[1, 2, 1, 1], [1, 1, 1, 4]]) * ms
    split = training.meeting_split(entered, left, cpu, calls_made=2)
    # Rank 0 spends 4 + 2 ms inside per call, rank 1 1 + 2 (then 1 + 3): the slowest, 6.
    assert split["inside_ms"] == pytest.approx(6.0)
    # After the last arrival: 3 ms per call, 4 in rank 1's second call; torch's median of (3, 4) is 3.
    assert split["after_last_arrival_ms"] == pytest.approx(3.0)
    assert split["cpu_ms"] == pytest.approx(3.0)  # the most per call: 3 (rank 0), then 5 (rank 1)
    unfinished = training.meeting_split(entered, left.clone().fill_(-1), cpu, 2)  # an end never seen
    assert all(math.isnan(v) for v in unfinished.values())


def test_meeting_split_of_overlapped_collectives_counts_the_steps_wait_once():
    # DDP's buckets: 2 ranks, 2 calls of a mode, 2 async all-reduces each, in flight together.
    # Call 1: the buckets enter at 0 and 5 (rank 0) and 1 and 8 (rank 1: its backward ran longer);
    # they end at 9 and 10 on both. Call 2: entries 100/104 and 100/103, ends 106/107 and 106/109.
    ms = 1_000_000
    entered = torch.tensor([[0, 5, 100, 104], [1, 8, 100, 103]]) * ms
    left = torch.tensor([[9, 10, 106, 107], [9, 10, 106, 109]]) * ms
    cpu = torch.tensor([[1, 1, 1, 1], [1, 1, 2, 1]]) * ms
    split = training.meeting_split(entered, left, cpu, calls_made=2, overlapped=True)
    # Inside, first entry to last end: call 1 10 and 9 ms (slowest 10); call 2 7 and 9 (9); torch's
    # median of two is the lower: 9.
    assert split["inside_ms"] == pytest.approx(9.0)
    # The step's wait, from the last rank's last bucket (8, then 104) to the last end: call 1 2 and 2,
    # call 2 3 and 5: slowest 2 and 5, median 2. Added up per collective, as for blocking ones, call 1
    # would count 8 + 2 ms after the last arrivals (at 1, then 8) and call 2 6 + 5: the overlap twice.
    assert split["after_last_arrival_ms"] == pytest.approx(2.0)
    assert split["cpu_ms"] == pytest.approx(2.0)  # issuing: 2 and 2, then 2 and 3
