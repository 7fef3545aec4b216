"""Real use: DDP training with hca matches gloo; the TF-style classes; mixed backend strings; subgroups."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_hca
from harness import group_kind, run_ranks, seeds
from node_cases import fsdp2_training
from reference import make_input, mismatch, reduce_reference


def _train(rank, world, steps=20, hook=None, bucket_cap_mb=0.01):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 4))
    # Small buckets: several allreduces per step, and the model's state broadcast at wrap time.
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        ddp.register_comm_hook(*_comm_hook(hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]  # tensors would travel by fd


@pytest.mark.parametrize("algorithm", ["hierarchical_copy", "reduce_to_one_device"])
def test_ddp_matches_gloo(algorithm):
    hca = run_ranks(_train, 2, pg_options=torch_hca.Options(algorithm, num_packs=2))
    gloo = run_ranks(_train, 2, backend="gloo")
    for a, b in zip(hca[0], gloo[0]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(hca[0], hca[1]):  # replicas stay identical
        assert (a == b).all()


def _comm_hook(name):
    """(state, hook) of one of torch's shipped DDP comm hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powerSGD":
        # From the third step on the hook compresses: its callbacks issue (and wait for) all-reduces.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=0.5)
        return state, powerSGD_hook.powerSGD_hook
    return None, getattr(default_hooks, name + "_hook")


# Not here: bf16_compress_hook (DDP takes it only with CUDA and NCCL 2.10+, or XPU), and
# batched_powerSGD_hook (torch 2.13's raises in _orthogonalize before it communicates, with gloo too).
COMM_HOOKS = ["allreduce", "fp16_compress", "powerSGD"]


def _train_with_hooks(rank, world):
    # Small buckets (several per step) and one bucket. PowerSGD with several buckets issues
    # all-reduces from its callbacks on the worker thread while the main thread issues the next
    # buckets': their order differs across ranks, with gloo too (its own error); one bucket only.
    return {(hook, bucket): _train(rank, world, steps=8, hook=hook, bucket_cap_mb=bucket)
            for hook in COMM_HOOKS for bucket in ((25,) if "powerSGD" in hook else (0.01, 25))}


@pytest.mark.parametrize("world, where", [(2, "default"), (3, "default"), (2, "nccl"), (3, "nccl"), (4, "2 nodes")])
def test_ddp_comm_hooks_match_gloo(world, where):
    """torch's shipped comm hooks, PowerSGD's among them (its future callbacks issue and wait for
    all-reduces: with ed2ce97's single worker thread they hung), train as with gloo. Under the
    pass-through, PowerSGD's callbacks issue and wait on the queue's thread."""
    hca = run_ranks(_train_with_hooks, world, **group_kind(where))
    gloo = run_ranks(_train_with_hooks, world, backend="gloo")
    for hook in hca[0]:
        for a, b in zip(hca[0][hook], gloo[0][hook]):
            # fp16 sums of 3 ranks may round in another order than gloo's.
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-3, atol=1e-4, msg=str(hook))
        for a, b in zip(hca[0][hook], hca[-1][hook]):
            assert (a == b).all(), hook  # replicas stay identical


def _ddp_configuration(seed, world):
    """A random DDP setting and hca options (every rank draws the same)."""
    import random

    from test_random_sequences import _random_options

    rnd = random.Random(seed)
    config = dict(options=_random_options(rnd, world, nccl=True), bucket_cap_mb=rnd.choice([0.001, 0.01, 0.2, 25]),
                  find_unused_parameters=rnd.random() < 0.4, gradient_as_bucket_view=rnd.random() < 0.5,
                  batch_norm=rnd.random() < 0.4, accumulate=rnd.choice([1, 2, 3]),
                  hook=rnd.choice([None, "allreduce", "fp16_compress"]),
                  dtype=rnd.choice([torch.float32, torch.float64]))
    # torch's static graph takes neither unused parameters nor no_sync(), under any backend.
    config["static_graph"] = not config["find_unused_parameters"] and config["accumulate"] == 1 and rnd.random() < 0.5
    return config


class _SideBranch(torch.nn.Module):
    """A branch that some steps leave out (find_unused_parameters), and a batch norm's buffers."""

    def __init__(self, batch_norm):
        super().__init__()
        self.a, self.b, self.side = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)
        self.norm = torch.nn.BatchNorm1d(32) if batch_norm else torch.nn.Identity()

    def forward(self, x, use_side):
        h = torch.relu(self.norm(self.a(x)))
        return self.b(h) + (self.side(h) if use_side else 0)


def _train_configured(rank, world, seed):
    import contextlib

    config = _ddp_configuration(seed, world)
    torch.manual_seed(seed)
    model = _SideBranch(config["batch_norm"]).to(config["dtype"])
    ddp = DDP(model, **{k: config[k] for k in ("bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view",
                                                "static_graph")})
    if config["hook"]:
        ddp.register_comm_hook(*_comm_hook(config["hook"]))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(6):
        opt.zero_grad()
        for micro in range(config["accumulate"]):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            last = micro == config["accumulate"] - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                use_side = not config["find_unused_parameters"] or step % 2 == 0
                out = ddp(x.to(config["dtype"]), use_side)
                torch.nn.functional.mse_loss(out, y.to(config["dtype"])).backward()
        opt.step()
    def arrays(tensors):  # tensors would travel by fd
        return [t.detach().double().numpy().copy() for t in tensors if t.is_floating_point()]

    return arrays(model.parameters()), arrays(model.buffers())


@pytest.mark.parametrize("seed", seeds(2))
def test_random_ddp_configurations_match_gloo(seed):
    """DDP's settings drawn at random (bucket size, unused parameters, static graph, bucket views,
    batch norm buffers, gradient accumulation under no_sync(), a comm hook, float64) on a group of
    random options, 2-3 ranks: the parameters and buffers as under gloo, the parameters of every
    replica identical (a batch norm's running statistics are each rank's own).
    HCA_TEST_SEEDS=N runs N seeds."""
    world = 2 + seed % 2
    config = _ddp_configuration(seed, world)
    hca = run_ranks(_train_configured, world, seed, pg_options=torch_hca.Options(**config["options"]))
    gloo = run_ranks(_train_configured, world, seed, backend="gloo")
    tolerance = dict(rtol=1e-3, atol=1e-4) if config["hook"] == "fp16_compress" else dict(rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(hca, gloo):
        for a, b in zip(mine[0] + mine[1], theirs[0] + theirs[1]):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), **tolerance, msg=str(config))
    for replica in hca[1:]:
        for a, b in zip(hca[0][0], replica[0]):
            assert (a == b).all(), config


def _train_fsdp2(rank, world):
    initial, trained = fsdp2_training(rank)
    return [t.numpy() for t in initial], [t.numpy() for t in trained]  # tensors would travel by fd


def test_fsdp2_matches_gloo():
    hca = run_ranks(_train_fsdp2, 2)
    gloo = run_ranks(_train_fsdp2, 2, backend="gloo")
    initial, trained = hca[0]
    assert any((a != b).any() for a, b in zip(initial, trained))  # training moved the parameters
    for a, b in zip(trained, gloo[0][1]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-6)


def _tf_style(rank, world):
    errors = []
    values = [make_input(7 + i, rank, n, torch.float32, "SUM") for i, n in enumerate((5, 300, 1))]
    every = [[make_input(7 + i, r, n, torch.float32, "SUM") for r in range(world)] for i, n in enumerate((5, 300, 1))]
    for ops in (torch_hca.HierarchicalCopyAllReduce(num_packs=2), torch_hca.ReductionToOneDevice(reduce_to_device=0)):
        originals = [v.clone() for v in values]
        summed = ops.batch_reduce("sum", [(v, None) for v in values])
        means = ops.batch_reduce("mean", [(v, None) for v in values])
        for i in range(3):
            errors.append(mismatch(f"{type(ops).__name__} sum {i}", summed[i], reduce_reference(every[i], "SUM"), world))
            errors.append(mismatch(f"{type(ops).__name__} mean {i}", means[i], reduce_reference(every[i], "AVG"), world))
            errors.append(None if torch.equal(values[i], originals[i]) else "inputs were modified")
        one = ops.reduce("sum", values[1])
        errors.append(mismatch("reduce", one, reduce_reference(every[1], "SUM"), world))
        errors.append(mismatch("broadcast", ops.broadcast(values[0], src=world - 1), every[0][world - 1], world))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 3])
def test_tf_style_cross_device_ops(world):
    assert run_ranks(_tf_style, world) == [[]] * world


def _subgroups(rank, world):
    """Default group and overlapping subgroups used in interleaved order."""
    errors = []
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    tail = dist.new_group(list(range(1, world)))
    for i in range(10):
        t = torch.full((100,), float(rank + i))
        dist.all_reduce(t)
        errors.append(None if torch.all(t == sum(r + i for r in range(world))) else f"world {i}")
        if rank % 2 == 0:
            t = torch.full((7,), float(rank))
            dist.all_reduce(t, group=evens)
            errors.append(None if torch.all(t == sum(range(0, world, 2))) else f"evens {i}")
        if rank >= 1:
            t = torch.full((9,), float(rank))
            dist.all_reduce(t, group=tail, op=dist.ReduceOp.MAX)
            errors.append(None if torch.all(t == world - 1) else f"tail {i}")
    return [e for e in errors if e]


def test_overlapping_subgroups_interleaved():
    assert run_ranks(_subgroups, 4) == [[]] * 4


def _mixed_string(rank, world):
    t = torch.full((10,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist() == [world * (world + 1) / 2] * 10 and dist.get_backend() == "cpu:gloo,cuda:hca"


def test_mixed_backend_string():
    """'cpu:gloo,cuda:hca' initialises; CPU tensors go to gloo (CUDA ones would go to hca)."""
    assert run_ranks(_mixed_string, 2, backend="cpu:gloo,cuda:hca") == [True, True]


def _options_from_env(rank, world):
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.algorithm


def test_options_from_environment():
    env = {"TORCH_HCA_ALGORITHM": "reduce_to_one_device", "TORCH_HCA_REDUCE_TO_DEVICE": "1"}
    assert run_ranks(_options_from_env, 2, env=env) == ["reduce_to_one_device"] * 2


def test_invalid_world_dependent_options_raise_value_error():
    with pytest.raises(Exception, match="ValueError: reduce_to_device: 5 is outside"):
        run_ranks(_options_from_env, 2, pg_options=torch_hca.Options("reduce_to_one_device", reduce_to_device=5))
    with pytest.raises(Exception, match="ValueError: groups: rank 1 is in no group"):
        run_ranks(_options_from_env, 2, pg_options=torch_hca.Options(groups=[[0]]))
