"""Options and their environment variables, including random (fuzzed) values."""
import random

import pytest

import torch_hca
from torch_hca.options import Options, cuda_slots, shm_chunk_bytes, shm_slots


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
                torch_hca.explain(world, opts.algorithm, opts.num_packs % 50, opts.groups, opts.reduce_to_device)
            except ValueError:
                pass
    assert outcomes["ok"] > 100 and outcomes["ValueError"] > 100


def test_chunk_bytes_env():
    assert shm_chunk_bytes({}) == 128 << 10
    assert shm_chunk_bytes({"TORCH_HCA_SHM_CHUNK_BYTES": "65536"}) == 65536
    for bad in ("12", "big"):
        with pytest.raises(ValueError, match="TORCH_HCA_SHM_CHUNK_BYTES"):
            shm_chunk_bytes({"TORCH_HCA_SHM_CHUNK_BYTES": bad})


@pytest.mark.parametrize("reader, name", [(shm_slots, "TORCH_HCA_SHM_SLOTS"), (cuda_slots, "TORCH_HCA_CUDA_SLOTS")])
def test_slot_counts_beyond_the_bound_name_the_variable(reader, name):
    # Counts that would not fit the extension's int (pybind's unreadable TypeError before).
    assert reader({name: "65536"}) == 65536
    for bad in (str(2**31), str(2**40), "65537", "1"):
        with pytest.raises(ValueError, match=f"{name}=.*between 2 and 65536"):
            reader({name: bad})
