"""veragged: structure-aware FSDP for PyTorch (RaggedShard, planner, DBuffer, optimizers)."""

import logging

import torch  # noqa: F401  (loads libtorch before the extension that links it)

# A library logs, the application decides what is shown: silent unless configured
# (veragged/fsdp/log.py says what each level reports).
logging.getLogger("veragged").addHandler(logging.NullHandler())

from veragged import (
    _C,  # noqa: F401  (registers torch.ops.veragged.*)
    dbuffer,  # noqa: F401  (fake kernels of the group ops)
)
from veragged.fsdp import FSDPModule, clip_grad_norm_, fully_shard
from veragged.placement import (
    RaggedDTensor,
    RaggedShard,
    RedistributeHandle,
    RoutedDTensor,
    StridedRaggedShard,
    distribute_tensor,
    from_local,
    local_numel_and_offset,
    redistribute,
)
from veragged.planner import Layout, plan
from veragged.quant import BlockFP8, MXFP8
from veragged.checkpoint.torch_entry_points import (
    TorchEntryPointRouting,
    route_torch_entry_points,
    torch_entry_points_routed,
    unroute_torch_entry_points,
)

# `veragged.DTensor.from_local(...)` reads like torch's and also accepts RaggedShard placements.
DTensor = RaggedDTensor

__all__ = [
    "BlockFP8",
    "DTensor",
    "FSDPModule",
    "clip_grad_norm_",
    "fully_shard",
    "Layout",
    "RaggedDTensor",
    "RaggedShard",
    "RedistributeHandle",
    "RoutedDTensor",
    "StridedRaggedShard",
    "distribute_tensor",
    "from_local",
    "local_numel_and_offset",
    "MXFP8",
    "plan",
    "redistribute",
    "route_torch_entry_points",
    "torch_entry_points_routed",
    "TorchEntryPointRouting",
    "unroute_torch_entry_points",
]
__version__ = "0.1.0"
from veragged import optim  # noqa: E402  (veragged.optim.Muon, veragged.optim.AdamW8bit)
