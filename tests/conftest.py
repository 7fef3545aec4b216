"""Shared fixtures: every multi-process test of a collective runs once per device."""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

from harness import STREAMS_ENV

# The cost model's cache (torch_hca.costs) of a session's own: a calibration the machine's user
# cached must not change what the tests' groups choose. Spawned ranks inherit it.
os.environ["TORCH_HCA_CACHE_DIR"] = tempfile.mkdtemp(prefix="torch-hca-test-cache-")
atexit.register(shutil.rmtree, os.environ["TORCH_HCA_CACHE_DIR"], True)
# A failed call writes its rank's Flight Recorder dump (as ProcessGroupNCCL's do): the session's own folder.
_dumps = tempfile.mkdtemp(prefix="torch-hca-test-fr-")
os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(_dumps, "trace_")
atexit.register(shutil.rmtree, _dumps, True)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    # CPU tensors through the executor CUDA tensors use (its device operations on a host
    # thread per rank): its scheduling, waits and failure handling, checked without a GPU.
    pytest.param("cpu-streams", id="cpu-streams"),
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """"cpu", or "cuda" where a GPU is present (ranks share GPUs round-robin, several per GPU).
    "cpu-streams" runs as "cpu" with TORCH_HCA_CPU_EXECUTOR=streams in the ranks' environment."""
    if request.param == "cpu-streams":
        for name, value in STREAMS_ENV.items():
            monkeypatch.setenv(name, value)  # spawned ranks inherit it
        return "cpu"
    return request.param


def pytest_runtest_logreport(report):
    """HCA_TEST_FAILURES_AT_ONCE=1 (a lent GPU session, whose device call may end mid-run): each
    failure's report is printed as it happens, not in the summary a cut run never reaches."""
    if report.failed and os.environ.get("HCA_TEST_FAILURES_AT_ONCE") == "1":
        print(f"\n--- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n---", flush=True)
