"""RaggedShard DTensor placements: semantics, creation, redistribution and ops.

See [Note: RaggedShard semantics] (ragged_shard.py), [Note: ragged layout on an N-D mesh]
(layout.py), [Note: ops on RaggedShard DTensors] (ops.py) and, for how the modules stack,
[Note: placement layers] (tensor.py).
"""

import torch

from veragged.placement import ops, tensor
from veragged.placement.api import distribute_tensor, from_local, local_numel_and_offset
from veragged.placement.layout import normalize_placements
from veragged.placement.ragged_shard import RaggedShard, StridedRaggedShard
from veragged.placement.redistribute import RedistributeHandle, redistribute
from veragged.placement.tensor import RaggedDTensor, RoutedDTensor

# The class calls the layers above it through this ([Note: placement layers], tensor.py).
tensor.connect_layers(
    torch_function=ops.handle_torch_function,
    torch_dispatch=ops.handle_torch_dispatch,
    redistribute=redistribute,
    from_local=from_local,
)

# `torch.load(weights_only=True)` of what torch.save wrote of these ([Note: a RaggedDTensor has no
# storage]), as torch registers its DTensor classes.
torch.serialization.add_safe_globals(
    [RaggedDTensor, RoutedDTensor, RaggedShard, StridedRaggedShard]
)

__all__ = [
    "RaggedDTensor",
    "RaggedShard",
    "RoutedDTensor",
    "RedistributeHandle",
    "StridedRaggedShard",
    "distribute_tensor",
    "from_local",
    "local_numel_and_offset",
    "normalize_placements",
    "redistribute",
]
