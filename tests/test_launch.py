"""The init methods users launch with: torchrun (env://) and tcp://."""
import os
import re
import socket
import subprocess
import sys
import textwrap

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
