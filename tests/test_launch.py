"""The init methods users launch with: torchrun (env://) and tcp://; and the tests' own launcher."""
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_hca
from harness import STREAMS_ENV, run_ranks

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch_hca
    dist.init_process_group("hca", init_method=sys.argv[1] if len(sys.argv) > 1 else None,
                            rank=int(sys.argv[2]) if len(sys.argv) > 2 else -1,
                            world_size=int(sys.argv[3]) if len(sys.argv) > 3 else -1,
                            pg_options=torch_hca.Options(num_packs=2))
    t = torch.arange(1000, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert torch.equal(t, torch.arange(1000, dtype=torch.float64) * n * (n + 1) / 2), t
    sys.stdout.write(f"ok {dist.get_rank()}\\n")  # one write: atomic on the shared pipe
    sys.stdout.flush()
    dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_env_init(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                          "--master-port", str(_free_port()), str(script)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(re.findall(r"ok (\d)", out.stdout)) == ["0", "1", "2"], out.stdout


def test_tcp_init(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    url = f"tcp://127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), url, str(r), "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert [o.strip() for o, _ in outs] == ["ok 0", "ok 1"]


# What torch 2.14+ does for a backend name it does not know: load the registrar that the
# "torch.distributed.backends" entry point names and call it, without the user importing torch_hca.
ENTRY_POINT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from importlib.metadata import entry_points
    (hca,) = [ep for ep in entry_points(group="torch.distributed.backends") if ep.name == "hca"]
    assert "torch_hca" not in sys.modules
    hca.load()()
    dist.init_process_group("hca", init_method=sys.argv[1], rank=0, world_size=1)
    t = torch.arange(10.0)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(10.0)), t
    dist.destroy_process_group()
    print(hca.value)
""")


def test_the_entry_point_registers_hca_without_an_import(tmp_path):
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("torch_hca")
    except PackageNotFoundError:
        pytest.skip("torch_hca is not installed (pip install --no-build-isolation -e .): no entry points")
    script = tmp_path / "no_import.py"
    script.write_text(ENTRY_POINT_SCRIPT)
    out = subprocess.run([sys.executable, str(script), f"file://{tmp_path / 'store'}"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "torch_hca.backend:register", out.stdout


def test_an_extension_built_for_another_torch_names_both_versions(tmp_path):
    from torch_hca.build_check import check_built_torch

    record = tmp_path / "built_for_torch.txt"
    record.write_text("2.11.0+cu130\n")
    with pytest.raises(ImportError, match=r"built for torch 2\.11\.0\+cu130, but torch 2\.13\.0\+cpu is running: "
                                          r"rebuild it against this torch \(pip install --no-build-isolation"):
        check_built_torch(str(record), running="2.13.0+cpu")
    check_built_torch(str(record), running="2.11.0")  # another build of the same release: its interface
    check_built_torch(str(tmp_path / "absent.txt"), running="2.13.0")  # a build older than the record


def test_the_build_recorded_the_running_torch():
    from torch_hca import build_check

    with open(build_check.RECORD) as f:
        assert f.read().strip() == torch.__version__


def test_the_package_version_names_the_torch_it_builds_against():
    """`pip wheel .` names its wheel by this version: torch_hca-0.1.0+torch2.13.0.cpu-...whl, the
    package's own (torch_hca.__version__) and a local label naming the torch."""
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == torch_hca.__version__ + "+torch" + torch.__version__.replace("+", ".")


def test_the_extension_keeps_a_static_cxx_runtime_to_itself():
    """A toolchain that links its C++ runtime into shared objects statically (the lent GPU
    machines' does) must leave that copy hidden (setup.py's --exclude-libs): exported, its
    functions ran on the process's copy's data, and formatting an integer into a stream crashed.
    Only a C++ runtime defines these two symbols; a build that shares the runtime has neither."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    out = subprocess.run([nm, "-D", "--defined-only", torch_hca._C.__file__], capture_output=True, text=True,
                         timeout=60, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert not exported & {"_ZNSt6locale7classicEv", "_ZNSo9_M_insertIlEERSoT_"}


def _environment_seen(rank, world):
    return {name: os.environ.get(name) for name in ("HCA_TEST_REMOVED", "HCA_TEST_SET_LATER", "HCA_TEST_EVERY_RANK",
                                                     "HCA_TEST_THIS_RANK", *STREAMS_ENV)}


def test_the_tests_ranks_see_the_environment_the_test_has_at_launch(monkeypatch):
    """The ranks fork from a server that started at the session's first launch, with the environment
    of then: they must see the test's as it is now (the cpu-streams fixture sets its executor so)."""
    monkeypatch.setenv("HCA_TEST_REMOVED", "1")
    assert run_ranks(_environment_seen, 1)[0]["HCA_TEST_REMOVED"] == "1"  # the server is up by now
    monkeypatch.delenv("HCA_TEST_REMOVED")
    monkeypatch.setenv("HCA_TEST_SET_LATER", "later")
    for name, value in STREAMS_ENV.items():
        monkeypatch.setenv(name, value)
    seen = run_ranks(_environment_seen, 3, env={"HCA_TEST_EVERY_RANK": "all"},
                     env_per_rank=[{"HCA_TEST_THIS_RANK": str(r)} for r in range(3)])
    assert seen == [{"HCA_TEST_REMOVED": None, "HCA_TEST_SET_LATER": "later", "HCA_TEST_EVERY_RANK": "all",
                     "HCA_TEST_THIS_RANK": str(r), **STREAMS_ENV} for r in range(3)]
