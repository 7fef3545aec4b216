"""The CUDA path: what runs everywhere (device routing, the CUDA compile check's presence)
and the GPU tests that skip without CUDA. The collectives' whole matrix runs on CUDA through
the `device` fixture of test_collectives.py, and DDP and FSDP2 with collectives in flight through
test_in_flight.py's; these add stream semantics and failures."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import torch_hca
from harness import raises, run_ranks, watch_until
from reference import make_input, mismatch, rank_device, reduce_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _other_device_is_named(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    return (raises(lambda: backend.allreduce([torch.empty(4, device="meta")], opts), NotImplementedError),
            raises(lambda: backend.send([torch.empty(4, device="meta")], 1 - rank, 0), NotImplementedError))


def test_a_device_without_executor_raises_not_implemented_naming_it():
    for collective, message in run_ranks(_other_device_is_named, 2):
        assert collective.startswith("hca allreduce: tensors on meta are not supported by this build"), collective
        assert message.startswith("hca send: tensors on meta are not supported by this build"), message


def test_build_reports_cuda_support():
    assert torch_hca._C.has_cuda in (True, False)
    if torch.cuda.is_available() and torch.version.cuda:
        assert torch_hca._C.has_cuda, "torch has CUDA but the extension was built without its CUDA executor"


def _busy_stream_async(rank, world):
    """The caller's stream is busy producing the input when the async collective is issued:
    the collective must wait for it, and wait() must order the caller's stream after it."""
    dev = rank_device("cuda", rank)
    errors = []
    for algorithm in ("hierarchical_copy", "reduce_to_one_device"):
        group = dist.new_group(backend="hca", pg_options=torch_hca.Options(algorithm, num_packs=2))
        inputs = [make_input(7, r, 1 << 20, torch.float32, "SUM") for r in range(world)]
        a = torch.randn(2048, 2048, device=dev)
        t = torch.zeros(1 << 20, device=dev)
        for _ in range(4):
            a = a @ a / 2048  # keeps the current stream busy
        t.add_(inputs[rank].to(dev))  # queued behind the matmuls
        work = dist.all_reduce(t, async_op=True, group=group)
        work.wait()
        result = t * 1  # on the current stream, after wait()
        errors.append(mismatch(f"{algorithm} async", result, reduce_reference(inputs, "SUM"), world))
        fut = dist.all_reduce(t, async_op=True, group=group).get_future()
        errors.append(mismatch(f"{algorithm} future", fut.wait()[0], reduce_reference(inputs, "SUM") * world, world))
    torch.cuda.synchronize()
    return [e for e in errors if e]


@needs_cuda
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_async_collectives_follow_the_callers_stream(world):
    assert run_ranks(_busy_stream_async, world) == [[]] * world


def _barrier_after_a_long_kernel(rank, world):
    """The last rank's current stream runs a long kernel when the barrier is called: no rank's
    barrier may return before it has finished (a thread watches an event recorded after it)."""
    dev = rank_device("cuda", rank)
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)  # the group's first CUDA call: the device the barrier drains
    torch.cuda.synchronize(dev)
    join = None
    if rank == world - 1:
        torch.cuda._sleep(int(5e8))  # a few hundred ms of spinning on the caller's stream
        finished = torch.cuda.Event()
        finished.record()
        join = watch_until(finished.query)
    dist.barrier()
    returned = time.monotonic()
    return (join(60) if join else 0.0), returned


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_a_barrier_waits_for_every_ranks_device_work(world):
    """As ProcessGroupNCCL's (the CPU model's version: test_model_device.py)."""
    results = run_ranks(_barrier_after_a_long_kernel, world)
    kernel_done = results[-1][0]
    for rank, (_, returned) in enumerate(results):
        assert returned >= kernel_done - 0.02, (rank, kernel_done - returned)


def _capture_refused(rank, world):
    """A collective inside CUDA graph capture raises on the caller's thread; the group still works."""
    dev = rank_device("cuda", rank)
    t = torch.ones(1000, device=dev)
    torch.cuda.synchronize()
    graph, message = torch.cuda.CUDAGraph(), "no error"
    try:
        with torch.cuda.graph(graph):
            dist.all_reduce(t)
    except RuntimeError as e:
        message = str(e)
    dist.all_reduce(t)
    return message, mismatch("after the refusal", t, torch.full((1000,), float(world)), world)


@needs_cuda
@pytest.mark.parametrize("world", [1, 2])
def test_graph_capture_is_refused_and_the_group_stays_usable(world):
    for message, error in run_ranks(_capture_refused, world):
        assert "hca: collectives cannot be captured in a CUDA graph yet" in message, message
        assert error is None, error


def _dies_mid_collective_cuda(rank, world):
    dev = rank_device("cuda", rank)
    t = torch.ones(1 << 22, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 1:
        dist.all_reduce(t, async_op=True)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(t)
            torch.cuda.synchronize()  # released by the watchdog, not hung
        return "no error", time.monotonic() - start
    except dist.DistBackendError as e:
        return str(e), time.monotonic() - start


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_killed_rank_releases_the_streams_and_is_named(world):
    results = run_ranks(_dies_mid_collective_cuda, world, pg_timeout_s=5, allow_missing=(1,))
    for rank, result in enumerate(results):
        if rank == 1:
            continue
        msg, elapsed = result
        assert "rank 1" in msg and ("died" in msg or "failed" in msg), msg
        assert elapsed < 5 + 5


def _first_collective_errors(rank, world):
    t = torch.ones(4, device=rank_device("cuda", rank))
    first = raises(lambda: (dist.all_reduce(t), torch.cuda.synchronize()), dist.DistBackendError)
    after = raises(lambda: dist.all_reduce(t), dist.DistBackendError)
    return first, after


@needs_cuda
def test_different_cuda_staging_fails_at_the_first_collective():
    # The IPC staging is set up at the first CUDA collective (the self-test's, which runs first):
    # both ranks raise there, naming the user's call and the variables, and the group is unusable
    # afterwards (no hang, no collective on mismatched slots).
    envs = [{"TORCH_HCA_CUDA_CHUNK_BYTES": str(8 << 20)}, {"TORCH_HCA_CUDA_CHUNK_BYTES": str(4 << 20)}]
    for first, after in run_ranks(_first_collective_errors, 2, env_per_rank=envs, pg_timeout_s=30):
        assert "allreduce, the group's first collective on cuda tensors, failed in the self-test" in first, first
        assert "TORCH_HCA_CUDA_CHUNK_BYTES / TORCH_HCA_CUDA_SLOTS" in first, first
        assert "unusable" in after, after


def _on_gpu_0_unset_slot(rank, world):
    """Every rank on cuda:0 with TORCH_HCA_CUDA_CHUNK_BYTES unset: the staging it chose, the rounds
    explain shows, and an all-reduce of two 64 MiB slots and a tail checked element by element."""
    inputs = [make_input(11, r, (32 << 20) + 5, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].to("cuda:0")
    dist.all_reduce(t)
    wrong = mismatch("all-reduce", t.cpu(), reduce_reference(inputs, "SUM"), world)
    found = torch_hca.hierarchy()
    rounds = torch_hca.explain(group=dist.group.WORLD, device="cuda", numels=[(32 << 20) + 5]).rounds
    return wrong, found["staging"]["cuda"], found["staging_slot_bytes"]["cuda"], len(rounds)


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_one_gpu_stage_in_64_mib_slots(world):
    """Each round costs a switch between the processes sharing a GPU (about 1 ms on an H200,
    docs/cuda.md), so there the unset slot is 64 MiB: a 128 MiB all-reduce runs in 3 rounds."""
    for wrong, staging, slot_bytes, rounds in run_ranks(_on_gpu_0_unset_slot, world,
                                                        env={"TORCH_HCA_CUDA_CHUNK_BYTES": ""}):
        assert not wrong, wrong
        assert staging.endswith(f"; 4 slots of {64 << 20} bytes per rank") and slot_bytes == 64 << 20, staging
        assert rounds == 3, rounds


def _chosen_on_one_gpu(rank, world):
    """What the group's CUDA tensors are planned with before and after its first CUDA collective,
    and all-reduces of every size the table covers (and both dtypes it casts), checked element by
    element. No set_device, before or after init: every rank's tensors are on cuda:0."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = backend.by_size(cuda=True)
    errors = []
    for case, (numel, dtype) in enumerate([(1, torch.float32), (1000, torch.bfloat16), (70_001, torch.float32),
                                           ((4 << 20) + 3, torch.float32)]):
        inputs = [make_input(case, r, numel, dtype, "SUM") for r in range(world)]
        t = inputs[rank].to("cuda:0")
        dist.all_reduce(t)
        errors.append(mismatch(f"all-reduce {numel} {dtype}", t.cpu(), reduce_reference(inputs, "SUM"), world))
    model = torch_hca.hierarchy()["cost_model"]["cuda"]
    return before, model and model.origin, backend.by_size(cuda=True), [e for e in errors if e]


@needs_cuda
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_choose_their_cuda_all_reduce_by_its_table(world):
    """Ranks whose tensors are on GPU 0: from their first CUDA collective, which finds that out,
    their table is the one measured on ranks sharing a GPU (reduce_to_one_device on 4), and the
    all-reduces it picks are right."""
    want = torch_hca.costs.sharing_one_gpu(world)
    for before, origin, by_size, errors in run_ranks(_chosen_on_one_gpu, world):
        assert before == [] and origin == want.origin, (before, origin)
        assert by_size == torch_hca.costs.plan_choices(want, tuple(torch_hca.costs.CANDIDATES)), by_size
        assert not errors, errors


def _nccl_async_on_a_side_stream(rank, world):
    """algorithm="nccl", async, called on a side stream: the packs' results are divided and
    copied back on hca's stream, which wait() orders the side stream after."""
    dev = rank_device("cuda", rank)
    group = dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl", num_packs=3))
    errors = []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for case in range(3):
            inputs = [[make_input(50 + case * 4 + i, r, n, torch.float32, "AVG") for i, n in enumerate((5, 70_001))]
                      for r in range(world)]
            mine = [t.to(dev) for t in inputs[rank]]
            work = dist.all_reduce_coalesced(mine, op=dist.ReduceOp.AVG, group=group, async_op=True)
            work.wait()
            results = [t * 1 for t in mine]  # on the side stream, after wait()
            for i, got in enumerate(results):
                want = reduce_reference([inputs[r][i] for r in range(world)], "AVG")
                errors.append(mismatch(f"case {case} tensor {i}", got, want, world))
    torch.cuda.synchronize()
    return [e for e in errors if e]


@needs_cuda
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_algorithm_async_orders_a_side_stream_after_it(world):
    from harness import NCCL_SHARED_GPU_ENV, nccl_fits

    if not nccl_fits(world):
        pytest.skip(f"stock NCCL cannot join {world} ranks on {torch.cuda.device_count()} GPU(s) here")
    assert run_ranks(_nccl_async_on_a_side_stream, world, env=NCCL_SHARED_GPU_ENV) == [[]] * world


def _nccl_calls_between_hca_calls(rank, world):
    """Async all-reduces alternating between a group of hca's own algorithm and an
    algorithm="nccl" group, each first call of the first group setting up its staging on the
    group's worker while the caller goes on: NCCL gets each call on the caller's thread, and only
    once every earlier call of the process has put its work on the device."""
    dev = rank_device("cuda", rank)
    own = dist.new_group(backend="hca")
    through_nccl = dist.new_group(backend="hca", pg_options=torch_hca.Options("nccl", num_packs=2))
    calls = []
    for case in range(8):
        inputs = [make_input(80 + case, r, 100_003 * (1 + case % 3), torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].to(dev, copy=True)
        group = own if case % 2 == 0 else through_nccl
        calls.append((case, t, inputs, dist.all_reduce(t, group=group, async_op=True)))
    errors = []
    for case, t, inputs, work in calls:
        work.wait()
        errors.append(mismatch(f"call {case}", t.cpu(), reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]


@needs_cuda
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_algorithm_calls_reach_the_device_in_the_order_they_were_made(world):
    """On one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), where calls that reach the
    device in a different order on each rank deadlock."""
    from harness import NCCL_SHARED_GPU_ENV, nccl_fits

    if not nccl_fits(world):
        pytest.skip(f"stock NCCL cannot join {world} ranks on {torch.cuda.device_count()} GPU(s) here")
    env = {**NCCL_SHARED_GPU_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert run_ranks(_nccl_calls_between_hca_calls, world, env=env, pg_timeout_s=60) == [[]] * world


def _capture_beside_collectives(rank, world):
    """A user captures CUDA graphs (global capture mode, the default) on their own stream while
    hca collectives are in flight and its watchdog queries their events."""
    dev = rank_device("cuda", rank)
    big = torch.ones(1 << 22, device=dev)
    x = torch.arange(1000, device=dev, dtype=torch.float32)
    works = [dist.all_reduce(big, async_op=True) for _ in range(20)]
    graphs = []
    for _ in range(5):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x
            for _ in range(200):
                y = y * 1.0001
        graphs.append((graph, y))
        time.sleep(0.01)
    for work in works:
        work.wait()
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    return mismatch("the collectives beside the captures", big, torch.full((1 << 22,), float(world ** 20)), world)


@needs_cuda
@pytest.mark.parametrize("world", [2])
def test_graph_capture_beside_collectives_in_flight_succeeds(world):
    assert run_ranks(_capture_beside_collectives, world) == [None] * world


def _second_gpu_only(rank, world):
    import ctypes

    torch.cuda.set_device(1)
    t = torch.ones(1000, device="cuda:1")
    for _ in range(3):
        dist.all_reduce(t, async_op=True).wait()
    torch.cuda.synchronize()
    dist.destroy_process_group()  # the watchdog and the executor's teardown switch devices
    libcuda = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert libcuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert libcuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return active.value  # (the harness's own destroy_process_group then fails after the result is in)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_rank_on_another_gpu_creates_no_context_on_gpu_0():
    assert run_ranks(_second_gpu_only, 1) == [0]


def _reduced_and_broadcast(rank, world):
    """All-reduce (fp32 SUM and AVG, bf16 SUM; 1,001 and 3,000,001 elements: several staging
    rounds) and broadcast, each checked on every element against a float64 reference."""
    dev, errors = rank_device("cuda", rank), []
    for case, (numel, dtype, op) in enumerate([(1_001, torch.float32, "SUM"), (3_000_001, torch.float32, "AVG"),
                                              (3_000_001, torch.bfloat16, "SUM")]):
        inputs = [make_input(80 + case, r, numel, dtype, op) for r in range(world)]
        t = inputs[rank].to(dev)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        errors.append(mismatch(f"all_reduce {numel} x {dtype} {op}", t, reduce_reference(inputs, op), world))
        t = inputs[rank].to(dev)
        dist.broadcast(t, src=world - 1)
        errors.append(mismatch(f"broadcast {numel} x {dtype}", t, inputs[world - 1], world))
    torch.cuda.synchronize()
    return [e for e in errors if e]


@needs_cuda
@pytest.mark.parametrize("world", [2, 3])
def test_host_staging_gives_the_same_results(world):
    """TORCH_HCA_CUDA_STAGING=host on one rank only: every rank stages in host shared memory."""
    envs = [{"TORCH_HCA_CUDA_STAGING": "host"}] + [{}] * (world - 1)
    assert run_ranks(_reduced_and_broadcast, world, env_per_rank=envs) == [[]] * world


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_one_visible_gpu_per_process_stages_in_host_memory():
    """The launch SLURM and Kubernetes make: each rank sees only its own GPU, as cuda:0."""
    envs = [{"CUDA_VISIBLE_DEVICES": str(r)} for r in range(2)]
    assert run_ranks(_reduced_and_broadcast, 2, env_per_rank=envs) == [[]] * 2


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.int64])
def test_the_sum_kernel_is_exact_at_every_alignment(dtype):
    """The sum kernel of k = 2..9 inputs (and 130: two launches) on views that start at every element
    offset within 16 bytes, alike or differing between the tensors (16-byte vectors only where all
    share one offset, a scalar head and tail around them), and sizes around a vector: every element
    as float32 (float64) summing in order, rounded once; the copy kernel likewise."""
    k = torch_hca._C._kernels
    per_vector = 16 // torch.tensor([], dtype=dtype).element_size()
    # What the kernel accumulates in: float32 for half types, the dtype's own wrap-around for integers.
    wide = torch.float64 if dtype == torch.float64 else torch.float32 if dtype.is_floating_point else torch.int64
    for n in (1, per_vector - 1, per_vector + 1, 3 * per_vector, 100_003):
        for offsets in ([0, 0, 0], [1, 1, 1], [per_vector - 1] * 3, [0, 1, 0], [1, 0, 2]):
            for count in (2, 3, 9, 130):
                bases = [torch.randint(-50, 50, (n + 16,), device="cuda").to(dtype) for _ in range(count + 1)]
                views = [b[offsets[min(i, 2)]:offsets[min(i, 2)] + n] for i, b in enumerate(bases)]
                out, inputs = views[0], views[1:]
                k.sum(out, inputs)
                acc = inputs[0].to(wide)
                for i, t in enumerate(inputs[1:], 1):
                    if i == 127:  # a second launch: the first one's partial result is rounded to the dtype
                        acc = acc.to(dtype).to(wide)
                    acc = acc + t.to(wide)
                assert torch.equal(out, acc.to(dtype)), (n, offsets, count)
                k.copy(out, inputs[0])
                assert torch.equal(out, inputs[0]), (n, offsets)
