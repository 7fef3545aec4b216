"""send, recv (from a rank or any rank), isend/irecv and batch_isend_irecv on CPU tensors: many
messages in flight, tags received in any order, messages larger than a channel's ring (64 KiB),
every dtype, against the data each sender made; errors for misfit messages, dead and silent peers."""
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import raises, run_ranks
from reference import DTYPES, make_input

BIG = 300_001  # float32: 1.2 MB, many trips round a 64 KiB ring


def _data(sender, receiver, tag, numel, dtype=torch.float32):
    return make_input(1000 * sender + 10 * receiver + tag, sender, numel, dtype, "SUM")


def _wrong(name, got, want):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).sum().item() if got.shape == want.shape else "shape"
        return f"{name}: {bad} elements differ"
    return None


def _ring_blocking(rank, world):
    """Everyone sends first, then receives: the receiver's mailbox drains early messages, so
    blocking sends larger than the ring do not deadlock."""
    errors = []
    for numel in (1, 1000, BIG):
        dst, src = (rank + 1) % world, (rank - 1) % world
        dist.send(_data(rank, dst, 0, numel), dst)
        got = torch.empty(numel)
        dist.recv(got, src)
        errors.append(_wrong(f"ring numel={numel}", got, _data(src, rank, 0, numel)))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_blocking_ring_of_sends_and_recvs(world):
    for errors in run_ranks(_ring_blocking, world):
        assert errors == []


def _many_in_flight(rank, world):
    """Every rank sends 4 tagged messages (sizes up to BIG) to every other rank; receivers post
    their irecvs in reverse tag order, all before waiting on any."""
    sizes = {0: 7, 1: 4096, 2: BIG, 3: 0}
    sends = [dist.isend(_data(rank, peer, tag, sizes[tag]), peer, tag=tag)
             for peer in range(world) if peer != rank for tag in sizes]
    bufs = {(peer, tag): torch.full((sizes[tag],), float("nan"))
            for peer in range(world) if peer != rank for tag in reversed(sizes)}
    recvs = [dist.irecv(buf, peer, tag=tag) for (peer, tag), buf in bufs.items()]
    for w in sends + recvs:
        w.wait()
    return [e for e in (_wrong(f"from {p} tag {t}", b, _data(p, rank, t, sizes[t])) for (p, t), b in bufs.items()) if e]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_many_messages_in_flight_tags_in_any_order(world):
    for errors in run_ranks(_many_in_flight, world):
        assert errors == []


def _batch(rank, world):
    """A pipeline step: batch_isend_irecv to both neighbours, twice, same-pair order kept; then a
    batch whose receive misfits its message. The errors, the count of Works per batch and the misfit's error."""
    errors, counts = [], []
    for step in range(2):
        right, left = (rank + 1) % world, (rank - 1) % world
        out_r, out_l = _data(rank, right, step, BIG), _data(rank, left, step + 10, 513)
        in_l, in_r = torch.empty(BIG), torch.empty(513)
        ops = [dist.P2POp(dist.irecv, in_l, left), dist.P2POp(dist.isend, out_r, right),
               dist.P2POp(dist.irecv, in_r, right), dist.P2POp(dist.isend, out_l, left)]
        works = dist.batch_isend_irecv(ops)
        counts.append(len(works))
        for w in works:
            w.wait()
        errors.append(_wrong("from left", in_l, _data(left, rank, step, BIG)))
        errors.append(_wrong("from right", in_r, _data(right, rank, step + 10, 513)))
    peer = rank ^ 1
    misfit = None
    if peer < world:  # pairs (0, 1), (2, 3): rank 0 and 2 expect 20 elements, their peers send 10
        ops = [dist.P2POp(dist.irecv, torch.empty(20 if rank % 2 == 0 else 10), peer),
               dist.P2POp(dist.isend, _data(rank, peer, 0, 10), peer)]
        misfit = raises(lambda: [w.wait() for w in dist.batch_isend_irecv(ops)], RuntimeError)
    return [e for e in errors if e], counts, misfit


@pytest.mark.parametrize("world", [2, 3, 4])
def test_batch_isend_irecv_pipeline_step(world):
    """As with gloo: a Work per operation (hca does not declare coalescing: one Work per batch
    measured slower, see docs/architecture.md), the misfit failing its receive only."""
    for rank, (errors, counts, misfit) in enumerate(run_ranks(_batch, world)):
        assert errors == [] and counts == [4, 4], (errors, counts)
        if rank % 2 == 0 and rank + 1 < world:
            assert f"rank {rank + 1} sent 10 x float32 with tag 0, but this recv expects 20 x float32" in misfit, misfit
        elif rank % 2 == 1:
            assert misfit == "UNEXPECTED: no exception", misfit


def _any_source(rank, world):
    if rank != 0:
        dist.send(_data(rank, 0, 5, 77), 0, tag=5)
        return None
    got = {}
    for _ in range(world - 1):
        t = torch.empty(77)
        src = dist.recv(t, tag=5)
        got[src] = _wrong(f"from {src}", t, _data(src, 0, 5, 77))
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_recv_from_any_source_reports_the_sender(world):
    got = run_ranks(_any_source, world)[0]
    assert sorted(got) == list(range(1, world))
    assert all(e is None for e in got.values()), got


def _dtypes_and_layouts(rank, world):
    errors = []
    peer = 1 - rank
    for i, dtype in enumerate(DTYPES):
        want = _data(peer, rank, i, 1000, dtype)
        if rank == 0:
            dist.send(_data(rank, peer, i, 1000, dtype), peer, tag=i)
            got = torch.zeros(2000, dtype=dtype)[::2]  # non-contiguous: received into a copy, written back
            dist.recv(got, peer, tag=i)
        else:
            got = torch.empty(10, 100, dtype=dtype)  # any shape with the same number of elements
            dist.recv(got, peer, tag=i)
            got = got.reshape(-1)
            dist.send(_data(rank, peer, i, 1000, dtype), peer, tag=i)
        errors.append(_wrong(str(dtype), got, want))
    return [e for e in errors if e]


def test_every_dtype_and_non_contiguous_tensors():
    for errors in run_ranks(_dtypes_and_layouts, 2):
        assert errors == []


def _misfit(rank, world):
    """A message that does not fit the receive fails that receive (ValueError), is consumed,
    and the channel goes on working."""
    if rank == 1:
        dist.send(torch.ones(10), 0)
        dist.send(torch.ones(10, dtype=torch.int64), 0, tag=1)
        dist.send(torch.arange(4.0), 0, tag=2)
        return {}
    msgs = {
        "size": raises(lambda: dist.recv(torch.empty(20), 1), ValueError),
        "dtype": raises(lambda: dist.recv(torch.empty(10), 1, tag=1), ValueError),
        "bad src": raises(lambda: dist.recv(torch.empty(2), world + 3), ValueError),
    }
    t = torch.empty(4)
    dist.recv(t, 1, tag=2)
    msgs["after"] = "" if torch.equal(t, torch.arange(4.0)) else f"UNEXPECTED {t}"
    return msgs


def test_a_misfit_message_fails_only_its_recv():
    msgs = run_ranks(_misfit, 2)[0]
    assert "hca recv: rank 1 sent 10 x float32 with tag 0, but this recv expects 20 x float32" in msgs["size"], msgs
    assert "rank 1 sent 10 x int64 with tag 1, but this recv expects 10 x float32" in msgs["dtype"], msgs
    assert "UNEXPECTED" not in msgs["bad src"], msgs
    assert msgs["after"] == "", msgs


def _peer_dies(rank, world):
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    msg = raises(lambda: dist.recv(torch.empty(10), 1), dist.DistBackendError)
    after = raises(lambda: dist.all_reduce(torch.ones(2)), dist.DistBackendError)
    return msg, after, time.monotonic() - start


def test_a_peer_that_dies_during_recv_is_named():
    msg, after, elapsed = run_ranks(_peer_dies, 2, pg_timeout_s=20, allow_missing=(1,))[0]
    assert "hca recv from rank 1 (tag 0, 10 x float32)" in msg and "died" in msg, msg
    assert elapsed < 10  # liveness, not the 20 s timeout
    assert "unusable" in after, after


def _silent_peer(rank, world):
    if rank == 1:
        time.sleep(4)
        return None
    start = time.monotonic()
    msg = raises(lambda: dist.recv(torch.empty(10), 1, tag=3), dist.DistBackendError)
    return msg, time.monotonic() - start


def test_a_silent_peer_times_out_naming_it():
    msg, elapsed = run_ranks(_silent_peer, 2, pg_timeout_s=2)[0]
    assert "hca recv from rank 1 (tag 3, 10 x float32): Timed out after 2000 ms waiting for rank 1" in msg, msg
    assert 1.5 < elapsed < 6


def _world_of_one(rank, world):
    return raises(lambda: dist.send(torch.ones(1), 0), ValueError)


def test_a_world_of_one_has_nobody_to_send_to():
    msg = run_ranks(_world_of_one, 1)[0]
    assert "UNEXPECTED" not in msg, msg


def _rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _unmatched_sends(rank, world):
    """Rank 0 sends 4 x 16 MiB with tags nobody receives: the receiver keeps at most its early-message
    budget (32 MiB), the rest waits in the ring, and the sends that cannot finish time out."""
    if rank == 0:
        dist.send(torch.ones(10), 1, tag=1)
        works = [dist.isend(torch.ones(4 << 20), 1, tag=10 + i) for i in range(4)]
        outcomes = []
        for work in works:
            try:
                work.wait()
                outcomes.append("sent")
            except dist.DistBackendError as e:
                outcomes.append(str(e))
        return outcomes
    dist.recv(torch.empty(10), 0, tag=1)  # the one it does receive
    before = _rss_bytes()
    time.sleep(4)  # longer than the group's timeout: rank 0's sends have given up by then
    return _rss_bytes() - before


def test_messages_nobody_receives_are_bounded():
    outcomes, grown = run_ranks(_unmatched_sends, 2, pg_timeout_s=2)
    assert grown < 40 << 20, f"the receiver grew by {grown >> 20} MiB"
    assert outcomes[:2] == ["sent", "sent"], outcomes
    assert all("send to rank 1" in o and "Timed out" in o for o in outcomes[2:]), outcomes


def _pending_at_destroy(rank, world):
    """Receives nobody sends to, posted just before their group is destroyed: every wait raises
    at once, saying so (none may hang, whether or not the progress thread saw it)."""
    group = dist.new_group(timeout=timedelta(seconds=20))
    dist.barrier(group=group)
    works = [dist.irecv(torch.empty(10), (rank + 1) % world, group=group, tag=1000 + i) for i in range(200)]
    dist.destroy_process_group(group)
    del group  # the last reference: the backend goes now
    start, messages = time.monotonic(), set()
    for work in works:
        try:
            work.wait()
            messages.add("no error")
        except dist.DistBackendError as e:
            messages.add(str(e).split(": ", 1)[-1])
    return sorted(messages), time.monotonic() - start


@pytest.mark.parametrize("world", [2, 3])
def test_messages_pending_at_destroy_fail_instead_of_hanging(world):
    for messages, elapsed in run_ranks(_pending_at_destroy, world):
        assert messages == ["the process group was destroyed first"], messages
        assert elapsed < 10, elapsed
