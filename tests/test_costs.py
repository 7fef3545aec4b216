"""The cost model that chooses an all-reduce's algorithm and num_packs per call (torch_hca.costs): its lines and the choice they
make, the shipped table, a calibration cached per machine and world shape, and rank 0's model
used by every rank whatever the others have cached or asked for."""
import datetime
import functools
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import torch_hca
from torch_hca import costs, links
from harness import STREAMS_ENV, RankFailed, run_ranks
from reference import make_input, mismatch, reduce_reference
from test_topology import on_gpus


def test_a_fit_recovers_the_line_through_its_points():
    line = costs.fit([(b, 20 + b / 1500) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)])
    assert line.fixed_us == pytest.approx(20) and line.bytes_per_us == pytest.approx(1500)


def model_of(one_pack, pack_per_rank, reduce_to_one_device=(1e9, 1), direct=(1e9, 1), origin="test"):
    """A model from (fixed µs, bytes per µs) per candidate (reduce_to_one_device, direct: never ahead)."""
    lines = zip(costs.CANDIDATES, (one_pack, pack_per_rank, reduce_to_one_device, direct))
    return costs.CostModel({name: costs.Line(*line) for name, line in lines}, origin)


HIERARCHICAL = ("one_pack", "pack_per_rank")


@pytest.mark.parametrize("one_pack, per_rank, expect", [
    ((30, 1000), (40, 3000), "crossover"),  # dearer to start, faster per byte: from some size
    ((30, 1000), (20, 3000), [(0, "pack_per_rank")]),  # ahead everywhere
    ((30, 3000), (40, 1000), [(0, "one_pack")]),       # behind everywhere
    ((30, 3000), (10, 1000), "small only"),            # ahead for small calls only
])
def test_a_pack_per_rank_is_chosen_where_it_is_predicted_faster_by_the_margin(one_pack, per_rank, expect):
    model = model_of(one_pack, per_rank)

    def ahead(nbytes):
        t = model.predict_us(nbytes)
        return t["pack_per_rank"] <= costs.MARGIN * t["one_pack"]

    table = model.by_size(HIERARCHICAL)
    if expect == "crossover":
        [(_, first), (start, second)] = table
        assert (first, second) == ("one_pack", "pack_per_rank") and ahead(start) and not ahead(start - 1), table
    elif expect == "small only":
        [(_, first), (start, second)] = table
        assert (first, second) == ("pack_per_rank", "one_pack") and ahead(start - 1) and not ahead(start), table
    else:
        assert table == expect


def choice_at(table, nbytes):
    return [name for start, name in table if start <= nbytes][-1]


@pytest.mark.parametrize("seed", range(6))
def test_the_table_by_size_is_the_per_call_rule_at_every_size(seed):
    """Four candidates whose lines cross anywhere: the table the plan reads gives, at every size
    around each crossing and on a grid from 1 B to 1 GiB, what the rule gives for that size (the
    fastest of those 3% ahead of one pack, else one pack)."""
    rng = torch.Generator().manual_seed(seed)
    lines = [(float(torch.rand(1, generator=rng)) * 300, float(torch.rand(1, generator=rng)) * 4000 + 200)
             for _ in costs.CANDIDATES]
    model = model_of(*lines)
    for names in (tuple(costs.CANDIDATES), HIERARCHICAL):
        table = model.by_size(names)
        assert table[0][0] == 0 and all(a[0] < b[0] and a[1] != b[1] for a, b in zip(table, table[1:])), table
        edges = [int(x) for start, _ in table for x in (start - 1, start, start + 1) if x > 0]
        for nbytes in edges + [int(1.3 ** k) for k in range(80)]:
            assert choice_at(table, nbytes) == model.choose(nbytes, names), (lines, names, nbytes, table)


@pytest.mark.parametrize("world, cpus", [(2, 2), (3, 2), (4, 2), (4, 8), (8, 2)])
def test_explain_shows_each_candidates_predicted_time_and_the_choice(world, cpus):
    model = costs.shipped(world, cpus)
    table = model.by_size()
    sizes = {4, 1 << 20, 64 << 20} | {b for start, _ in table[1:] for b in (start - 4, start)}
    for nbytes in sorted(sizes):
        plan = torch_hca.explain(world, numels=[nbytes // 4], cpus=cpus)
        want = model.predict_us(nbytes // 4 * 4)
        assert plan.predicted_us == pytest.approx(want), (nbytes, plan.predicted_us, want)
        chosen = choice_at(table, nbytes // 4 * 4)
        assert plan.chosen == chosen, (nbytes, plan.text)
        # The plan is the chosen candidate's, as if the user had fixed it.
        algorithm, per_rank = costs.CANDIDATES[chosen]
        fixed = torch_hca.explain(world, algorithm, world if per_rank else 1, numels=[nbytes // 4], cpus=cpus)
        assert plan.packs == fixed.packs and len(plan.packs) == (min(world, nbytes // 4) if per_rank else 1), plan.text
        assert "predicted: " + ", ".join(f"{costs.WORDS[n]} {t:.1f} us" for n, t in want.items()) in plan.text
        assert model.origin in plan.text


def test_the_shipped_table_gives_what_its_machine_measured():
    """2 ranks with a CPU each: a pack per rank from a few KiB (measured ahead from 16 KiB on, and
    level at 4 KiB), direct never ahead of one pack for small calls; 3 and 4 ranks taking turns on
    2 CPUs: direct for small calls (measured up to 20% faster than one pack from 16 B to 16 KiB on
    3 ranks, and from 16 B to 1 KiB on 4), then one pack, then a pack per rank (measured ahead from
    64 KiB on 3 ranks, from 1 MiB on 4); reduce_to_one_device never 3% ahead of one pack for long."""
    table = costs.shipped(2, 2).by_size()
    assert [name for _, name in table] == ["one_pack", "pack_per_rank"] and 1 << 10 < table[1][0] < 16 << 10, table
    for world, direct_to, per_rank_from in [(3, (4 << 10, 64 << 10), (16 << 10, 256 << 10)),
                                            (4, (1 << 10, 64 << 10), (64 << 10, 1 << 20))]:
        table = costs.shipped(world, 2).by_size()
        assert [name for _, name in table] == ["direct", "one_pack", "pack_per_rank"], table
        assert direct_to[0] < table[1][0] < direct_to[1] and per_rank_from[0] < table[2][0] < per_rank_from[1], table
    assert "shipped table (2 ranks" in costs.shipped(8, 16).origin  # a CPU each: the 2-rank lines
    with pytest.raises(ValueError, match="TORCH_HCA_CALIBRATE"):
        costs.calibrate_mode({"TORCH_HCA_CALIBRATE": "yes"})


def _model_in_use(rank, world):
    """The model this rank's group uses, how many packs it gives 1000 floats, and an all-reduce's
    result checked against the float64 reference."""
    model = torch_hca.hierarchy()["cost_model"]["cpu"]
    inputs = [make_input(7, r, 1000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    packs = len(torch_hca.explain(numels=[1000], group=dist.group.WORLD).packs)
    return model.origin, packs, mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), world)


def test_a_calibration_is_cached_and_rank_0s_model_is_everyones(tmp_path):
    mine, theirs = tmp_path / "rank0", tmp_path / "rank1"
    env = {**os.environ, "TORCH_HCA_CACHE_DIR": str(mine)}
    out = subprocess.run([sys.executable, "-m", "torch_hca.calibrate", "--world-size", "2"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [cached] = mine.glob("costs-2ranks-*.json")
    assert "calibrated on this machine" in out.stdout and str(cached) in out.stdout, out.stdout
    assert ("taking turns" in out.stderr) == (len(os.sched_getaffinity(0)) < 2), out.stderr
    points = json.loads(cached.read_text())["points"]
    for name in costs.CANDIDATES:
        assert [b for b, _ in points[name]] == list(costs.CALIBRATION_BYTES)
        assert all(us > 0 for _, us in points[name]), points
    # Rank 0's cache says a pack per rank always, rank 1's never; rank 1 also asks to calibrate.
    record = json.loads(cached.read_text())
    record["model"] = model_of((100, 100), (0, 1e6), origin="rank 0's cache").to_json()
    cached.write_text(json.dumps(record))
    theirs.mkdir()
    record["model"] = model_of((0, 1e6), (100, 100), (0, 1e6), origin="rank 1's cache").to_json()
    (theirs / cached.name).write_text(json.dumps(record))
    before = (theirs / cached.name).read_text()
    results = run_ranks(_model_in_use, 2, env_per_rank=[
        {"TORCH_HCA_CACHE_DIR": str(mine)}, {"TORCH_HCA_CACHE_DIR": str(theirs), "TORCH_HCA_CALIBRATE": "force"}])
    assert results == [("rank 0's cache", 2, None)] * 2, results
    assert (theirs / cached.name).read_text() == before  # rank 1 measured nothing


def _nothing(rank, world):
    return None


def test_a_calibration_of_ranks_taking_turns_on_a_cpu_warns_that_it_varies(tmp_path):
    """Two ranks pinned to one CPU: the calibration is cached, and its warning names the file
    that deleting goes back to the shipped table."""
    cpu = min(os.sched_getaffinity(0))
    env = {**os.environ, "TORCH_HCA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "torch_hca.calibrate", "--world-size", "2"], env=env,
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert out.returncode == 0, out.stderr
    [cached] = tmp_path.glob("costs-2ranks-1cpus-*.json")
    assert "timed 2 ranks taking turns on 1 CPU," in out.stderr and f"deleting {cached} goes back" in out.stderr, \
        out.stderr


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_calibrations_barrier_lets_no_rank_through_before_all_arrive(world):
    """Threads as ranks on one store, arriving in a shuffled order at each of 6 barriers: none leaves
    barrier k before the last has arrived at it, and the store holds one key for them all."""
    import threading

    store = dist.HashStore()
    arrived, left = [[0.0] * world for _ in range(6)], [[0.0] * world for _ in range(6)]
    delays = torch.rand(6, world, generator=torch.Generator().manual_seed(world)) * 0.02

    def rank(r):
        barrier = costs.counting_barrier(store.add, world, timeout_s=30)
        for k in range(6):
            time.sleep(float(delays[k, r]))
            arrived[k][r] = time.monotonic()
            barrier()
            left[k][r] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k in range(6):
        assert min(left[k]) >= max(arrived[k]) > 0, (k, arrived[k], left[k])
    assert store.num_keys() == 1 and store.add("hca_costs_barrier", 0) == 6 * world


def test_the_calibrations_barrier_names_a_missing_rank_within_its_timeout():
    barrier = costs.counting_barrier(dist.HashStore().add, 2, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not reach the calibration's barrier #1 within 0.5 s"):
        barrier()
    assert 0.5 <= time.monotonic() - start < 5


def test_a_wrong_calibrate_value_on_rank_0_fails_every_rank_at_init():
    """Only rank 0's variable counts: the others raise its error at once instead of waiting for it."""
    with pytest.raises(RankFailed) as failed:
        run_ranks(_nothing, 2, env_per_rank=[{"TORCH_HCA_CALIBRATE": "yes"}, {}], pg_timeout_s=600, deadline_s=60)
    assert str(failed.value).count("ValueError: hca: rank 0's TORCH_HCA_CALIBRATE='yes'") == 2, failed.value


def test_cuda_tensors_of_ranks_sharing_one_gpu_get_its_table():
    """Ranks sharing one H200 measured: one pack as fast as the rest on 2 and 3 ranks (a tie keeps it),
    reduce_to_one_device 11-38% faster on 4 (two steps, where one pack's hierarchy takes four), and
    more ranks take the 4-rank table. One rank: no table."""
    for world, want in [(2, "one_pack"), (3, "one_pack"), (4, "reduce_to_one_device"), (6, "reduce_to_one_device")]:
        model = costs.sharing_one_gpu(world)
        assert [name for _, name in model.by_size()] == [want], (world, model.by_size())
        assert f"{min(world, 4)} ranks sharing one NVIDIA H200" in model.origin
    assert costs.sharing_one_gpu(1) is None


@pytest.mark.parametrize("kind", ["nvlink", "pcie"])
def test_the_link_model_of_a_gpu_per_rank_crosses_from_one_shot_to_two_shot(kind):
    """One clique of GPUs: direct (one step) wins small all-reduces, a pack per rank (two steps of
    1/N each) large ones, from a size that falls with the ranks and with slower links, as vLLM's
    measured crossovers do; at 2 ranks direct always wins (two-shot moves as much in two steps).
    Where the lines come from is said: predicted."""
    crossovers = {}
    for world in (2, 3, 4, 8):
        model = links.clique_cost_model(kind, world, 8 << 20)
        table = model.by_size()
        assert "predicted, not measured" in model.origin and table[0] == (0, "direct"), table
        if world == 2:
            assert table == [(0, "direct")], table
            continue
        assert [name for _, name in table] == ["direct", "pack_per_rank"], table
        crossovers[world] = table[1][0]
    assert crossovers[3] > crossovers[4] > crossovers[8], crossovers
    if kind == "nvlink":
        assert 128 << 10 < crossovers[8] < 1 << 20, crossovers  # vLLM: two-shot from 256 KB at 8 H100s
    else:
        assert crossovers[8] < links.clique_cost_model("nvlink", 8, 8 << 20).by_size()[1][0]
    direct, two_shot = (links.LinkModel(kind, 8, 8 << 20).predict_us(64 << 20, n) for n in ("direct", "pack_per_rank"))
    port = links.PORT_BYTES_PER_US[kind]
    assert 2 * 7 / 8 * (64 << 20) / port < two_shot < direct, (two_shot, direct)  # at least the links' time


def _cuda_choice(group):
    """A group's CUDA tensors as hierarchy() and explain tell them (a 1 MiB all-reduce), and the
    table its C++ group plans them with."""
    backend = group._get_backend(torch.device("cpu"))
    model = torch_hca.hierarchy(group)["cost_model"]["cuda"]
    plan = torch_hca.explain(numels=[1 << 18], group=group, device="cuda")
    return {"cuda": model and model.origin, "cuda_by_size": backend.by_size(cuda=True), "chosen": plan.chosen,
            # explain shows the group's own hierarchy (found at init), not its groups as if given
            "its_hierarchy": plan.hierarchy == torch_hca.hierarchy(group)["cuda"]}


def _choices_per_device(rank, world, gpus):
    """For the world group (defaults), a group with num_packs fixed, and a child split off over all
    ranks but the last: each one's CUDA choice before and after its first CUDA collective asked
    where every rank's tensors are (this rank's: GPU gpus[rank]; no GPU needed), after rank 0 alone
    asks again as if on the last rank's GPU, and its CPU table."""
    out = {}
    fixed = dist.new_group(backend="hca", pg_options=torch_hca.Options(num_packs=1))
    parent = dist.new_group(backend="hca")
    child = parent.split_group(list(range(world - 1)), timeout=datetime.timedelta(seconds=30),
                               group_name="child") if world > 1 else None
    for name, group in (("world", dist.group.WORLD), ("fixed", fixed), ("child", child)):
        if group is None:
            continue
        before = _cuda_choice(group)
        backend = group._get_backend(torch.device("cpu"))
        backend._settle_cuda_choice(gpus[rank])
        after = _cuda_choice(group)
        if rank == 0:  # asked once per group: a second question, on one rank, changes nothing
            backend._settle_cuda_choice(gpus[-1])
        cpu_model = torch_hca.hierarchy(group)["cost_model"]["cpu"]
        out[name] = {"before": before, "after": after, "again": backend.by_size(cuda=True),
                     "cpu_by_size": backend.by_size(cuda=False),
                     "cpu_model": cpu_model and cpu_model.origin}
    inputs = [make_input(3, r, 1000, torch.float32, "SUM") for r in range(world)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    out["wrong"] = mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), world)
    return out


GPU_LAYOUTS = {"shared": lambda world: ["GPU-0"] * world, "a GPU each": lambda world: [f"GPU-{r}" for r in range(world)],
               "the last apart": lambda world: ["GPU-0"] * (world - 1) + ["GPU-1"]}


def _cpu_table(world):
    """What a group of `world` of the test's ranks should plan CPU tensors with (no calibration is
    cached here), and its model's origin."""
    model = costs.shipped(world, len(os.sched_getaffinity(0))) if world > 1 else None
    return (costs.plan_choices(model, tuple(costs.CANDIDATES)) if model else []), model and model.origin


def _table(gpus, clique):
    """What a group of ranks on `gpus` should plan CUDA tensors with, and its model's origin: where
    `clique` (the ranks found a GPU each at init, all NVLink peers), the link model's for ranks on a
    GPU each."""
    model = costs.sharing_one_gpu(len(gpus)) if len(set(gpus)) == 1 else None
    if clique and len(set(gpus)) == len(gpus) > 1:
        model = links.clique_cost_model("nvlink", len(gpus), 8 << 20)
    return (costs.plan_choices(model, tuple(costs.CANDIDATES)) if model else []), model


@pytest.mark.parametrize("world, layout, clique", [
    (4, "shared", False), (3, "shared", False), (4, "a GPU each", False), (3, "the last apart", False),
    (2, "shared", False), (2, "a GPU each", False), (1, "shared", False),
    (4, "a GPU each", True), (3, "shared", True), (3, "the last apart", True)])
def test_a_group_whose_ranks_tensors_share_a_gpu_plans_them_by_its_table(world, layout, clique):
    """Until its first CUDA collective a group plans CUDA tensors with one pack; there every rank
    says where its tensors are (made-up GPUs here), and where all are on one GPU the C++ group takes
    the table of as many ranks sharing one, the same on every rank; CPU tensors keep their own;
    fixed options choose nothing; a child split off asks for itself and takes its own size's table
    (4 ranks: reduce_to_one_device; the child of 3: one pack), also where its parent found none.
    The child's CPU tensors too take its own size's table, not its parent's (on 2 CPUs, 4 and 3
    ranks taking turns differ from 2 with a CPU each). Where the ranks found at init a GPU each,
    all NVLink peers (`clique`), tensors on a GPU each take the link model's table, the child's of
    its own size; tensors that turn out on one GPU, that GPU's; any other layout none."""
    gpus = GPU_LAYOUTS[layout](world)
    # Where `clique`, each rank finds at init a GPU of its own, NVLink to every other rank's.
    setup = functools.partial(on_gpus, [f"gpu{r}" for r in range(world)]) if clique else None
    results = run_ranks(_choices_per_device, world, gpus, before_init=setup)
    none = {"cuda": None, "cuda_by_size": [], "chosen": None, "its_hierarchy": True}
    for out in results[:-1]:  # the last rank is outside the child
        assert out == results[0], out
    for rank, out in enumerate(results):
        assert ("child" in out) == (rank < world - 1), out
        assert {k: v for k, v in out.items() if k != "child"} == {k: v for k, v in results[0].items() if k != "child"}
        assert out["wrong"] is None, out
    for name, ranks in (("world", world), ("child", world - 1)):
        if ranks < 1:
            continue
        got = results[0][name]
        assert (got["cpu_by_size"], got["cpu_model"]) == _cpu_table(ranks), (name, got)
        if ranks < 2:
            continue
        want, model = _table(gpus[:ranks], clique)
        assert got["before"] == none, got
        assert got["after"]["cuda_by_size"] == want and got["after"]["cuda"] == (model and model.origin), got
        assert got["after"]["chosen"] == (model and model.choose(1 << 20)) and got["after"]["its_hierarchy"], got
        assert got["again"] == want, got
    assert results[0]["fixed"] == {"before": none, "after": none, "again": [], "cpu_by_size": [], "cpu_model": None}, \
        results[0]["fixed"]


def _pin(cpus_of_ranks, rank):
    os.sched_setaffinity(0, cpus_of_ranks[rank])


def _children_tables(rank, world):
    """The CPU table and its origin of the world group and of the two 2-rank children split off it,
    ranks 0 and 1 and ranks 1 and 2 (each rank asks for the children it is in), and an all-reduce
    of each child checked."""
    out = {}
    for name, ranks in (("world", [0, 1, 2]), ("0 and 1", [0, 1]), ("1 and 2", [1, 2])):
        group = dist.group.WORLD if name == "world" else dist.new_subgroups_by_enumeration(
            [ranks, [r for r in range(world) if r not in ranks]], backend="hca")[0]
        if rank not in ranks:
            continue
        model = torch_hca.hierarchy(group)["cost_model"]["cpu"]
        out[name] = (group._get_backend(torch.device("cpu")).by_size(cuda=False), model and model.origin)
    return out


def _split_children_tables(rank, world):
    """The same, the children split off the world group (split_group), which counts their CPUs from
    what the ranks reported at the world group's init."""
    out = {}
    parent = dist.new_group(backend="hca")
    for name, ranks in (("0 and 1", [0, 1]), ("1 and 2", [1, 2])):
        child = parent.split_group(ranks, timeout=datetime.timedelta(seconds=30), group_name=name)
        if child is None:
            continue
        model = torch_hca.hierarchy(child)["cost_model"]["cpu"]
        out[name] = (child._get_backend(torch.device("cpu")).by_size(cuda=False), model and model.origin)
        inputs = [make_input(5, r, 3000, torch.float32, "SUM") for r in range(2)]
        t = inputs[ranks.index(rank)].clone()
        dist.all_reduce(t, group=child)
        out[name + " wrong"] = mismatch("all_reduce", t, reduce_reference(inputs, "SUM"), 2)
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPUs to pin ranks on")
def test_a_child_split_off_counts_its_own_ranks_cpus():
    """Ranks 0 and 1 pinned to one CPU, rank 2 to another: the world group's 3 ranks and the child
    of ranks 0 and 1 take turns on fewer CPUs than ranks (the shipped 3-rank table), the child of
    ranks 1 and 2 has a CPU each (the 2-rank table), as fresh groups of the same ranks do. On the
    code before, both children took the 2-rank table: the parent's count of CPUs, 2."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    pinned = [{first}, {first}, {second}]

    def table(size, cpus):
        model = costs.shipped(size, cpus)
        return costs.plan_choices(model, tuple(costs.CANDIDATES)), model.origin

    want = {"world": table(3, 2), "0 and 1": table(2, 1), "1 and 2": table(2, 2)}
    assert want["0 and 1"] != want["1 and 2"]
    fresh = run_ranks(_children_tables, 3, before_init=functools.partial(_pin, pinned))
    split = run_ranks(_split_children_tables, 3, before_init=functools.partial(_pin, pinned))
    for rank in range(3):
        mine = {name: value for name, value in want.items() if name == "world" or str(rank) in name}
        assert fresh[rank] == mine, (rank, fresh[rank])
        assert {k: v for k, v in split[rank].items() if "wrong" not in k} == \
            {k: v for k, v in mine.items() if k != "world"}, (rank, split[rank])
        assert all(v is None for k, v in split[rank].items() if "wrong" in k), split[rank]


def _one_rank_never_asks(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if rank == 1:
        time.sleep(4)  # alive, but never at the collective
        return None
    started = time.monotonic()
    try:
        backend._settle_cuda_choice("GPU-0")
    except RuntimeError as e:  # DistBackendError through torch's own bindings
        return str(e), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_rank_missing_from_the_first_cuda_collective_fails_it_within_the_timeout():
    message, seconds = run_ranks(_one_rank_never_asks, 2, pg_timeout_s=1)[0]
    assert "first collective on CUDA tensors asks each rank which GPU its tensors are on" in message, message
    assert "rank 1 did not report" in message and 0.9 < seconds < 3.5, (message, seconds)


def _one_rank_dies_before_it_asks(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    dist.barrier()
    if rank == world - 1:
        os._exit(0)  # without a word, as a crashed rank
    started = time.monotonic()
    try:
        backend._settle_cuda_choice("GPU-0")
    except RuntimeError as e:
        return str(e), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_rank_that_died_fails_the_first_cuda_collective_at_once():
    """Not at the timeout (60 s): the wait watches the peers as a collective's does."""
    results = run_ranks(_one_rank_dies_before_it_asks, 3, pg_timeout_s=60, allow_missing=(2,))
    for message, seconds in results[:2]:
        assert "first collective on CUDA tensors asks each rank" in message and "rank 2" in message, message
        assert seconds < 10, (message, seconds)


def _one_rank_calls_on_cpu_tensors(rank, world):
    """Rank 1's next collective is on CPU tensors where rank 0's (asking where its CUDA tensors are) is
    not: both learn it at once, not at the timeout (60 s), and the group is unusable after."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    dist.all_reduce(torch.ones(4))  # one collective before, on both ranks: the count is per group
    started = time.monotonic()
    try:
        if rank == 0:
            backend._settle_cuda_choice("GPU-0")
        else:
            dist.all_reduce(torch.ones(1000))
    except RuntimeError as e:
        return str(e), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_rank_in_another_call_than_the_first_cuda_collective_fails_both_at_once():
    (asking, asking_s), (other, other_s) = run_ranks(_one_rank_calls_on_cpu_tensors, 2, pg_timeout_s=60)
    assert "mismatched calls: rank 0's next collective is on CUDA tensors, but rank 1 called allreduce(Float[1000]" \
        in asking and asking_s < 10, (asking, asking_s)
    assert "mismatched calls" in other and other_s < 10, (other, other_s)


def _asks_after_async_calls(rank, world):
    """On the model of the device, whose first collective runs the self-test's collectives first:
    async all-reduces queued before the question, on every rank alike, are no mismatch, even where
    a peer's executor has started them all before it asks."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    inputs = [[make_input(60 + i, r, 70_001, torch.float32, "SUM") for r in range(world)] for i in range(4)]
    mine = [case[rank].clone() for case in inputs]
    works = [dist.all_reduce(t, async_op=True) for t in mine]
    if rank == world - 1:
        time.sleep(1)  # its worker starts them all meanwhile: the others see it ahead, not yet asking
    backend._settle_cuda_choice("GPU-0")
    for w in works:
        w.wait()
    errors = [mismatch(f"all_reduce {i}", t, reduce_reference(inputs[i], "SUM"), world) for i, t in enumerate(mine)]
    return backend.by_size(cuda=True), [e for e in errors if e]


@pytest.mark.parametrize("world", [2, 3])
def test_calls_queued_before_the_question_are_no_mismatch(world):
    want = costs.plan_choices(costs.sharing_one_gpu(world), tuple(costs.CANDIDATES))
    for by_size, errors in run_ranks(_asks_after_async_calls, world, env=STREAMS_ENV):
        assert by_size == want and not errors, (by_size, errors)


def _asks_after_the_end(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend.shutdown()  # what destroy_process_group calls
    started = time.monotonic()
    backend._settle_cuda_choice("GPU-0")  # nothing to ask of a group that ended: the call itself raises
    return backend.by_size(cuda=True), time.monotonic() - started


def test_a_group_that_ended_asks_nothing():
    for by_size, seconds in run_ranks(_asks_after_the_end, 2, pg_timeout_s=60):
        assert by_size == [] and seconds < 1, (by_size, seconds)


@pytest.mark.parametrize("tables", ["cuda_tables_sharing_one_gpu", "cuda_tables_gpu_per_rank"])
def test_a_cuda_table_that_does_not_start_at_0_bytes_is_refused(tables):
    with pytest.raises(ValueError, match="must start at 0 bytes"):
        torch_hca._C.ProcessGroupHCA(store=dist.HashStore(), rank=0, size=2, timeout_ms=1000,
                                     options=torch_hca.Options().plan_options(), shm_slot_bytes=1 << 20, shm_slots=2,
                                     cuda_slot_bytes=0, cuda_slots=2, **{tables: {2: ([(8, "direct", False)], "null")}})
