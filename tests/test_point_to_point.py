"""send, recv (from a rank or any rank), isend/irecv and batch_isend_irecv: many messages in
flight, messages to oneself, tags received in any order, messages larger than a channel's ring
(64 KiB), every dtype, against the data each sender made; errors for misfit messages, dead and
silent peers. The tests taking `device` run on CPU tensors, on the CPU model of the device
("cpu-streams": messages of device tensors, staged through the host in stream order) and on CUDA
where there is a GPU."""
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import raises, run_ranks
from torch_hca import _C
from reference import DTYPES, make_input, rank_device

BIG = 300_001  # float32: 1.2 MB, many trips round a 64 KiB ring


def _data(sender, receiver, tag, numel, dtype=torch.float32, dev="cpu"):
    return make_input(1000 * sender + 10 * receiver + tag, sender, numel, dtype, "SUM").to(dev)


def _wrong(name, got, want):
    got, want = got.cpu(), want.cpu()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).sum().item() if got.shape == want.shape else "shape"
        return f"{name}: {bad} elements differ"
    return None


def _ring_blocking(rank, world, device):
    """Everyone sends first, then receives: the receiver's mailbox drains early messages, so
    blocking sends larger than the ring do not deadlock."""
    dev, errors = rank_device(device, rank), []
    for numel in (1, 1000, BIG):
        dst, src = (rank + 1) % world, (rank - 1) % world
        dist.send(_data(rank, dst, 0, numel, dev=dev), dst)
        got = torch.empty(numel, device=dev)
        dist.recv(got, src)
        errors.append(_wrong(f"ring numel={numel}", got, _data(src, rank, 0, numel)))
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_blocking_ring_of_sends_and_recvs(world, device):
    for errors in run_ranks(_ring_blocking, world, device):
        assert errors == []


def _many_in_flight(rank, world, device):
    """Every rank sends 4 tagged messages (sizes up to BIG) to every other rank; receivers post
    their irecvs in reverse tag order, all before waiting on any."""
    dev, sizes = rank_device(device, rank), {0: 7, 1: 4096, 2: BIG, 3: 0}
    sends = [dist.isend(_data(rank, peer, tag, sizes[tag], dev=dev), peer, tag=tag)
             for peer in range(world) if peer != rank for tag in sizes]
    bufs = {(peer, tag): torch.full((sizes[tag],), float("nan"), device=dev)
            for peer in range(world) if peer != rank for tag in reversed(sizes)}
    recvs = [dist.irecv(buf, peer, tag=tag) for (peer, tag), buf in bufs.items()]
    for w in sends + recvs:
        w.wait()
    return [e for e in (_wrong(f"from {p} tag {t}", b, _data(p, rank, t, sizes[t])) for (p, t), b in bufs.items()) if e]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_many_messages_in_flight_tags_in_any_order(world, device):
    for errors in run_ranks(_many_in_flight, world, device):
        assert errors == []


def _sizes_in_flight(rank, world, device):
    """Messages from 1 byte to 64 MiB, all in flight at once to the next rank and from the
    previous one, received into leaves that require grad (as pipelining's buffers do) and into
    a strided view."""
    dev = rank_device(device, rank)
    nbytes = [1, 3, 65_537, 1 << 20, 64 << 20]
    dst, src = (rank + 1) % world, (rank - 1) % world

    def message(sender, i, n):
        dtype = torch.uint8 if n % 4 else torch.float32
        return _data(sender, (sender + 1) % world, i, n // dtype.itemsize, dtype)

    sends = [dist.isend(message(rank, i, n).to(dev), dst, tag=i) for i, n in enumerate(nbytes)]
    bufs = []
    for i, n in enumerate(nbytes):
        want = message(src, i, n)
        buf = torch.zeros(want.numel() * (2 if i == 2 else 1), dtype=want.dtype, device=dev)
        bufs.append((i, buf[::2] if i == 2 else buf, want))
    for _, buf, _ in bufs:
        if buf.is_floating_point():
            buf.requires_grad_()
    recvs = [dist.irecv(buf, src, tag=i) for i, buf, _ in bufs]
    for w in recvs + sends:
        w.wait()
    return [e for e in (_wrong(f"{nbytes[i]} bytes", buf.detach(), want) for i, buf, want in bufs) if e]


@pytest.mark.parametrize("world", [2, 3])
def test_sizes_from_one_byte_to_64_mib_in_flight(world, device):
    for errors in run_ranks(_sizes_in_flight, world, device):
        assert errors == []


def _batch(rank, world, device):
    """A pipeline step: batch_isend_irecv to both neighbours, twice, same-pair order kept; then a
    batch whose receive misfits its message. The errors, the count of Works per batch and the misfit's error."""
    dev, errors, counts = rank_device(device, rank), [], []
    for step in range(2):
        right, left = (rank + 1) % world, (rank - 1) % world
        out_r, out_l = _data(rank, right, step, BIG, dev=dev), _data(rank, left, step + 10, 513, dev=dev)
        in_l, in_r = torch.empty(BIG, device=dev), torch.empty(513, device=dev)
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
        ops = [dist.P2POp(dist.irecv, torch.empty(20 if rank % 2 == 0 else 10, device=dev), peer),
               dist.P2POp(dist.isend, _data(rank, peer, 0, 10, dev=dev), peer)]
        works = dist.batch_isend_irecv(ops)
        misfit = raises(works[0].wait, ValueError)
        works[1].wait()  # before the group goes: the peer's receive needs all of it
    return [e for e in errors if e], counts, misfit


@pytest.mark.parametrize("world", [2, 3, 4])
def test_batch_isend_irecv_pipeline_step(world, device):
    """As with gloo: a Work per operation (hca does not declare coalescing: one Work per batch
    measured slower, see docs/architecture.md), the misfit failing its receive only."""
    for rank, (errors, counts, misfit) in enumerate(run_ranks(_batch, world, device)):
        assert errors == [] and counts == [4, 4], (errors, counts)
        if rank % 2 == 0 and rank + 1 < world:
            assert misfit.startswith("hca recv: rank ") and (
                f"rank {rank + 1} sent 10 x float32 with tag 0, but this recv expects 20 x float32" in misfit), misfit
        elif rank % 2 == 1:
            assert misfit == "UNEXPECTED: no exception", misfit


def _all_to_all_with_own_block(rank, world, device):
    """An all-to-all as batch_isend_irecv writes it, this rank's own block among its messages
    (NCCL takes messages to oneself; gloo does not): up to a block larger than what a process
    keeps of early messages (32 MiB), which waits in the ring for its receive."""
    dev, errors = rank_device(device, rank), []
    for numel in (0, 1000, BIG, 9_000_001):
        outs = [torch.full((numel,), float("nan"), device=dev) for _ in range(world)]
        ops = [dist.P2POp(dist.isend, _data(rank, peer, 0, numel, dev=dev), peer) for peer in range(world)]
        ops += [dist.P2POp(dist.irecv, outs[peer], peer) for peer in range(world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        errors += [_wrong(f"numel={numel} from {peer}", out, _data(peer, rank, 0, numel)) for peer, out in enumerate(outs)]
    # Outside a batch, the receive posted first or second.
    mine = _data(rank, rank, 1, 77, dev=dev)
    first, second = torch.empty(77, device=dev), torch.empty(77, device=dev)
    sent = dist.isend(mine, rank, tag=1)
    dist.irecv(first, rank, tag=1).wait()
    received = dist.irecv(second, rank, tag=2)
    dist.isend(mine, rank, tag=2).wait()
    received.wait()
    sent.wait()
    errors += [_wrong("isend, then irecv", first, mine), _wrong("irecv, then isend", second, mine)]
    return [e for e in errors if e]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_messages_to_oneself_as_in_an_all_to_all(world, device):
    for errors in run_ranks(_all_to_all_with_own_block, world, device):
        assert errors == []


def _receive_from_oneself_unsent(rank, world, device):
    start = time.monotonic()
    try:
        dist.recv(torch.empty(10, device=rank_device(device, rank)), rank, tag=3)
        return "UNEXPECTED: no exception", 0.0
    except Exception as e:
        return str(e), time.monotonic() - start


@pytest.mark.parametrize("world", [1, 2])
def test_a_receive_from_oneself_with_no_send_says_so(world, device):
    """Only this rank could send it, so the timeout names the missing send, not a peer that never came."""
    for rank, (msg, elapsed) in enumerate(run_ranks(_receive_from_oneself_unsent, world, device, pg_timeout_s=2)):
        assert f"hca recv from rank {rank} (tag 3" in msg and "Timed out after 2000 ms" in msg, msg
        assert "a message from this rank to itself" in msg and f"a send to rank {rank} with the same tag" in msg, msg
        assert 1.5 < elapsed < 2 + 5


def _any_source(rank, world, device):
    dev = rank_device(device, rank)
    if rank != 0:
        dist.send(_data(rank, 0, 5, 77, dev=dev), 0, tag=5)
        return None
    got = {}
    for _ in range(world - 1):
        t = torch.empty(77, device=dev)
        src = dist.recv(t, tag=5)
        got[src] = _wrong(f"from {src}", t, _data(src, 0, 5, 77))
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_recv_from_any_source_reports_the_sender(world, device):
    got = run_ranks(_any_source, world, device)[0]
    assert sorted(got) == list(range(1, world))
    assert all(e is None for e in got.values()), got


def _dtypes_and_layouts(rank, world, device):
    dev, errors = rank_device(device, rank), []
    peer = 1 - rank
    for i, dtype in enumerate(DTYPES):
        want = _data(peer, rank, i, 1000, dtype)
        if rank == 0:
            dist.send(_data(rank, peer, i, 1000, dtype, dev), peer, tag=i)
            got = torch.zeros(2000, dtype=dtype, device=dev)[::2]  # non-contiguous: received into a copy, written back
            dist.recv(got, peer, tag=i)
        else:
            got = torch.empty(10, 100, dtype=dtype, device=dev)  # any shape with the same number of elements
            dist.recv(got, peer, tag=i)
            got = got.reshape(-1)
            mine = _data(rank, peer, i, 1000, dtype, dev)
            dist.send(torch.stack([mine, mine], 1)[:, 0], peer, tag=i)  # a strided view sends its elements
        errors.append(_wrong(str(dtype), got, want))
    return [e for e in errors if e]


def test_every_dtype_and_non_contiguous_tensors(device):
    for errors in run_ranks(_dtypes_and_layouts, 2, device):
        assert errors == []


def _pipeline(rank, world, device):
    """Three steps of a GPipe schedule (torch.distributed.pipelining), one stage per rank, four
    micro-batches: activations forward and gradients backward go by batch_isend_irecv into
    buffers that require grad. Each stage's parameters after the steps."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dev = rank_device(device, rank)
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
              for _ in range(world)]
    mine = stages[rank].to(dev)
    schedule = ScheduleGPipe(PipelineStage(mine, rank, world, dev), n_microbatches=4,
                             loss_fn=lambda out, target: ((out - target) ** 2).mean())
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, target = torch.randn(16, 64, generator=g).to(dev), torch.randn(16, 64, generator=g).to(dev)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        optimizer.step()
    return [p.detach().cpu().numpy() for p in mine.parameters()]  # tensors would travel as shared fds


@pytest.mark.parametrize("world", [2, 3])
def test_a_pipeline_schedule_matches_gloo(world, device):
    got = run_ranks(_pipeline, world, device)
    want = run_ranks(_pipeline, world, "cpu", backend="gloo")
    for rank in range(world):
        for g, w in zip(got[rank], want[rank]):
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w), rtol=1e-5, atol=1e-6)


def _sent_then_destroyed(rank, world, device):
    """Rank 0 sends 40 MiB (hundreds of trips round the 64 KiB ring), drops the Work and destroys
    its group at once; rank 1 posts its recv 0.5 s later. A graceful shutdown delivers what it was
    asked to send (it used to fail the send, and rank 1's recv with it)."""
    dev, group = rank_device(device, rank), dist.new_group()
    numel = 10 << 20
    if rank == 0:
        dist.isend(_data(0, 1, 0, numel, dev=dev), 1, group=group)
        start = time.monotonic()
        dist.destroy_process_group(group)
        return time.monotonic() - start
    time.sleep(0.5)
    got = torch.empty(numel, device=dev)
    dist.recv(got, 0, group=group)
    dist.destroy_process_group(group)
    return _wrong("the message", got, _data(0, 1, 0, numel))


def test_a_send_nobody_waited_on_is_delivered_before_its_group_shuts_down(device):
    seconds, wrong = run_ranks(_sent_then_destroyed, 2, device)
    assert wrong is None, wrong
    assert seconds < 10, seconds  # the transfer's time, not the group's timeout


def _messages_from_a_callback(rank, world, device, where):
    """Each rank's receive has a Future callback, attached before the message comes, that sends
    and receives (blocking) on its own group or on another one, and waits on a receive posted
    before it: the callback runs on the thread that moves messages, which must not wait for
    itself (it hung on its own group; with one such thread per process, on any group)."""
    import threading
    dev, other = rank_device(device, rank), dist.new_group()
    group = None if where == "same" else other
    dst, src = (rank + 1) % world, (rank - 1) % world
    trigger = torch.empty(7, device=dev)
    early = torch.empty(BIG, device=dev)
    early_work = dist.irecv(early, src, tag=5)

    def callback(_):
        dist.send(_data(rank, dst, 3, BIG, dev=dev), dst, group=group, tag=3)
        got = torch.empty(BIG, device=dev)
        dist.recv(got, src, group=group, tag=3)
        dist.send(_data(rank, dst, 5, BIG, dev=dev), dst, tag=5)
        early_work.wait()
        return [threading.current_thread() is not threading.main_thread(),
                _wrong("in the callback", got, _data(src, rank, 3, BIG)), _wrong("posted before", early, _data(src, rank, 5, BIG))]

    fut = dist.irecv(trigger, src).get_future().then(callback)
    dist.barrier()  # every callback attached before any message comes
    dist.send(_data(rank, dst, 0, 7, dev=dev), dst)
    off_main, *wrong = fut.wait()
    wrong.append(_wrong("trigger", trigger, _data(src, rank, 0, 7)))
    return off_main, [w for w in wrong if w]


@pytest.mark.parametrize("where", ["same", "other"])
def test_a_callback_may_send_and_receive(where, device):
    if os.environ.get("TORCH_HCA_CPU_EXECUTOR") == "streams":
        pytest.skip("the CPU model of the device completes a Future on its stream's own thread, where a callback "
                    "that waits for a message waits for that stream; a CUDA Future completes on the thread that "
                    "finished the call, the progress thread, as CPU tensors' do")
    for off_main, wrong in run_ranks(_messages_from_a_callback, 3, device, where):
        assert off_main and wrong == [], (off_main, wrong)


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


def _early_messages_on_two_groups(rank, world):
    """Rank 0 sends 24 MiB on the world group and 24 MiB on a second group before rank 1 posts
    either receive: rank 1 keeps one of them aside (the budget, 32 MiB, is the process's, not each
    group's), the other waits in its ring; then both arrive whole, and nothing stays held."""
    second = dist.new_group(backend="hca")
    numel = 6 << 20
    for group in (None, second):  # a first message starts each group's progress thread on rank 1
        dist.send(torch.ones(10), 1, group=group) if rank == 0 else dist.recv(torch.empty(10), 0, group=group)
    if rank == 0:
        works = [dist.isend(_data(0, 1, tag, numel), 1, group=group, tag=tag)
                 for tag, group in ((1, None), (2, second))]
        dist.barrier()
        for work in works:
            work.wait()
        return None
    dist.barrier()
    time.sleep(1.0)  # both frames reach rank 1's progress threads meanwhile
    held = _C._stashed_bytes_in_process()
    wrong = []
    for tag, group in ((2, second), (1, None)):
        got = torch.empty(numel)
        dist.recv(got, 0, group=group, tag=tag)
        wrong.append(_wrong(f"tag {tag}", got, _data(0, 1, tag, numel)))
    return held, [w for w in wrong if w], _C._stashed_bytes_in_process()


def test_early_messages_of_all_groups_share_one_budget():
    held, wrong, after = run_ranks(_early_messages_on_two_groups, 2)[1]
    assert held == 24 << 20 and wrong == [] and after == 0, (held >> 20, wrong, after)


def _big_unmatched_before_a_posted_recv(rank, world):
    """Rank 1 posts a receive for tag 2, then rank 0 sends 40 MiB with tag 1 (more than the
    early-message budget, nobody receives it yet) and then tag 2 behind it in the same ring: the
    posted receive must get its message (the big one is kept aside), not wait for the timeout."""
    big, small = 10 << 20, 1000
    if rank == 0:
        dist.barrier()
        works = [dist.isend(_data(0, 1, 1, big), 1, tag=1), dist.isend(_data(0, 1, 2, small), 1, tag=2)]
        for work in works:
            work.wait()
        return None
    second = torch.empty(small)
    work = dist.irecv(second, 0, tag=2)
    dist.barrier()
    start = time.monotonic()
    work.wait()
    took = time.monotonic() - start
    first = torch.empty(big)
    dist.recv(first, 0, tag=1)
    wrong = [_wrong("tag 2", second, _data(0, 1, 2, small)), _wrong("tag 1", first, _data(0, 1, 1, big))]
    return [w for w in wrong if w], took


def test_a_big_unmatched_message_does_not_block_a_posted_recv_behind_it():
    wrong, took = run_ranks(_big_unmatched_before_a_posted_recv, 2, pg_timeout_s=20)[1]
    assert wrong == [] and took < 10, (wrong, took)


def _rings_reserved_as_pairs_talk(rank, world):
    """/dev/shm held by the group's channels (one file, so every rank reads the same number) at
    init and after rank 0 -> 1, then rank 1 -> 2 exchange a message (a ring each, 64 KiB)."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    seen = []
    for src, dst in ((None, None), (0, 1), (1, 2), (0, 1)):
        if rank == src:
            dist.send(_data(src, dst, 0, BIG), dst)
        elif rank == dst:
            got = torch.empty(BIG)
            dist.recv(got, src)
            assert _wrong("message", got, _data(src, dst, 0, BIG)) is None
        dist.barrier()
        seen.append(backend._p2p_reserved_bytes())
        dist.barrier()
    return seen


def test_rings_take_dev_shm_only_once_their_pair_talks():
    """A group maps world^2 rings; pairs that never talk (every pair, in a program without
    send/recv) take no /dev/shm, only the counters' page."""
    ring, page = _C._mailbox_ring_bytes(3), os.sysconf("SC_PAGE_SIZE")
    for seen in run_ranks(_rings_reserved_as_pairs_talk, 3):
        assert seen == [page, page + ring, page + 2 * ring, page + 2 * ring], (seen, page, ring)


def _pending_at_destroy(rank, world):
    """Receives nobody sends to, posted just before their group is destroyed: every wait raises
    at once, saying so (none may hang, whether or not the progress thread saw it)."""
    group = dist.new_group(timeout=timedelta(seconds=20))
    dist.barrier(group=group)
    works = [dist.irecv(torch.empty(10), (rank + 1) % world, group=group, tag=1000 + i) for i in range(200)]
    dist.barrier(group=group)  # every rank posted all: a rank that destroys first fails the others' waits, not posts
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
    for rank, (messages, elapsed) in enumerate(run_ranks(_pending_at_destroy, world)):
        # Its own destroy, or (a rank slower to destroy) the peer's leaving, noticed first.
        peer_left = f"rank {(rank + 1) % world} left: its process group was shut down"
        assert all(m == "the process group was destroyed first" or m.startswith(peer_left) for m in messages), messages
        assert elapsed < 10, elapsed
