"""Options and their environment variables, including random (fuzzed) values; options that
differ across ranks."""
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import torch_hca
from harness import RankFailed, run_ranks
from reference import make_input, mismatch, reduce_reference
from torch_hca.options import Options, cuda_chunk_bytes, cuda_slots, cuda_staging, shm_chunk_bytes, shm_slots


def test_defaults_and_env():
    assert Options() == Options.from_env({})
    opts = Options.from_env({"TORCH_HCA_ALGORITHM": "reduce_to_one_device", "TORCH_HCA_NUM_PACKS": "4",
                             "TORCH_HCA_REDUCE_TO_DEVICE": "1", "TORCH_HCA_GROUPS": "0,1;2,3",
                             "TORCH_HCA_AGG_SMALL_GRADS_MAX_BYTES": "1024",
                             "TORCH_HCA_AGG_SMALL_GRADS_MAX_GROUP": "5"})
    assert opts == Options("reduce_to_one_device", 4, 1, ((0, 1), (2, 3)), 1024, 5)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_packs=-1), "num_packs >= 0"), (dict(algorithm="allgather"), "algorithm"),
    (dict(num_packs=1.5), "num_packs"), (dict(reduce_to_device=-2), "reduce_to_device"),
    (dict(groups=[[]]), "groups"), (dict(groups=[[0, -1]]), "groups"),
    (dict(agg_small_grads_max_bytes=-5), "agg_small_grads_max_bytes"),
    (dict(agg_small_grads_max_group=-1), "agg_small_grads_max_group"),
])
def test_invalid_options(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Options(**kwargs)


@pytest.mark.parametrize("name, value", [("TORCH_HCA_NUM_PACKS", "-3"), ("TORCH_HCA_NUM_PACKS", "two"),
                                         ("TORCH_HCA_ALGORITHM", "fast"), ("TORCH_HCA_GROUPS", "0,a;1")])
def test_invalid_env_names_the_variable(name, value):
    with pytest.raises(ValueError, match="TORCH_HCA_(NUM_PACKS|ALGORITHM|GROUPS)|num_packs|algorithm"):
        Options.from_env({name: value})


def test_tf_style_argument_checks():
    with pytest.raises(ValueError, match="num_packs >= 0"):
        torch_hca.HierarchicalCopyAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="reduce_to_device"):
        torch_hca.ReductionToOneDevice(reduce_to_device=-4)


def _random_text(rng):
    pool = ["", "0", "1", "-1", "7", "99999999999999999999", "x", "1.5", " 3 ", "0,1;2", ";", "0,,1", "nccl",
            "hierarchical_copy", "reduce_to_one_device", "\x00", "1e3", "-0"]
    return rng.choice(pool) if rng.random() < 0.7 else "".join(rng.choice("0123456789,;-ax ") for _ in range(6))


def test_fuzzed_env_values_never_crash():
    rng = random.Random(1234)
    fields = ["ALGORITHM", "NUM_PACKS", "REDUCE_TO_DEVICE", "GROUPS", "AGG_SMALL_GRADS_MAX_BYTES",
              "AGG_SMALL_GRADS_MAX_GROUP"]
    outcomes = {"ok": 0, "ValueError": 0}
    for _ in range(3000):
        env = {f"TORCH_HCA_{f}": _random_text(rng) for f in rng.sample(fields, rng.randint(1, len(fields)))}
        try:
            opts = Options.from_env(env)
        except ValueError:
            outcomes["ValueError"] += 1
            continue
        outcomes["ok"] += 1
        # Whatever parsed is also a valid plan for some world, or a ValueError there: never a crash.
        for world in (1, 3, 8):
            try:
                torch_hca.explain(world, opts.algorithm, None if opts.num_packs is None else opts.num_packs % 50,
                                  opts.groups, opts.reduce_to_device)
            except ValueError:
                pass
    assert outcomes["ok"] > 100 and outcomes["ValueError"] > 100


def test_chunk_bytes_env():
    assert shm_chunk_bytes({}) == 128 << 10
    assert shm_chunk_bytes({"TORCH_HCA_SHM_CHUNK_BYTES": "65536"}) == 65536
    for bad in ("12", "big"):
        with pytest.raises(ValueError, match="TORCH_HCA_SHM_CHUNK_BYTES"):
            shm_chunk_bytes({"TORCH_HCA_SHM_CHUNK_BYTES": bad})


def test_cuda_staging_env():
    assert cuda_staging({}) == "auto" and cuda_staging({"TORCH_HCA_CUDA_STAGING": " host "}) == "host"
    for bad in ("ipc", "HOST", "1"):
        with pytest.raises(ValueError, match="TORCH_HCA_CUDA_STAGING=.*expected 'auto' .* or 'host'"):
            cuda_staging({"TORCH_HCA_CUDA_STAGING": bad})


def test_cuda_chunk_bytes_env():
    """Unset (or blank), 0: the group chooses the slot at its first CUDA collective."""
    assert cuda_chunk_bytes({}) == 0 and cuda_chunk_bytes({"TORCH_HCA_CUDA_CHUNK_BYTES": " "}) == 0
    assert cuda_chunk_bytes({"TORCH_HCA_CUDA_CHUNK_BYTES": "65536"}) == 65536
    with pytest.raises(ValueError, match="TORCH_HCA_CUDA_CHUNK_BYTES='0': must be between 4096"):
        cuda_chunk_bytes({"TORCH_HCA_CUDA_CHUNK_BYTES": "0"})
    with pytest.raises(ValueError, match="TORCH_HCA_CUDA_CHUNK_BYTES='8M': expected an int"):
        cuda_chunk_bytes({"TORCH_HCA_CUDA_CHUNK_BYTES": "8M"})


@pytest.mark.parametrize("asked,devices,slot", [
    (0, ["GPU-a", "GPU-a"], 64 << 20), (0, ["GPU-a"] * 4, 64 << 20),
    (0, ["GPU-a", "GPU-b"], 8 << 20), (0, ["GPU-a", "GPU-a", "GPU-b"], 8 << 20),
    (0, ["GPU-a"], 8 << 20), (0, [], 8 << 20),
    (65536, ["GPU-a", "GPU-a"], 65536), (65536, ["GPU-a", "GPU-b"], 65536)])
def test_the_cuda_slot_is_larger_where_every_rank_shares_one_gpu(asked, devices, slot):
    """Where two or more ranks all report one GPU, each round costs a switch between their
    processes (about 1 ms on an H200), so the unset slot is 64 MiB there, 8 MiB elsewhere; a slot
    the user set wins."""
    assert torch_hca._C.cuda_slot_bytes(asked, devices) == slot


def _group_made(rank, world):
    return "made"


@pytest.mark.parametrize("name, bad", [("TORCH_HCA_CUDA_STAGING", "ipc"), ("TORCH_HCA_SELF_TEST", "false")])
def test_a_wrong_process_setting_fails_at_init_naming_the_variable(name, bad):
    """Read when the group is made, like every variable: not at the first CUDA collective. A
    self-test setting other than 0 or 1 ran the test unnoticed before."""
    with pytest.raises(RankFailed, match=f"ValueError: {name}='{bad}'"):
        run_ranks(_group_made, 1, env={name: bad})


@pytest.mark.parametrize("reader, name", [(shm_slots, "TORCH_HCA_SHM_SLOTS"), (cuda_slots, "TORCH_HCA_CUDA_SLOTS")])
def test_slot_counts_beyond_the_bound_name_the_variable(reader, name):
    # Counts that would not fit the extension's int (pybind's unreadable TypeError before).
    assert reader({name: "65536"}) == 65536
    for bad in (str(2**31), str(2**40), "65537", "1"):
        with pytest.raises(ValueError, match=f"{name}=.*between 2 and 65536"):
            reader({name: bad})


def _first_allreduce(rank, world):
    t = torch.ones(10)
    dist.all_reduce(t)
    return t.tolist()


# Each case: what rank 1 (or ranks 1 and 2) set differently, and what every rank's error names.
DIFFERING = {
    "agg_small_grads_max_bytes": ([{}, {"TORCH_HCA_NUM_PACKS": "0", "TORCH_HCA_AGG_SMALL_GRADS_MAX_BYTES": "1024"}, {}],
                                  ["num_packs is unset on ranks 0, 2; 0 on rank 1",
                                   "agg_small_grads_max_bytes is 0 on ranks 0, 2; 1024 on rank 1"]),
    "agg_small_grads_max_group": ([{}, {"TORCH_HCA_AGG_SMALL_GRADS_MAX_GROUP": "3"}, {}],
                                  ["agg_small_grads_max_group is 10 on ranks 0, 2; 3 on rank 1"]),
    "reduce_to_device": ([{"TORCH_HCA_REDUCE_TO_DEVICE": "2"}, {"TORCH_HCA_REDUCE_TO_DEVICE": "1"}, {}],
                         ["reduce_to_device is 2 on rank 0; 1 on rank 1; unset on rank 2"]),
    "groups": ([{}, {"TORCH_HCA_GROUPS": "0,1;2"}, {"TORCH_HCA_GROUPS": "0,1;2"}],
               ['groups is "auto" on rank 0; [[0, 1], [2]] on ranks 1, 2']),
    "algorithm": ([{"TORCH_HCA_ALGORITHM": "nccl"}, {}, {}],
                  ['algorithm is "nccl" on rank 0; unset on ranks 1, 2']),
    # Process settings beside the options: before, ranks 1 and 2 waited the whole timeout for rank 0's
    # shared-memory staging and then blamed it; the self-test's collectives met the user's first call.
    "cpu_executor": ([{"TORCH_HCA_CPU_EXECUTOR": "streams"}, {}, {}],
                     ['TORCH_HCA_CPU_EXECUTOR is "streams" on rank 0; "shm" on ranks 1, 2']),
    "self_test": ([{}, {"TORCH_HCA_SELF_TEST": "0"}, {}],
                  ['TORCH_HCA_SELF_TEST is "1" on ranks 0, 2; "0" on rank 1']),
}


@pytest.mark.parametrize("case", DIFFERING)
def test_options_that_differ_across_ranks_fail_at_init_on_every_rank(case):
    """Options outside the call signature changed who sends what to whom on some ranks only:
    wrong sums or a misleading error at c908507. Now each rank names them at init."""
    env_per_rank, needles = DIFFERING[case]
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_first_allreduce, 3, env_per_rank=env_per_rank, pg_timeout_s=30)
    text = str(failed.value)
    errors = [line for line in text.splitlines() if line.startswith("ValueError: hca: the options must be the same")]
    assert len(errors) == 3, text
    for needle in needles:
        assert all(needle in line for line in errors), (needle, errors)
    assert time.monotonic() - start < 20


def test_pg_options_win_over_a_rank_s_own_environment():
    env_per_rank = [{"TORCH_HCA_NUM_PACKS": "3"}, {}]
    got = run_ranks(_first_allreduce, 2, env_per_rank=env_per_rank, pg_options=torch_hca.Options(num_packs=3))
    assert got == [[2.0] * 10] * 2


def pin_rank_0_to_one_cpu(rank):
    if rank == 0:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def allreduce_around_the_pack_thresholds(rank, world):
    errors = []
    for case, numel in enumerate([4095, 4096, 16 << 10, (16 << 20) // 4]):
        inputs = [make_input(case, r, numel, torch.float32, "SUM") for r in range(world)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errors.append(mismatch(f"allreduce x{numel}", t, reduce_reference(inputs, "SUM"), world))
    return [e for e in errors if e]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to give the ranks different counts")
def test_ranks_with_different_cpus_choose_the_same_packs():
    """Rank 0 may run on 1 CPU, rank 1 on 2: chosen from one rank's CPUs, 64 KiB would be one pack
    on rank 0 and two on rank 1; chosen from the CPUs of all, every rank agrees."""
    assert run_ranks(allreduce_around_the_pack_thresholds, 2, before_init=pin_rank_0_to_one_cpu) == [[], []]
