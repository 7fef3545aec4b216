"""How an all-reduce of CUDA tensors runs where every rank has a GPU of its own and every GPU reaches
every other (one clique: an NVSwitch node, or one PCIe switch with P2P): a model of the links,
**predicted, not measured** (no such machine has run hca yet).

Each candidate's plan, as the C++ planner makes it for the call, is walked round by round and step
by step. A step costs STEP_US (a kernel that starts after a peer's flag) plus the bytes through the
busiest GPU's port (the larger of what it reads and what it writes) over the port's bandwidth; each
round copies every rank's piece into its staging and the result back out at HBM speed; a call costs
CALL_US more. On one clique of N GPUs this makes `direct` (one-shot: one step, every rank reads all
N-1 peers) the fastest for small calls and a pack per rank with one group (two-shot: each rank sums
1/N from every peer, then every rank copies each share) for large, as vLLM and SymmetricMemory
choose. The sources of the numbers are in docs/cuda.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict

from . import _C
from .costs import CANDIDATES, CostModel, fit
from .options import Options

# Per GPU, each way. NVLink: ~370 GB/s measured one way on H100's NVLink4 (450 GB/s spec), nccl-tests.
# PCIe: 4.0 x16 is 31.5 GB/s each way by the spec; 25 GB/s assumes about 80% of it after packet overhead.
PORT_BYTES_PER_US = {"nvlink": 370e3, "pcie": 25e3}
STEP_US = 5.0  # a peer's flag seen (~2 us for a P2P write) and a kernel launched behind a stream wait (~3 us)
CALL_US = 5.0  # the host's issue of a call and its copy-in and copy-out kernels
HBM_BYTES_PER_US = 3.0e6  # an H100 device copy, bytes read plus written
SIZES = tuple(4 << (2 * i) for i in range(14))  # 4 B to 256 MiB, where the lines are fitted


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """The links of `world` GPUs in one clique over `kind` ("nvlink" or "pcie"), staging in slots
    of `slot_bytes`."""

    kind: str
    world: int
    slot_bytes: int

    def __post_init__(self):
        if self.kind not in PORT_BYTES_PER_US:
            raise ValueError(f"link kind: expected one of {', '.join(PORT_BYTES_PER_US)}, got {self.kind!r}")

    def predict_us(self, nbytes: int, candidate: str) -> float:
        """The time of an all-reduce of `nbytes` (float32) run as `candidate` (one of costs.CANDIDATES)."""
        algorithm, per_rank = CANDIDATES[candidate]
        everyone = [list(range(self.world))]
        options = Options(algorithm, self.world if per_rank else 1, None, everyone).plan_options(everyone, ())
        packs, _, _, rounds = _C.plan("allreduce", self.world, [max(1, nbytes // 4)], options, 0, self.slot_bytes)
        port = PORT_BYTES_PER_US[self.kind]
        total = CALL_US
        for pieces in rounds:
            staged = 4 * sum(count for _, _, count, _ in pieces)
            total += 4 * staged / HBM_BYTES_PER_US  # copy-in and copy-out, each read and written
            for step in range(max(len(packs[p]["steps"]) for p, _, _, _ in pieces)):
                into, out_of = [0] * self.world, [0] * self.world
                for p, _, count, _ in pieces:
                    for _, src, dst in packs[p]["steps"][step] if step < len(packs[p]["steps"]) else ():
                        into[dst] += 4 * count
                        out_of[src] += 4 * count
                total += STEP_US + max(into + out_of) / port
        return total

    def cost_model(self) -> CostModel:
        """The candidates' lines, fitted through the predicted times at SIZES."""
        points: Dict[str, list] = {n: [(b, self.predict_us(b, n)) for b in SIZES] for n in CANDIDATES}
        return CostModel({n: fit(p) for n, p in points.items()},
                         f"the link model of {self.world} GPUs, each a peer of every other over {self.kind} "
                         "(predicted, not measured)")


@functools.lru_cache(maxsize=None)
def clique_cost_model(kind: str, world: int, slot_bytes: int) -> CostModel:
    """LinkModel(kind, world, slot_bytes)'s cost model, made once per process."""
    return LinkModel(kind, world, slot_bytes).cost_model()
