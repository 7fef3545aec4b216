"""The installed tools: `python -m torch_hca.bench` (nccl-tests' sweep), `python -m torch_hca.check`
(the self-test), `python -m torch_hca.explain` and `python -m torch_hca` (the report), run as a user runs them, and their element checks shown to catch a wrong result."""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_hca
import torch_hca.bench
import torch_hca.check
from harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITEMSIZE = {"float": 4, "bfloat16": 2, "half": 2, "double": 8, "int8": 1, "uint8": 1, "int32": 4, "int64": 8}


def run_tool(args, tmp_path, launcher=(sys.executable, "-m")):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([*launcher, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("op, datatype, redop, nprocs", [
    ("all_reduce", "float", "sum", 3), ("all_reduce", "bfloat16", "max", 2), ("broadcast", "double", "sum", 4),
    ("all_gather", "half", "sum", 3), ("reduce_scatter", "int32", "min", 4), ("reduce_scatter", "float", "avg", 2),
    ("all_to_all", "int8", "sum", 3), ("all_reduce", "int64", "prod", 1)])
def test_bench_sweeps_like_nccl_tests_and_checks_every_element(op, datatype, redop, nprocs, tmp_path):
    out = run_tool(["torch_hca.bench", "-b", "4", "-e", "64K", "-f", "16", "-n", "3", "-w", "1", "-o", op,
                    "-d", datatype, "--redop", redop, "-r", str(nprocs - 1), "--nprocs", str(nprocs),
                    "--compare", "gloo,nccl", "--json", "rows.json"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "size(B)       count   type  redop root   time(us) algbw(GB/s) busbw(GB/s) #wrong" in out.stdout
    assert "nccl: not run: " in out.stdout  # no CUDA tensors here: said, not silently dropped
    data = json.loads((tmp_path / "rows.json").read_text())
    assert data["wrong"] == 0 and data["meta"]["world_size"] == nprocs and data["meta"]["launch"] == "spawned"
    assert [s["backend"] for s in data["skipped"]] == ["nccl"]
    gathers = op in ("all_gather", "reduce_scatter", "all_to_all")
    for backend in ("hca", "gloo"):
        rows = [r for r in data["rows"] if r["backend"] == backend]
        assert len(rows) == 4, rows  # 4 B, 64 B, 1 KiB, 16 KiB (or the multiple of the world below it)
        for r, nbytes in zip(rows, (4, 64, 1024, 16384)):
            part = max(1, nbytes // ITEMSIZE[datatype] // (nprocs if gathers else 1))
            assert r["count"] == part and r["size"] == part * ITEMSIZE[datatype] * (nprocs if gathers else 1)
            assert r["wrong"] == 0 and r["time_us"] > 0
            assert r["busbw"] == pytest.approx(r["algbw"] * torch_hca.bench.bus_factor(op, nprocs))
            assert r["root"] == (nprocs - 1 if op == "broadcast" else -1)


def test_bench_shows_how_long_the_host_is_held_with_a_rank_late(tmp_path):
    """The host column on the CPU model of the device, rank 1 200 ms late to every size's 10 timed
    calls: the early rank's thread is not held for the late rank's arrival (under 1 ms a call: its
    host runs ahead, as a GPU's does), and every element is right once the host synchronizes."""
    out = run_tool(["torch_hca.bench", "--device", "model", "--late-rank", "1:200", "-b", "8", "-e", "1K", "-f", "128",
                    "-n", "10", "-w", "1", "--json", "rows.json"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "#wrong   host(us)" in out.stdout and "model  rank 1 200 ms late" in out.stdout, out.stdout
    data = json.loads((tmp_path / "rows.json").read_text())
    assert data["meta"]["device"] == "model" and data["meta"]["late_rank"] == [1, 0.2] and data["wrong"] == 0
    assert [r["size"] for r in data["rows"]] == [8, 1024]
    assert all(r["host_us"] < 1000 for r in data["rows"]), [(r["size"], r["host_us"]) for r in data["rows"]]


def test_bench_times_the_kernels_beside_torchs_and_checks_them(tmp_path):
    """--kernels on the CPU model (the host kernels): the copy and the sums of 2 to 8 inputs, float32
    and bfloat16, each beside torch's copy_ / add, every element checked against sums in order."""
    out = run_tool(["torch_hca.bench", "--kernels", "--device", "model", "-b", "64K", "-e", "256K", "-f", "4",
                    "--json", "kernels.json"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every element checked was right" in out.stdout and "host kernels" in out.stdout, out.stdout
    data = json.loads((tmp_path / "kernels.json").read_text())
    kernels = ["copy"] + [f"sum of {k}" for k in range(2, 9)]
    assert [(r["dtype"], r["size"], r["kernel"]) for r in data["rows"]] == [
        (d, s, k) for d in ("float32", "bfloat16") for s in (64 << 10, 256 << 10) for k in kernels]
    assert data["wrong"] == 0 and all(r["gbps"] > 0 and r["torch_gbps"] > 0 for r in data["rows"])


def test_bench_under_torchrun(tmp_path):
    out = run_tool(["--nproc-per-node", "2", "-m", "torch_hca.bench", "-b", "1K", "-e", "1M", "-f", "32",
                    "-o", "all_reduce", "--num-packs", "2", "--json", "rows.json"], tmp_path,
                   launcher=(sys.executable, "-m", "torch.distributed.run"))
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "rows.json").read_text())
    assert data["meta"]["launch"] == "torchrun" and data["meta"]["world_size"] == 2
    assert data["meta"]["hca"] == "algorithm=hierarchical_copy, num_packs=2"
    assert [r["size"] for r in data["rows"]] == [1024, 32768, 1048576] and data["wrong"] == 0


@pytest.mark.parametrize("args, needle", [
    (["--compare", "mpi"], "--compare: unknown backend 'mpi'"),
    (["--redop", "avg", "-d", "int32"], "--redop avg: integer datatype 'int32'"),
    (["-r", "2", "--nprocs", "2"], "-r/--root: rank 2 is not in a world of 2 ranks"),
    (["-b", "1M", "-e", "1K"], "minbytes <= maxbytes"),
    (["-f", "1"], "-f/--stepfactor: sizes grow by this factor, so it must be 2 or more, got 1"),  # swept for ever before
    (["-n", "-1"], "-n and -w: need 0 or more calls, got -1 and 3"),
    (["--num-packs", "-2"], "--algorithm / --num-packs: num_packs: requires num_packs >= 0"),  # every rank's traceback before
    (["--algorithm", "fast"], "--algorithm / --num-packs: algorithm: unknown algorithm 'fast'"),
    (["--late-rank", "5:10"], "--late-rank: rank 5 is not in a world of 2 ranks"),
])
def test_bench_refuses_bad_arguments_before_any_rank_starts(args, needle):
    with pytest.raises(SystemExit, match=needle):
        torch_hca.bench.main(args)


@pytest.mark.parametrize("tool, args, needle", [
    ("torch_hca.bench", ["-b", "1x"], "argument -b/--minbytes: expected a positive size such as 8, 64K or 1M, got '1x'"),
    ("torch_hca.bench", ["--late-rank", "1"], "argument --late-rank: expected R:MS, a rank and milliseconds such as 1:200"),
    ("torch_hca.check", ["--world-sizes", "1,a"], "argument --world-sizes: expected rank counts such as 1,2,3"),
    ("torch_hca.explain", ["3", "--groups", "0,a"], "argument --groups: expected lists of integers such as 0,1;2,3"),
    ("torch_hca.explain", ["3", "--numels", "1k"], "argument --numels: expected comma-separated integers, got '1k'"),
    ("torch_hca.explain", ["3", "--groups", "0,1;5"], "error: groups: rank 5 is outside the world of 3 ranks"),
    ("torch_hca.explain", ["2", "--num-packs", "-1"], "error: num_packs: requires num_packs >= 0"),
    ("torch_hca.explain", ["4", "--device", "cuda", "--links", "pcie"], "error: links: name each rank's GPU too"),
    ("torch_hca.explain", ["4", "--device", "cuda", "--gpus", "0,1,2,3", "--links", "dgx1"],
     "error: links='dgx1': a DGX-1 has 8 GPUs, the ranks name 4"),
])
def test_tools_name_a_bad_argument_in_one_line_not_a_traceback(tool, args, needle, tmp_path):
    out = run_tool([tool, *args], tmp_path)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def corrupting(call, op_to_corrupt, rank_to_corrupt):
    """`call`, except that `op_to_corrupt`'s result on `rank_to_corrupt` gets its first element changed."""
    def wrapped(op, group, *args):
        result = call(op, group, *args)
        if op == op_to_corrupt and group.rank() == rank_to_corrupt:
            result[0] = (not result[0].item()) if result.dtype == torch.bool else result[0] + 1
        return result
    return wrapped


def bench_with_a_wrong_element(rank, world):
    torch_hca.bench.call = corrupting(torch_hca.bench.call, "all_reduce", 1)
    group = dist.new_group(backend="hca")
    seen = []  # each row as it is measured: a run cut short still printed those
    rows = torch_hca.bench.measure("hca", "all_reduce", group, [8, 4096], torch.float32, torch.device("cpu"),
                                   dist.group.WORLD, iters=2, warmup=0,
                                   on_row=lambda row: seen.append((row["size"], len(seen))))
    assert seen == [(8, 0), (4096, 1)]
    return [r["wrong"] for r in rows]


def test_bench_counts_a_wrong_element():
    assert run_ranks(bench_with_a_wrong_element, 3, backend="gloo") == [[1, 1]] * 3


def check_with_wrong_all_gathers(rank, world):
    torch_hca.check.call = corrupting(torch_hca.check.call, "all_gather", 2)
    group = dist.new_group(backend="hca")
    return [(name, failure) for name, failure in torch_hca.check.run_checks(group, torch.device("cpu"), world)
            if failure]


def test_check_reports_exactly_the_wrong_results():
    ranks = run_ranks(check_with_wrong_all_gathers, 3, backend="gloo")
    assert ranks[0] == [] and ranks[1] == []
    wanted = [c for c in torch_hca.check.cases(3) if c[0] == "all_gather"]
    assert len(ranks[2]) == len(wanted) == 20  # every dtype, small and large
    for name, failure in ranks[2]:
        assert name.startswith("all_gather ") and "elements differ, first at 0" in failure


def test_check_passes_and_says_so(tmp_path):
    out = run_tool(["torch_hca.check", "--world-sizes", "1,3", "--json", "check.json", "--log", "check.log"],
                   tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "check.json").read_text())
    assert data["failed"] == 0 and [r["world_size"] for r in data["reports"]] == [1, 3]
    for report in data["reports"]:
        assert set(report["modes"]) == {name for name, _ in torch_hca.check.modes(report["world_size"])}
        for mode in report["modes"].values():
            assert len(mode["checks"]) == len(torch_hca.check.cases(report["world_size"])) and not mode["incomplete"]
    total = sum(len(m["checks"]) for r in data["reports"] for m in r["modes"].values())
    assert out.stdout.splitlines()[-1] == f"PASS: {total} of {total} checks right; full log: {tmp_path / 'check.log'}"
    assert "hierarchy: groups [[0, 1, 2]]" in out.stdout and "step 1: reduce" in out.stdout
    log = (tmp_path / "check.log").read_text().splitlines()
    assert sum(line.startswith("ok ") for line in log) == total


def test_check_skips_the_pass_through_where_nccl_refuses_the_ranks(monkeypatch, tmp_path):
    """Several ranks on one GPU (as on a lent GPU machine): stock NCCL refuses them, so check says
    why it skipped the pass-through instead of failing on NCCL's "invalid usage"."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    reason = torch_hca.bench.stock_refusal("nccl", torch.device("cuda", 0), 3)
    assert reason == "NCCL refuses several ranks on one GPU (3 ranks, 1 GPUs)"
    assert torch_hca.bench.stock_refusal("nccl", torch.device("cuda", 0), 1) is None
    report = dict(world_size=3, device="cuda:0", hierarchy="groups [[0, 1, 2]]", places=[], seconds=1.0,
                  explain="plan", modes={"hierarchical_copy": dict(checks=["barrier"], failures={}, incomplete=False),
                                         "nccl pass-through": dict(checks=[], failures={}, incomplete=False,
                                                                   skipped=reason)})
    text, failed = torch_hca.check.verdict([report], "check.log")
    assert failed == 0 and f"skipped nccl pass-through: {reason}" in text
    assert text.splitlines()[-1] == "PASS: 1 of 1 checks right; full log: check.log"
    torch_hca.check.write_log([report], tmp_path / "check.log")
    assert f"# skipped nccl pass-through: {reason}" in (tmp_path / "check.log").read_text()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("op", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_references_leave_their_inputs_alone(dtype, op):
    """A float64 input's to(float64) is the input itself: the reference must copy before it sums.
    Each reference is checked against numpy's reductions of the stacked inputs."""
    if not torch_hca.reference.supported(dtype, op):
        pytest.skip("AVG of integers, bitwise ops of floating dtypes")
    inputs = [torch_hca.reference.make_input(3, r, 50, dtype, op) for r in range(3)]
    before = [t.clone() for t in inputs]
    stacked = np.stack([t.numpy() for t in before])
    if op in ("BAND", "BOR", "BXOR"):
        ufunc = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        want = torch.from_numpy(ufunc.reduce(stacked, axis=0))
    else:
        stacked = stacked.astype(np.float64)
        want = {"SUM": stacked.sum(0), "AVG": stacked.mean(0), "PRODUCT": stacked.prod(0), "MIN": stacked.min(0),
                "MAX": stacked.max(0)}[op]
        want = torch.from_numpy(want).to(dtype)
    torch.testing.assert_close(torch_hca.reference.reduce_reference(inputs, op), want)
    for t, b in zip(inputs, before):
        assert torch.equal(t, b)


def test_explain_prints_the_plan_from_the_command_line_without_a_warning(tmp_path):
    """As the docs show it: ranks sharing one GPU (reduce_to_one_device on 4), and no runpy warning
    about the module being imported twice."""
    out = run_tool(["torch_hca.explain", "4", "--device", "cuda", "--gpus", "0,0,0,0", "--numels", "262144"], tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "chosen per call: reduce_to_one_device" in out.stdout and "step 1: reduce 1->0, reduce 2->0, reduce 3->0" \
        in out.stdout and f"rounds of a {64 << 20}-byte slot" in out.stdout, out.stdout
    gpus = ",".join(map(str, range(8)))
    for numels, chosen in ((1024, "direct"), (1 << 22, "a pack per rank")):
        out = run_tool(["torch_hca.explain", "8", "--device", "cuda", "--gpus", gpus, "--links", "nvswitch",
                        "--numels", str(numels)], tmp_path)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert out.stdout.startswith("groups [[0, 1, 2, 3, 4, 5, 6, 7]] by GPU link domain") and \
            f"chosen per call: {chosen} " in out.stdout and "(predicted, not measured)" in out.stdout, out.stdout
    out = run_tool(["torch_hca.explain", "8", "--device", "cuda", "--gpus", gpus, "--links", "dgx1"], tmp_path)
    assert out.stdout.startswith("groups [[0, 1, 2, 3], [4, 5, 6, 7]] by GPU link domain") and \
        "chosen per call" not in out.stdout and "step 2: reduce 4->0" in out.stdout, out.stdout


def test_the_package_reports_what_it_sees_and_names_a_misspelt_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HCA_NUMPACKS", "2")
    monkeypatch.setenv("TORCH_HCA_SHM_SLOTS", "8")
    out = run_tool(["torch_hca"], tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"torch_hca {torch_hca.__version__} ")
    assert f"torch: {torch.__version__} running, extension built for" in lines[1]
    assert "  TORCH_HCA_NUMPACKS=2  <- TORCH_HCA_NUMPACKS is not a torch_hca setting (did you mean " \
           "TORCH_HCA_NUM_PACKS?): it is ignored" in lines, out.stdout
    assert "  TORCH_HCA_SHM_SLOTS=8" in lines, out.stdout  # known: no remark
    assert sum(line.startswith("  python -m torch_hca.") for line in lines) == 4


def _group_warnings(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = dist.new_group(backend="hca")
        dist.all_reduce(torch.ones(3), group=group)
    return sorted(str(w.message) for w in caught if "torch_hca setting" in str(w.message))


def test_creating_a_group_warns_about_a_setting_it_does_not_read():
    env = {"TORCH_HCA_NUMPACKS": "2", "TORCH_HCA_FOO": "1", "TORCH_HCA_NUM_PACKS": "1"}
    assert run_ranks(_group_warnings, 2, env=env) == [[
        "TORCH_HCA_FOO is not a torch_hca setting: it is ignored",
        "TORCH_HCA_NUMPACKS is not a torch_hca setting (did you mean TORCH_HCA_NUM_PACKS?): it is ignored"]] * 2
