"""hca's calls in torch's Flight Recorder: entries field by field beside gloo's, each rank's dump
when a call fails, and torch's analyzer over the dumps naming the rank that went astray."""
import json
import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import STREAMS_ENV, group_kind, run_ranks

EXECUTORS = [pytest.param({}, id="shm"), pytest.param(STREAMS_ENV, id="model")]
RECORDING = {"TORCH_FR_BUFFER_SIZE": "100"}


def _same_calls_on_hca_and_gloo(rank, world):
    """The same calls on the world group (hca) and on a gloo group of every rank, then a message
    on hca's; returns where hca records, the process's Flight Recorder dump and the Python frames
    its first entry names."""
    import torch_hca

    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # the world's (run_ranks')
    for group in (None, gloo):
        t = torch.arange(6, dtype=torch.float32) + rank
        for _ in range(3):
            dist.all_reduce(t, group=group)
        dist.broadcast(t, 0, group=group)
        outputs = [torch.empty(2, 3, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(outputs, torch.full((2, 3), float(rank), dtype=torch.float64), group=group)
    if world > 1 and rank < 2:
        message = torch.ones(5, dtype=torch.int32)
        dist.send(message, 1) if rank == 0 else dist.recv(message, 0)
    dist.barrier(group=gloo)
    where = torch_hca._C._flight_recorder()
    # From torch 2.15, torch's hook enters hca's calls in a recorder of their own, backend "hca".
    hca = {"backend": "hca"} if "hook" in where else {}
    pickled = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False, **hca))  # stack traces
    frames = [f["name"] for f in pickled["entries"][0]["frames"]]
    dumps = [json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False, **kind)) for kind in (hca, {})]
    work = dist.all_reduce(torch.ones(3), async_op=True)  # after the dumps: not among their entries
    work.wait()
    try:
        duration = work._get_duration()
    except RuntimeError as e:
        duration = str(e)
    return where, dumps, frames, duration


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("world", [2, 3])
def test_every_call_is_entered_with_the_fields_gloo_enters(world, executor):
    """Each rank's dump holds hca's calls in order, each with every field gloo's entry of the same call
    has and the same sizes, dtypes and sequence numbers; hca's state is completed (on the model of the
    device: at least started, its stream may still be at it), its group and ranks in the dump's config.
    A Work says how long a call the host ran took."""
    results = run_ranks(_same_calls_on_hca_and_gloo, world, env={**RECORDING, **executor})
    collectives = ["all_reduce"] * 3 + ["broadcast", "all_gather"]
    for rank, (where, (dump, gloo_dump), frames, duration) in enumerate(results):
        # A Work's duration (which torch 2.15's recorder reads) is the host's, where the host ran the call.
        assert (0 < duration < 60_000) if not executor else "ran on a device" in duration, duration
        assert where.startswith("torch's"), where
        assert frames[:2] == ["all_reduce", "wrapper"] and "_same_calls_on_hca_and_gloo" in frames, frames
        hca = [e for e in dump["entries"] if e["profiling_name"].startswith("hca:")]
        gloo = [e for e in gloo_dump["entries"] if e["profiling_name"].startswith("gloo:")][:len(collectives)]
        message = {0: ["send 0->1"], 1: ["recv 1<-0"]}.get(rank, [])
        assert [e["profiling_name"] for e in hca] == [f"hca:{c}" for c in collectives + message], hca
        assert [e["profiling_name"] for e in gloo] == [f"gloo:{c}" for c in collectives], gloo
        hooked = "hook" in where  # torch 2.15 on: torch's hook made hca's entries
        for ours, theirs in zip(hca, gloo):
            assert set(theirs) <= set(ours), set(theirs) - set(ours)
            fields = ["input_sizes", "input_dtypes", "collective_seq_id", "p2p_seq_id", "is_p2p", "timeout_ms",
                      "thread_name"]
            # torch's hook numbers op ids from 0 (gloo and hca from 1), and enters a list's tensors one by one
            fields += [] if hooked else ["op_id"]
            fields += [] if hooked and ours["profiling_name"] == "hca:all_gather" else ["output_sizes", "output_dtypes"]
            for field in fields:
                assert ours[field] == theirs[field], (field, ours, theirs)
            assert ours["process_group"] == ["0", "default_pg"], ours
            assert ours["retired"] is True
            assert ours["state"] == "completed" if not executor else ours["state"] in ("started", "completed")
            if ours["state"] == "completed" and not (hooked and executor):  # hca times no device work
                assert 0 < ours["duration_ms"] < 60_000, ours
        if message:
            sent = hca[-1]
            assert sent["is_p2p"] and sent["p2p_seq_id"] == 1 and sent["collective_seq_id"] == len(collectives)
            side = "output" if hooked and rank == 1 else "input"  # torch's hook enters a receive's as its output
            assert sent[f"{side}_sizes"] == [[5]] and sent[f"{side}_dtypes"] == ["Int"], sent
        assert dump["pg_config"]["0"] == {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}
        if hooked:
            continue  # the group's status is torch's hook's
        status = dump["pg_status"][str(hca[0]["pg_id"])]
        assert status["last_enqueued_collective"] == str(len(collectives)), status
        if not executor:
            assert status["last_completed_collective"] == str(len(collectives)), status


def _rank_1_astray(rank, world, folder, late_s):
    """Four all-reduces and a broadcast, where rank 1 skips the third (`late_s` = 0: it goes on to the
    next, and the fourth meets its broadcast), or comes `late_s` seconds late to it, past the timeout.
    Returns the error, and the names of the folder's files once every rank has failed."""
    t = torch.ones(4) * (rank + 1)
    error = ""
    try:
        for i in range(4):
            if rank == 1 and i == 2:
                time.sleep(late_s)
                if late_s == 0:
                    continue
            dist.all_reduce(t)
        dist.broadcast(t, 0)
    except dist.DistBackendError as e:
        error = str(e)
    return error


def _analyzed(folder):
    """What `python -m torch_hca.fr_trace` prints of the folder, run as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "torch_hca.fr_trace", folder, "-p", "trace_"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("world, executor, kind", [
    (2, {}, "default"), (3, {}, "default"), (2, STREAMS_ENV, "default"), (3, STREAMS_ENV, "default"),
    (2, {}, "nccl"), (4, {}, "2 nodes")], ids=["shm-2", "shm-3", "model-2", "model-3", "pass-through-2", "2-nodes-4"])
def test_a_skipped_collective_is_named_by_every_ranks_dump(world, executor, kind, tmp_path):
    """Rank 1 skips a collective: every rank raises, its message naming its dump, every rank's dump is
    written through torch's writer, and torch's analyzer names rank 1 and the call where it went astray
    (across nodes, past the entries gloo makes of the exchanges between the nodes' leaders)."""
    env = {**RECORDING, **executor, "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")}
    errors = run_ranks(_rank_1_astray, world, str(tmp_path), 0, env=env, pg_timeout_s=20, **group_kind(kind))
    for rank, error in enumerate(errors):
        assert "mismatched calls" in error or rank > 1, error  # across nodes, ranks 2 and 3 hear of it
        assert f"Flight Recorder dump of this rank: {tmp_path}/trace_{rank}" in error, error
    assert sorted(os.listdir(tmp_path)) == [f"trace_{r}" for r in range(world)]
    analysis = _analyzed(str(tmp_path))
    assert "Collective sequence number: 4 has errors" in analysis, analysis
    assert "collective: hca:all_reduce" in analysis, analysis
    assert "Culprit rank 1" in analysis and "found collective type: 'broadcast'" in analysis, analysis


def test_a_late_rank_s_timeout_writes_every_ranks_dump(tmp_path):
    """Rank 1 comes past the timeout: rank 0 times out, rank 1 learns that it did; both dump and say where."""
    env = {**RECORDING, "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")}
    errors = run_ranks(_rank_1_astray, 2, str(tmp_path), 4, env=env, pg_timeout_s=2)
    assert "Timed out after 2000 ms waiting for rank 1" in errors[0], errors[0]
    for rank, error in enumerate(errors):
        assert f"Flight Recorder dump of this rank: {tmp_path}/trace_{rank}" in error, error
    assert sorted(os.listdir(tmp_path)) == ["trace_0", "trace_1"]
    _analyzed(str(tmp_path))  # reads both, though they agree call by call


def test_with_the_recorder_off_nothing_is_entered_or_dumped(tmp_path):
    env = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")}
    errors = run_ranks(_rank_1_astray, 2, str(tmp_path), 0, env=env, pg_timeout_s=20)
    for error in errors:
        assert "mismatched calls" in error and "Flight Recorder" not in error, error
    assert os.listdir(tmp_path) == []


def _cuda_calls(rank, world):
    """Three all-reduces and a broadcast of CUDA tensors (ranks share the GPUs round-robin); the dump's
    hca entries, the results (checked once the device is done) and where hca enters calls."""
    from reference import rank_device

    device = rank_device("cuda", rank)
    t = torch.arange(6, dtype=torch.float32, device=device) + rank
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(t, 0)
    torch.cuda.synchronize()
    dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    import torch_hca

    return ([e for e in dump["entries"] if e["profiling_name"].startswith("hca:")], t.cpu(),
            torch_hca._C._flight_recorder())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_calls_are_entered_started(world):
    """On a GPU each call is entered once its work is on the stream, `started` on every rank alike
    (where hca enters calls itself: torch 2.13 and 2.14; asked in the ranks, not in this process,
    whose recorder its forked ranks must not share)."""
    expected = torch.arange(6, dtype=torch.float32) * world + sum(range(world))
    expected = expected * world ** 2  # the second and third all-reduce of the same sums
    results = run_ranks(_cuda_calls, world, env=RECORDING)
    if not results[0][2].startswith("torch's ("):
        pytest.skip(f"hca does not enter calls itself here: {results[0][2]}")
    for entries, result, _ in results:
        assert [e["profiling_name"] for e in entries] == ["hca:all_reduce"] * 3 + ["hca:broadcast"], entries
        assert all(e["state"] == "started" and e["retired"] and e["input_sizes"] == [[6]] for e in entries), entries
        assert torch.equal(result, expected), (result, expected)
