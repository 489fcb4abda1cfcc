"""RaggedShard DTensor placements: semantics, creation, redistribution and ops.

See [Note: RaggedShard semantics] (ragged_shard.py), [Note: ragged layout on an N-D mesh]
(layout.py) and [Note: ops on RaggedShard DTensors] (ops.py).
"""

from veragged.placement.api import distribute_tensor, from_local, local_numel_and_offset
from veragged.placement.dtensor import RaggedDTensor, RoutedDTensor
from veragged.placement.layout import normalize_placements
from veragged.placement.ragged_shard import RaggedShard, StridedRaggedShard
from veragged.placement.redistribute import RedistributeHandle, redistribute

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
