"""Whole jobs as users run them under torchrun: groups made and ended by the hundred leave nothing
behind; a job killed whole, then started again on the same port, runs right; two jobs run at once;
an elastic restart after a rank died runs right on its second attempt."""
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import torch
import torch.distributed as dist

from harness import run_ranks, shared_mappings

JOB = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist, torch_hca
    dist.init_process_group("hca")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mode = sys.argv[1]
    if mode == "dies" and attempt == 0 and rank == 1:
        os._exit(3)  # the first attempt loses a rank; torchrun starts every rank again
    for step in range(int(sys.argv[2])):
        t = torch.arange(1000, dtype=torch.float64) * (rank + 1 + step)
        dist.all_reduce(t)
        want = torch.arange(1000, dtype=torch.float64) * (world * (world + 1) / 2 + world * step)
        assert torch.equal(t, want), (step, t[:4])
        if step == 0:
            print(f"running {rank} attempt {attempt}", flush=True)
        if mode == "slow":
            time.sleep(0.05)
    print(f"ok {rank} attempt {attempt}", flush=True)
    dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script, port, *args, ranks=2, restarts=0):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                             "--master-port", str(port), "--max-restarts", str(restarts), str(script), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _shm_entries():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("torch_hca"))


def _finished(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_a_job_killed_whole_then_started_again_on_the_same_port_runs_right(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port, before = _free_port(), _shm_entries()
    first = _torchrun(script, port, "slow", "100000")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "running 0" not in (line := first.stdout.readline()):
        assert line or first.poll() is None, first.stderr.read()[-3000:]
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every rank, at once
    first.wait(timeout=30)
    time.sleep(0.5)
    assert _shm_entries() == before  # segments are unlinked once every rank attached
    code, out, err = _finished(_torchrun(script, port, "fast", "20"))
    assert code == 0, err[-3000:]
    assert sorted(re.findall(r"ok (\d)", out)) == ["0", "1"], out
    assert _shm_entries() == before


def test_two_jobs_at_once_each_run_right(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    jobs = [_torchrun(script, _free_port(), "fast", "200", ranks=ranks) for ranks in (2, 3)]
    for job, ranks in zip(jobs, (2, 3)):
        code, out, err = _finished(job)
        assert code == 0, err[-3000:]
        assert sorted(re.findall(r"ok (\d)", out)) == [str(r) for r in range(ranks)], out


def test_an_elastic_restart_after_a_rank_died_runs_right(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    code, out, err = _finished(_torchrun(script, _free_port(), "dies", "20", restarts=1))
    assert code == 0, err[-3000:]
    assert sorted(re.findall(r"ok (\d) attempt 1", out)) == ["0", "1"], out


def _many_groups(rank, world, count):
    """`count` groups made, used once and destroyed: the process's threads, open files and shared
    mappings, after, against before."""
    def footprint():
        return (len(os.listdir(f"/proc/{os.getpid()}/task")), len(os.listdir(f"/proc/{os.getpid()}/fd")),
                shared_mappings())

    warm = dist.new_group(backend="hca")
    dist.all_reduce(torch.ones(4), group=warm)
    dist.destroy_process_group(warm)
    before = footprint()
    for _ in range(count):
        group = dist.new_group(backend="hca")
        t = torch.ones(1000)
        dist.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((1000,), float(world)))
        dist.destroy_process_group(group)
    dist.barrier()
    return before, footprint()


def test_two_hundred_groups_made_and_ended_leave_nothing_behind():
    before_shm = _shm_entries()
    for before, after in run_ranks(_many_groups, 2, 200):
        assert after == before
    assert _shm_entries() == before_shm
