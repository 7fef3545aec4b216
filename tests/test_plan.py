"""The plan layer: groups, packing and schedules (no processes needed)."""
import itertools

import pytest
import torch

import torch_hca
from torch_hca import _C, costs


def _gather(pack, tensors):
    """A pack's elements: its segments (tensor, offset, numel) laid end to end."""
    return torch.cat([tensors[t][o:o + n] for t, o, n in pack["segments"]])


def _scatter(pack, tensors, values):
    at = 0
    for t, o, n in pack["segments"]:
        tensors[t][o:o + n] = values[at:at + n]
        at += n


def _simulate(plan, world, inputs):
    """Executes a plan's edges on plain tensors, as a transport would. inputs[rank] is that
    rank's list of tensors; returns every rank's outputs."""
    outputs = [[x.clone() for x in mine] for mine in inputs]
    for pack in plan.packs:
        staged = [_gather(pack, inputs[r]) for r in range(world)]
        for step in pack["steps"]:
            before = [s.clone() for s in staged]
            for kind, src, dst in step:
                staged[dst] = staged[dst] + before[src] if kind == "reduce" else before[src].clone()
        for r in pack["result_ranks"]:
            _scatter(pack, outputs[r], staged[r])
    return outputs


def test_explain_needs_a_world_size_or_a_group_and_a_known_device():
    with pytest.raises(ValueError, match="give world_size, or a running group"):
        torch_hca.explain(numels=[10])
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda', got 'xpu'"):
        torch_hca.explain(2, device="xpu")


def test_dgx1_halves_and_rotating_leaders():
    plan = torch_hca.explain(8, num_packs=8, numels=[64])
    assert _C.default_groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for i, pack in enumerate(plan.packs):
        members, across, back, down = pack["steps"]
        root0, root1 = i, (i + 4) % 8  # TF: root1 = (root0 + N/2) % N
        assert sorted({dst for _, _, dst in members}) == sorted([root0, root1])
        assert across == [("reduce", root1, root0)]
        assert back == [("copy", root0, root1)]
        assert sorted(dst for _, _, dst in down) == sorted(set(range(8)) - {root0, root1})
    assert plan.leaders() == list(range(8))


@pytest.mark.parametrize("world", range(1, 10))
def test_every_rank_is_in_exactly_one_group(world):
    groups = _C.default_groups(world)
    assert sorted(itertools.chain(*groups)) == list(range(world))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("num_packs", [0, 1, 2, 3, 7, 40])
@pytest.mark.parametrize("algorithm", ["hierarchical_copy", "reduce_to_one_device", "direct"])
def test_schedule_reduces_every_rank_exactly(world, num_packs, algorithm):
    """Odd world sizes too: following the edges sums every rank's data exactly once."""
    numels = [29, 3, 11]  # several tensors: packs span tensor boundaries
    plan = torch_hca.explain(world, algorithm=algorithm, num_packs=num_packs, numels=numels)
    inputs = [[torch.arange(n, dtype=torch.float64) * 1000 + 10 ** r + 7 * t for t, n in enumerate(numels)]
              for r in range(world)]
    for out in _simulate(plan, world, inputs):
        for t in range(len(numels)):
            assert torch.equal(out[t], sum(inputs[r][t] for r in range(world)))


def test_user_groups_and_position_rule():
    plan = torch_hca.explain(5, num_packs=5, groups=[[0, 1], [2, 3, 4]], numels=[10])
    # Pack 3: leader 3 (position 1 of the second group); the first group's leader is its member at position 1.
    members = plan.packs[3]["steps"][0]
    assert sorted(members) == [("reduce", 0, 1), ("reduce", 2, 3), ("reduce", 4, 3)]
    assert plan.packs[3]["steps"][1] == [("reduce", 1, 3)]


def test_packing_splits_and_more_packs_than_elements():
    plan = torch_hca.explain(2, num_packs=3, numels=[4, 6])
    assert [p["numel"] for p in plan.packs] == [4, 3, 3]
    assert plan.packs[0]["segments"] == [(0, 0, 4)]
    assert plan.packs[1]["segments"] == [(1, 0, 3)]
    tiny = torch_hca.explain(4, num_packs=10, numels=[3])
    assert [p["numel"] for p in tiny.packs] == [1, 1, 1]
    assert tiny.leaders() == [0, 1, 2]
    assert torch_hca.explain(2, num_packs=0, numels=[4, 0, 6]).packs[1]["segments"] == [(2, 0, 6)]


def test_small_tensor_aggregation():
    plan = torch_hca.explain(2, num_packs=0, numels=[10, 10, 10, 1000, 10, 10], agg_small_grads_max_bytes=100,
                             agg_small_grads_max_group=2)
    assert [[s[0] for s in p["segments"]] for p in plan.packs] == [[0, 1], [2], [3], [4, 5]]


def test_reduce_to_one_device_and_rooted_collectives():
    plan = torch_hca.explain(4, algorithm="reduce_to_one_device", reduce_to_device=2)
    assert plan.packs[0]["steps"] == [[("reduce", 0, 2), ("reduce", 1, 2), ("reduce", 3, 2)],
                                      [("copy", 2, 0), ("copy", 2, 1), ("copy", 2, 3)]]
    reduce = torch_hca.explain(4, collective="reduce", root=3)
    assert reduce.packs[0]["result_ranks"] == [3] and reduce.leaders() == [3]
    bcast = torch_hca.explain(3, collective="broadcast", root=1)
    assert bcast.packs[0]["steps"] == [[("copy", 1, 0), ("copy", 1, 2)]]
    assert "step 1: copy 1->0, copy 1->2" in str(bcast)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_packs=-1), "num_packs"),
    (dict(algorithm="ring"), "algorithm"),
    (dict(reduce_to_device=4), "reduce_to_device"),
    (dict(groups=[[0, 1], [1, 2, 3]]), "groups"),
    (dict(groups=[[0, 1], [2]]), "groups"),
    (dict(groups=[[0, 1, 2, 3, 4]]), "groups"),
    (dict(collective="reduce", root=9), "root"),
])
def test_invalid_plans_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        torch_hca.explain(4, **kwargs)


@pytest.mark.parametrize("by_size", [[(1, "hierarchical_copy", True)],
                                     [(0, "hierarchical_copy", False), (0, "reduce_to_one_device", False)],
                                     [(0, "hierarchical_copy", False), (9, "ring", False)]])
def test_a_choice_by_size_must_start_at_0_and_ascend(by_size):
    with pytest.raises(ValueError, match="by_size|algorithm"):
        torch_hca.Options().plan_options(by_size=by_size)


def test_nccl_plan_is_the_packing_alone():
    plan = torch_hca.explain(4, algorithm="nccl", num_packs=0, numels=[10, 10, 5000, 10],
                             agg_small_grads_max_bytes=100, agg_small_grads_max_group=10)
    assert [[s[0] for s in p["segments"]] for p in plan.packs] == [[0, 1], [2], [3]]
    assert all(p["steps"] == [] for p in plan.packs)


@pytest.mark.parametrize("world, cpus, numel", [
    (2, 2, 256), (2, 2, 1 << 20), (4, 2, 1 << 20), (4, 2, 16 << 20), (1, 2, 1 << 20), (4, 8, 1 << 20)])
def test_num_packs_is_chosen_per_call_where_the_user_set_none(world, cpus, numel):
    """By the cost model (test_costs.py); here what the packs hold, and that what the user sets wins."""
    model = costs.shipped(world, cpus) if world > 1 else None
    chosen = model.choose(numel * 4, ("one_pack", "pack_per_rank")) if model else "one_pack"
    packs = world if chosen == "pack_per_rank" else 1
    plan = torch_hca.explain(world, "hierarchical_copy", numels=[numel], cpus=cpus)
    assert len(plan.packs) == packs
    assert ("chosen per call: " in plan.text) == (world > 1), plan.text
    assert sorted(pack["numel"] for pack in plan.packs) == sorted(
        numel // packs + (i < numel % packs) for i in range(packs))
    # What the user sets wins; reduce_to_one_device does not rotate its leader: one pack.
    assert len(torch_hca.explain(world, num_packs=1, numels=[numel], cpus=cpus).packs) == 1
    assert len(torch_hca.explain(world, "reduce_to_one_device", numels=[numel], cpus=cpus).packs) == 1
    assert "chosen per call" not in torch_hca.explain(world, num_packs=2, numels=[numel], cpus=cpus).text
    assert "chosen per call" not in torch_hca.explain(world, "reduce_to_one_device", numels=[numel], cpus=cpus).text
    # CUDA tensors: one pack of hierarchical copy until a GPU has measured a choice.
    cuda = torch_hca.explain(world, numels=[numel], cpus=cpus, device="cuda")
    assert len(cuda.packs) == 1 and cuda.chosen is None and "chosen per call" not in cuda.text
    # Its rounds are those of a CUDA staging slot (8 MiB by default), not a shared-memory one.
    assert f"rounds of a {8 << 20}-byte slot" in cuda.text and f"rounds of a {8 << 20}-byte slot" not in plan.text


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_explain_shows_what_ranks_on_given_gpus_would_get_for_cuda_tensors(world):
    """Without a running group: ranks whose tensors share one GPU get its table and 64 MiB slots (4 or
    more ranks: reduce_to_one_device), ranks on GPUs of their own one pack and 8 MiB slots."""
    numel = 1 << 18
    model = costs.sharing_one_gpu(world)
    shared = torch_hca.explain(world, numels=[numel], device="cuda", gpus=[0] * world)
    assert shared.chosen == model.choose(numel * 4) == ("one_pack" if world < 4 else "reduce_to_one_device")
    assert shared.cost_model.origin == model.origin
    assert f"rounds of a {64 << 20}-byte slot" in shared.text and "sharing one NVIDIA H200" in shared.text
    for gpus in (list(range(world)), [0] * (world - 1) + [1]):
        spread = torch_hca.explain(world, numels=[numel], device="cuda", gpus=gpus)
        assert spread.chosen is None and len(spread.packs) == 1, gpus
        assert f"rounds of a {8 << 20}-byte slot" in spread.text, gpus
    fixed = torch_hca.explain(world, num_packs=1, numels=[numel], device="cuda", gpus=[0] * world)
    assert fixed.chosen is None and f"rounds of a {64 << 20}-byte slot" in fixed.text  # what the user sets wins


def test_explain_refuses_gpus_it_cannot_use():
    with pytest.raises(ValueError, match="gpus: 2 GPUs for a world of 3 ranks"):
        torch_hca.explain(3, device="cuda", gpus=[0, 0])
    with pytest.raises(ValueError, match="gpus: for device='cuda' without a running group"):
        torch_hca.explain(2, gpus=[0, 0])
