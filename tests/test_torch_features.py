"""What training scripts use on top of the collectives, on hca and on gloo: the same results.

DDP's options (unused parameters, a static graph), uneven inputs under `Join`, ZeRO, tensor
parallelism, periodic model averaging, FSDP1 (the wrapper Hugging Face Accelerate uses) in two sharding
strategies with its full state dict gathered, distributed checkpoints of FSDP2 shards, DCP's async save
through a group of its own while DDP trains, DDP under `torch.compile`, and the collectives that
autograd differentiates. Each runs in one launch per backend; every rank's results are compared
with gloo's, and each case checks that it moved the parameters, so that a case which communicated
nothing would fail.
"""
import functools
import os

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import run_ranks


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))


class _Branchy(torch.nn.Module):
    """A middle layer that some steps skip, on some ranks and not others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.out(torch.relu(self.b(h) if use_b else h))


def _arrays(tensors):
    return [t.detach().numpy().copy() for t in tensors]  # tensors would travel by fd


def _train(module, step_input, steps, rank, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(module.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for i in range(steps):
        optimizer.zero_grad()
        module(*step_input(g, i)).sum().backward()
        optimizer.step()


def _batch(g, _):
    return (torch.randn(8, 16, generator=g),)


def _unused_parameters(rank, world):
    model = _Branchy()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    _train(ddp, lambda g, i: (torch.randn(8, 16, generator=g), (i + rank) % 2 == 0), 6, rank)
    return _arrays(model.parameters())


def _static_graph(rank, world):
    model = _mlp()
    _train(DDP(model, static_graph=True, bucket_cap_mb=0.001), _batch, 6, rank)
    return _arrays(model.parameters())


def _uneven_inputs(rank, world):
    """Rank r trains 3 + 2r steps; ranks done early shadow the others' all-reduces."""
    from torch.distributed.algorithms.join import Join

    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    with Join([ddp]):
        _train(ddp, _batch, 3 + 2 * rank, rank)
    return _arrays(model.parameters())


def _zero(rank, world):
    """ZeroRedundancyOptimizer: each rank steps its shard of Adam, then broadcasts it; uneven inputs."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    with Join([ddp, optimizer]):
        _train(ddp, _batch, 3 + rank, rank, optimizer)
    optimizer.consolidate_state_dict(to=world - 1)
    states = optimizer.state_dict()["state"].values() if rank == world - 1 else []
    return _arrays(model.parameters()) + _arrays(s["exp_avg_sq"] for s in states)


def _tensor_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _mlp()
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _train(model, lambda g, i: (torch.randn(8, 16, generator=torch.Generator().manual_seed(i)),), 4, rank)
    return _arrays(p.full_tensor() for p in model.parameters())


def _model_averaging(rank, world):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = PeriodicModelAverager(period=2, warmup_steps=0)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=g)).sum().backward()
        optimizer.step()
        averager.average_parameters(model.parameters())
    return _arrays(model.parameters())


def _fsdp1(rank, world, strategy, use_orig_params):
    """FSDP1 with a unit per layer, sharded by `strategy` (a ShardingStrategy's name); the trained
    model is read back through its full state dict, which all-gathers every unit's shards."""
    from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(_mlp(), sharding_strategy=ShardingStrategy[strategy], device_id=torch.device("cpu"),
                 use_orig_params=use_orig_params, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    _train(model, _batch, 4, rank)
    # offload_to_cpu=True breaks FSDP1 on CPU parameters under any backend (torch 2.13: setStorage out of bounds)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False)):
        return _arrays(model.state_dict().values())


def _checkpoint(rank, world, folder):
    """FSDP2 shards saved with torch.distributed.checkpoint and loaded into a fresh model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    trained = fully_shard(_mlp())
    _train(trained, _batch, 2, rank)
    dcp.save(trained.state_dict(), checkpoint_id=folder)
    loaded = fully_shard(_mlp())
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=folder)
    loaded.load_state_dict(state)
    full = [p.full_tensor() for p in loaded.parameters()]
    if not all(torch.equal(a, b.full_tensor()) for a, b in zip(full, trained.parameters())):
        raise AssertionError("the loaded model differs from the saved one")
    return _arrays(full)


def _async_checkpoint(rank, world, folder):
    """DDP trains on the default group while DCP's async_save writes snapshots through a group of
    its own from a background thread (one save in flight at a time, as torchtitan waits); each
    snapshot loads back as it was taken."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model = _mlp()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    checkpoint_group = dist.new_group()
    g = torch.Generator().manual_seed(100 + rank)
    snapshots, pending = [], None
    for step in range(6):
        optimizer.zero_grad()
        ddp(*_batch(g, step)).sum().backward()
        optimizer.step()
        if step % 2 == 0:
            if pending is not None:
                pending.result()
            snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            pending = dcp.async_save({"model": snapshots[-1]}, checkpoint_id=os.path.join(folder, str(step)),
                                     process_group=checkpoint_group)
    pending.result()
    for step, snapshot in zip((0, 2, 4), snapshots):
        state = {"model": {k: torch.zeros_like(v) for k, v in snapshot.items()}}
        dcp.load(state, checkpoint_id=os.path.join(folder, str(step)))
        if not all(torch.equal(state["model"][k], v) for k, v in snapshot.items()):
            raise AssertionError(f"the snapshot of step {step} loaded back differs")
    return _arrays(model.parameters())


def _compiled_ddp(rank, world):
    model = _mlp()
    ddp = DDP(model)
    _train(torch.compile(ddp, backend="aot_eager"), _batch, 4, rank, torch.optim.SGD(ddp.parameters(), lr=0.05))
    return _arrays(model.parameters())


def _autograd_collectives(rank, world):
    import torch.distributed.nn.functional as functional

    torch.manual_seed(rank)
    x = torch.randn(5, 3, requires_grad=True)
    summed = functional.all_reduce(x * (rank + 1))
    gathered = functional.all_gather(x)
    (summed.sum() + sum((p * (i + 1)).sum() for i, p in enumerate(gathered))).backward()
    return _arrays([summed, x.grad])


CASES = {"unused_parameters": _unused_parameters, "static_graph": _static_graph, "uneven_inputs": _uneven_inputs,
         "zero": _zero, "tensor_parallel": _tensor_parallel, "model_averaging": _model_averaging,
         "compiled_ddp": _compiled_ddp, "autograd_collectives": _autograd_collectives,
         "fsdp1_full_shard": functools.partial(_fsdp1, strategy="FULL_SHARD", use_orig_params=False),
         "fsdp1_shard_grad_op": functools.partial(_fsdp1, strategy="SHARD_GRAD_OP", use_orig_params=True)}


def _every_case(rank, world, folder):
    results = {name: case(rank, world) for name, case in CASES.items()}
    results["checkpoint"] = _checkpoint(rank, world, os.path.join(folder, "checkpoint"))
    results["async_checkpoint"] = _async_checkpoint(rank, world, os.path.join(folder, "async_checkpoint"))
    return results


def _untrained():
    return {"_mlp": _arrays(_mlp().parameters()), "_Branchy": _arrays(_Branchy().parameters())}


@pytest.mark.parametrize("world", [2, 3])
def test_training_features_match_gloo(world, tmp_path):
    hca = run_ranks(_every_case, world, str(tmp_path / "hca"))
    gloo = run_ranks(_every_case, world, str(tmp_path / "gloo"), backend="gloo")
    untrained = _untrained()
    for rank in range(world):
        for name, arrays in hca[rank].items():
            assert len(arrays) == len(gloo[rank][name]) > 0, (rank, name)
            for a, b in zip(arrays, gloo[rank][name]):
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
            start = untrained["_Branchy" if name == "unused_parameters" else "_mlp"]
            if name != "autograd_collectives":
                assert any(a.shape != s.shape or not np.array_equal(a, s) for a, s in zip(arrays, start)), name
