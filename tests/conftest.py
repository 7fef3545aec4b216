"""Shared fixtures: every multi-process test of a collective runs once per device."""
import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


@pytest.fixture(params=DEVICES)
def device(request):
    """"cpu", or "cuda" where a GPU is present (ranks share GPUs round-robin, several per GPU)."""
    return request.param
