"""Runs PyTorch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py,
shipped in the wheel) in gloo's CPU configuration, with every gloo group made an hca group
(`--backend hca`) or as it is (`--backend gloo`), so the two can be compared test by test.

    BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) python tools/torch_suite.py --backend hca -k allgather
"""
import argparse
import functools
import os
import sys
import tempfile

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="hca-suite-"))

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


def _use_hca():
    """Every gloo group (the default group and new_group's) becomes an hca group."""
    import torch_hca  # noqa: F401  registers "hca"

    def swap(fn, *, positional):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if kwargs.get("backend") in ("gloo", dist.Backend.GLOO):
                kwargs["backend"] = "hca"
            elif len(args) > positional and args[positional] in ("gloo", dist.Backend.GLOO):
                args = args[:positional] + ("hca",) + args[positional + 1:]
            return fn(*args, **kwargs)
        return wrapper

    dist.init_process_group = swap(dist.init_process_group, positional=0)
    dist.new_group = swap(dist.new_group, positional=2)
    # torch's dist.monitored_barrier refuses every group but gloo's in Python, before calling
    # the backend; torch_hca.monitored_barrier is the same call without that check.
    dist.monitored_barrier = torch_hca.monitored_barrier


if os.environ.get("HCA_SUITE_BACKEND") == "hca":  # set before the ranks are spawned; they import this module
    _use_hca()


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["gloo", "hca"], default="hca")
    args, rest = parser.parse_known_args()
    os.environ["HCA_SUITE_BACKEND"] = args.backend
    if args.backend == "hca":
        _use_hca()
    import pytest

    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *rest]))
