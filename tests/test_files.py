"""The files hca and its tools write: never through a name another user could plant first in a shared
folder, each the user's own (mode 0600, its folders 0700); and the build's one line where pip's
isolated build hides torch."""
import os
import stat
import subprocess
import sys
import time
import warnings

import pytest

import torch_hca.check
from torch_hca import costs
from torch_hca.node import _make_probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_check_log_is_never_a_file_or_link_someone_planted(tmp_path):
    """Another user plants links at the log names of the next minutes (the old name was the time
    of day, in the shared temporary folder): the check writes a file of its own, mode 0600, and
    the links' target is left as it was."""
    shared, victim = tmp_path / "tmp", tmp_path / "victim"
    shared.mkdir()
    victim.write_text("root's own file\n")
    now = time.time()
    for second in range(-5, 120):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now + second))
        (shared / f"torch_hca_check-{stamp}.log").symlink_to(victim)
    env = {**os.environ, "TMPDIR": str(shared), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "torch_hca.check", "--world-sizes", "1", "--json", "check.json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    log = out.stdout.splitlines()[-1].split("full log: ")[1]
    assert victim.read_text() == "root's own file\n"
    assert os.path.dirname(log) == str(shared) and not os.path.islink(log) and _mode(log) == 0o600, log
    assert "ok " in open(log).read()


def _model():
    return costs.shipped(2, 2)


def test_the_calibration_cache_is_the_users_own(tmp_path):
    path = tmp_path / "cache" / "torch_hca" / "costs-test.json"
    costs.save(_model(), {}, path)
    assert _mode(path.parent) == 0o700 and _mode(path) == 0o600
    assert costs.load(path) is not None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("how", ["a file others may write", "a folder others may write", "another user's file"])
def test_a_calibration_another_user_could_have_written_is_ignored(tmp_path, how):
    path = tmp_path / "torch_hca" / "costs-test.json"
    costs.save(_model(), {}, path)
    if how == "a file others may write":
        os.chmod(path, 0o666)
    elif how == "a folder others may write":
        os.chmod(path.parent, 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert costs.load(path) is None
    assert any("ignoring the calibration in" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_the_node_probe_refuses_a_planted_file_or_link(tmp_path):
    made = tmp_path / "probe"
    assert _make_probe(str(made)) and _mode(made) == 0o600
    planted = tmp_path / "planted"
    planted.symlink_to(tmp_path / "victim")
    assert not _make_probe(str(planted)) and not (tmp_path / "victim").exists()


def test_setup_py_says_to_rerun_without_build_isolation_where_pip_hides_torch(tmp_path):
    """What pip's isolated build (a plain `pip install .`) meets: no torch on its path."""
    hidden = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, '/tmp/pip-build-env-x/overlay'); "
              "sys.argv = ['setup.py', '--version']; exec(open('setup.py').read())")
    out = subprocess.run([sys.executable, "-c", hidden], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "torch_hca: setup.py builds against the installed torch and cannot import torch here (pip's isolated build "
        "environment hides it): install torch, then rerun with `pip install --no-build-isolation .`"), out.stderr
