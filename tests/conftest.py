"""Shared fixtures: every multi-process test of a collective runs once per device."""
import pytest
import torch

from harness import STREAMS_ENV

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
