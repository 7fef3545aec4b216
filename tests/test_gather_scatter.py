"""gather, scatter, all_to_all (flat with equal and unequal splits, and the list form),
all_gather_coalesced and coalesced all_gather_into_tensor: world sizes 1-4, every dtype, blocking
and async, against each rank's seeded data; mismatched splits and calls give clear errors."""
import pytest
import torch
import torch.distributed as dist

from harness import SMALL_CHUNKS, group_kind, raises, run_ranks
from reference import DTYPES, all_gather_single, make_input, rank_device

WORLD_SIZES = [1, 2, 3, 4]


def _data(rank, case, numel, dtype):
    return make_input(case, rank, numel, dtype, "SUM")


def _check(errors, name, got, want):
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        errors.append(f"{name}: got {got.dtype}{list(got.shape)}, {(got != want).sum().item() if got.shape == want.shape else '-'} differ")


def _wait(work, async_op, dev):
    """The async path: through the Work's Future (as DDP hooks read it), then the Work. Neither
    blocks a GPU's host until the device is done (they order the caller's stream), and
    is_completed() says what the device did: so only once the host has waited for the device."""
    if async_op:
        work.get_future().wait()
        work.wait()
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        assert work.is_completed()


def _rooted(rank, world, device, async_op):
    dev, errors = rank_device(device, rank), []
    for case, dtype in enumerate(DTYPES):
        for numel in (1, 1000, 40_000):
            for root in {0, world - 1}:
                # gather
                mine = _data(rank, case, numel, dtype)
                out = [torch.full((numel,), 7, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
                _wait(dist.gather(mine.to(dev), out, dst=root, async_op=async_op), async_op, dev)
                if rank == root:
                    for j in range(world):
                        _check(errors, f"gather {dtype} {numel} root {root} from {j}", out[j], _data(j, case, numel, dtype))
                # scatter
                parts = [_data(root, 100 + case + j, numel, dtype).to(dev) for j in range(world)]
                got = torch.full((numel,), 7, dtype=dtype, device=dev)
                work = dist.scatter(got, parts if rank == root else None, src=root, async_op=async_op)
                _wait(work, async_op, dev)
                _check(errors, f"scatter {dtype} {numel} root {root}", got, _data(root, 100 + case + rank, numel, dtype))
    return errors


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gather_and_scatter(world, async_op, device):
    for errors in run_ranks(_rooted, world, device, async_op, env=SMALL_CHUNKS):
        assert errors == []


def _splits(world, case):
    """The rows rank i sends rank j: uneven, some empty, the same table on every rank."""
    g = torch.Generator().manual_seed(case)
    table = torch.randint(0, 4, (world, world), generator=g)
    table[0, world - 1] = 0
    return table.tolist()


def _alltoall(rank, world, device, async_op):
    dev, errors = rank_device(device, rank), []
    for case, dtype in enumerate(DTYPES):
        # Equal splits, rows of 3 elements.
        rows = 2
        mine = _data(rank, case, world * rows * 3, dtype).reshape(world * rows, 3)
        out = torch.full((world * rows, 3), 7, dtype=dtype, device=dev)
        _wait(dist.all_to_all_single(out, mine.to(dev), async_op=async_op), async_op, dev)
        want = torch.cat([_data(i, case, world * rows * 3, dtype).reshape(world * rows, 3)[rank * rows:(rank + 1) * rows]
                          for i in range(world)])
        _check(errors, f"all_to_all_single equal {dtype}", out, want)
        # Unequal splits, rows of 5 elements, some empty; large enough for several rounds.
        table = _splits(world, case)
        scale = 3000 if dtype == torch.float32 else 1
        sends = [table[rank][j] * scale for j in range(world)]
        expects = [table[i][rank] * scale for i in range(world)]
        mine = _data(rank, 50 + case, sum(sends) * 5, dtype).reshape(-1, 5)
        out = torch.full((sum(expects), 5), 7, dtype=dtype, device=dev)
        _wait(dist.all_to_all_single(out, mine.to(dev), expects, sends, async_op=async_op), async_op, dev)
        want = []
        for i in range(world):
            theirs = _data(i, 50 + case, sum(table[i][j] * scale for j in range(world)) * 5, dtype).reshape(-1, 5)
            start = sum(table[i][j] * scale for j in range(rank))
            want.append(theirs[start:start + table[i][rank] * scale])
        _check(errors, f"all_to_all_single splits {dtype}", out, torch.cat(want))
        # The list form: tensor j goes to rank j, of a size that depends on both ends.
        ins = [_data(rank, 200 + case + j, rank + 2 * j + 1, dtype).to(dev) for j in range(world)]
        outs = [torch.full((i + 2 * rank + 1,), 7, dtype=dtype, device=dev) for i in range(world)]
        _wait(dist.all_to_all(outs, ins, async_op=async_op), async_op, dev)
        for i in range(world):
            _check(errors, f"all_to_all list {dtype} from {i}", outs[i], _data(i, 200 + case + rank, i + 2 * rank + 1, dtype))
    return errors


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_to_all(world, async_op, device):
    for errors in run_ranks(_alltoall, world, device, async_op, env=SMALL_CHUNKS):
        assert errors == []


def _coalesced(rank, world, device):
    dev, errors = rank_device(device, rank), []
    for case, dtype in enumerate(DTYPES):
        sizes = [1, 513, 20_000]
        ins = [_data(rank, 300 + case + k, n, dtype).to(dev) for k, n in enumerate(sizes)]
        outs = [[torch.full((n,), 7, dtype=dtype, device=dev) for n in sizes] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins, async_op=True).wait()  # torch returns the Work's Future here
        for r in range(world):
            for k, n in enumerate(sizes):
                _check(errors, f"all_gather_coalesced {dtype} rank {r} tensor {k}", outs[r][k],
                       _data(r, 300 + case + k, n, dtype))
        flats = [torch.full((world * n,), 7, dtype=dtype, device=dev) for n in sizes]
        with dist._coalescing_manager(device=dev, async_ops=True) as cm:
            for flat, x in zip(flats, ins):
                all_gather_single(flat, x)
        cm.wait()
        for k, n in enumerate(sizes):
            _check(errors, f"coalesced all_gather_into_tensor {dtype} tensor {k}", flats[k],
                   torch.cat([_data(r, 300 + case + k, n, dtype) for r in range(world)]))
    return errors


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_allgather_coalesced_forms(world, device):
    for errors in run_ranks(_coalesced, world, device, env=SMALL_CHUNKS):
        assert errors == []


def _bad_calls(rank, world):
    msgs = {
        # Rank 0 sends 2 rows to rank 1, which expects 3: every rank learns it from the exchange.
        "splits": raises(lambda: dist.all_to_all_single(torch.empty(5), torch.empty(5),
                                                         [2, 3] if rank == 0 else [3, 2], [2, 3]), ValueError),
        "split sum": raises(lambda: dist.all_to_all_single(torch.empty(4), torch.empty(4), [1] * world, [1, 2]),
                             ValueError),
        "indivisible": raises(lambda: dist.all_to_all_single(torch.empty(3), torch.empty(3)), ValueError),
    }
    if world == 1:  # only the dst rank sees its gather_list: alone, nobody else waits for it
        msgs["gather size"] = raises(lambda: dist.gather(torch.ones(3), [torch.empty(2)]), ValueError)
    t = torch.ones(3)
    dist.all_reduce(t)
    msgs["still works"] = "" if torch.equal(t, torch.full((3,), float(world))) else f"UNEXPECTED {t}"
    return msgs


def _gather_single(rank, world):
    """dist.gather_single (torch 2.14 on): every rank's part into one tensor on the root, every
    dtype; then a root whose output is a part short, which every rank hears of at once."""
    errors = []
    for case, dtype in enumerate(DTYPES):
        for numel in (1, 40_000):
            root = (case + numel) % world
            parts = [_data(r, 700 + case, numel, dtype) for r in range(world)]
            out = torch.empty(world * numel, dtype=dtype) if rank == root else None
            dist.gather_single(parts[rank], out, dst=root)
            if rank == root:
                _check(errors, f"gather_single {dtype} {numel}", out, torch.cat(parts))
    short = torch.empty(world - 1) if rank == 0 else None
    refused = raises(lambda: dist.gather_single(torch.ones(1), short, dst=0),
                     ValueError if rank == 0 else dist.DistBackendError)
    return errors, refused


@pytest.mark.skipif(not hasattr(dist, "gather_single"), reason="torch has dist.gather_single from 2.14 on")
@pytest.mark.parametrize("where", ["default", "nccl", "2 nodes"])
def test_gather_single(where):
    """Stock gloo (2.15) does not support it."""
    world = 4 if where == "2 nodes" else 3
    for rank, (errors, refused) in enumerate(run_ranks(_gather_single, world, **group_kind(where))):
        assert errors == [], errors
        assert "the output has" in refused and f"expected {world}" in refused, refused
        if rank != 0:
            assert "refused at the call" in refused, refused


def test_bad_calls_give_clear_errors():
    for msgs in run_ranks(_bad_calls, 2):
        assert "hca alltoall_base: rank 1 sends 2 elements to rank 0, but rank 0 expects 3 from rank 1" in msgs["splits"], msgs
        assert "the input splits add up to 3 rows, but its first dimension is 4" in msgs["split sum"], msgs
        assert "first dimension (3) does not divide into 2 equal splits" in msgs["indivisible"], msgs
        assert msgs["still works"] == "", msgs
    msgs = run_ranks(_bad_calls, 1)[0]
    assert "hca gather: a gather_list tensor has 2 elements, expected 3" in msgs["gather size"], msgs


def _mismatched(rank, world, kind):
    if kind == "gather dst":  # every rank thinks it is the root
        call = lambda: dist.gather(torch.ones(3), [torch.empty(3) for _ in range(world)], dst=rank)  # noqa: E731
    elif kind == "scatter vs gather":
        call = (lambda: dist.scatter(torch.empty(3), [torch.ones(3)] * world, src=0)) if rank == 0 else \
               (lambda: dist.gather(torch.ones(3), dst=0))
    else:  # alltoall with equal splits against an allreduce
        call = (lambda: dist.all_to_all_single(torch.empty(2 * world), torch.ones(2 * world))) if rank == 0 else \
               (lambda: dist.all_reduce(torch.ones(2 * world)))
    return raises(call, dist.DistBackendError)


@pytest.mark.parametrize("kind", ["gather dst", "scatter vs gather", "alltoall vs allreduce"])
def test_mismatched_calls_are_reported(kind):
    for msg in run_ranks(_mismatched, 2, kind, pg_timeout_s=20):
        assert "mismatched calls" in msg, msg
