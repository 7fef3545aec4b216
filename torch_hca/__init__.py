"""torch_hca: TensorFlow's hierarchical-copy cross-device reductions as the c10d backend "hca".

    import torch_hca, torch.distributed as dist
    dist.init_process_group("hca", pg_options=torch_hca.Options(num_packs=2))
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from .build_check import check_built_torch

check_built_torch()  # before the extension loads: another torch's build names both versions

from . import _C  # noqa: F401,E402
from .backend import BACKEND_NAME, create_backend, node_identity, register
from .collectives import batch_allreduce, monitored_barrier
from .cross_device_ops import (AllReduceCrossDeviceOps, CommunicationOptions, HierarchicalCopyAllReduce, ReduceOp,
                               ReductionToOneDevice)
from .explain import NodePlan, Plan, explain
from .options import Options
from .topology import hierarchy
from .version import __version__

register()

__all__ = [
    "__version__",
    "BACKEND_NAME", "Options", "Plan", "NodePlan", "explain", "hierarchy", "batch_allreduce", "monitored_barrier", "create_backend", "node_identity",
    "AllReduceCrossDeviceOps", "HierarchicalCopyAllReduce", "ReductionToOneDevice", "CommunicationOptions", "ReduceOp",
]
