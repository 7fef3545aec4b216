"""Reading a plan as a rank executes it: roles and rounds (pure plan code, no processes).

The simulator below follows the round runner's rules with nothing but the plan's roles and
rounds: a rank stages only where its role says so, reads its input in its fused step, takes its
result at its last incoming edge, reads only slots whose role names it a reader, and pieces of a
round share one slot. If a role were wrong (a rank that must stage but does not, a result taken
too early, a reader missing, for whom a slot's reuse would not wait), the checks below would fail."""
import pytest
import torch

import torch_hca

ES = 4  # float32


def _cover(plan, slot_bytes):
    """Every pack is cut into pieces that tile it exactly once, in order, fit and do not overlap."""
    done = [0] * len(plan.packs)
    for pieces in plan.rounds:
        spans = []
        for pack, begin, count, offset in pieces:
            assert begin == done[pack] and count > 0
            assert offset % 64 == 0 and offset + count * ES <= slot_bytes
            spans.append((offset, offset + count * ES))
            done[pack] += count
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert done == [p["numel"] for p in plan.packs]


def _run_rounds(plan, world, inputs):
    """What every rank's output holds after executing the plan round by round through roles."""
    outputs = [x.clone() for x in inputs]
    for pieces in plan.rounds:
        slot = [torch.full((1 << 16,), float("nan"), dtype=torch.float64) for _ in range(world)]
        for pack, begin, count, offset in pieces:
            info = plan.packs[pack]
            lo = info["segments"][0][1] + begin
            at = slice(offset // ES, offset // ES + count)
            for r in range(world):
                if plan.roles[r][pack]["stages"]:
                    slot[r][at] = inputs[r][lo:lo + count]
            for s, step in enumerate(info["steps"]):
                before = [x.clone() for x in slot]
                for dst in {d for _, _, d in step}:
                    edges = [(kind, src) for kind, src, d in step if d == dst]
                    # A rank reuses its slot after waiting for its readers alone: every read is theirs.
                    assert all(dst in plan.roles[src][pack]["readers"] for _, src in edges), (pack, s, dst)
                    if edges[0][0] == "copy":
                        slot[dst][at] = before[edges[0][1]][at]
                        continue
                    fused = plan.roles[dst][pack]["fused_step"] == s
                    mine = inputs[dst][lo:lo + count] if fused else before[dst][at]
                    slot[dst][at] = mine + sum(before[src][at] for _, src in edges)
                for r in range(world):
                    role = plan.roles[r][pack]
                    if role["result"] and role["last_in"] == s:
                        outputs[r][lo:lo + count] = slot[r][at]
            for r in range(world):
                role = plan.roles[r][pack]
                if role["result"] and role["last_in"] < 0:
                    outputs[r][lo:lo + count] = inputs[r][lo:lo + count]
    return outputs


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("num_packs", [0, 1, 2, 7])
@pytest.mark.parametrize("algorithm", ["hierarchical_copy", "reduce_to_one_device", "direct"])
@pytest.mark.parametrize("slot_bytes", [256, 4096])
def test_roles_and_rounds_reduce_every_rank_exactly(world, num_packs, algorithm, slot_bytes):
    numel = 1000
    plan = torch_hca.explain(world, algorithm=algorithm, num_packs=num_packs, numels=[numel], slot_bytes=slot_bytes)
    _cover(plan, slot_bytes)
    assert len(plan.rounds) >= numel * ES // slot_bytes
    inputs = [torch.rand(numel, dtype=torch.float64) + 10 ** r for r in range(world)]
    for out in _run_rounds(plan, world, inputs):
        torch.testing.assert_close(out, sum(inputs), rtol=1e-12, atol=0)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_rooted_roles(world):
    for root in range(world):
        plan = torch_hca.explain(world, collective="broadcast", root=root, numels=[300], slot_bytes=512)
        inputs = [torch.rand(300, dtype=torch.float64) for _ in range(world)]
        for out in _run_rounds(plan, world, inputs):
            assert torch.equal(out, inputs[root])
        reduce = torch_hca.explain(world, collective="reduce", root=root, numels=[300], slot_bytes=512)
        assert [reduce.roles[r][0]["result"] for r in range(world)] == [r == root for r in range(world)]
        torch.testing.assert_close(_run_rounds(reduce, world, inputs)[root], sum(inputs), rtol=1e-12, atol=0)


def test_roles_of_hierarchical_copy():
    plan = torch_hca.explain(3, num_packs=3, numels=[9])
    # Pack 1 on 3 ranks, one group: 0 and 2 reduce into 1, which copies back.
    leader, member = plan.roles[1][1], plan.roles[0][1]
    assert leader == dict(stages=False, fused_step=0, result=True, last_in=0, direct=False, readers=[0, 2])
    assert member == dict(stages=True, fused_step=-1, result=True, last_in=1, direct=True, readers=[1])
    assert "rank 1: pack 0 (stages, result at step 2 (copied straight out)), pack 1 (reads its input at step 1" \
        in str(plan)


def test_roles_of_direct():
    """One step in which every rank reduces every peer's slot: every rank stages (peers read it in
    that very step), none reads its input in the reduce (its slot, in rank order), all hold the result."""
    plan = torch_hca.explain(3, "direct", num_packs=2, numels=[9])
    for pack in plan.packs:
        assert pack["steps"] == [[("reduce", src, dst) for dst in range(3) for src in range(3) if src != dst]]
    for rank in range(3):
        peers = [r for r in range(3) if r != rank]
        assert plan.roles[rank] == [dict(stages=True, fused_step=-1, result=True, last_in=0, direct=False,
                                         readers=peers)] * 2
    assert "step 1: reduce 1->0, reduce 2->0, reduce 0->1, reduce 2->1, reduce 0->2, reduce 1->2" in str(plan)


def test_rounds_interleave_packs_and_show_in_explain():
    plan = torch_hca.explain(2, num_packs=2, numels=[4096], slot_bytes=4096)
    assert [[p for p, *_ in pieces] for pieces in plan.rounds] == [[0, 1]] * 4
    assert "round 4: pack 0 [1536:2048) at byte 0, pack 1 [1536:2048) at byte 2048" in str(plan)
