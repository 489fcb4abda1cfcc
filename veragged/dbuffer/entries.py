"""A DBuffer's per-tensor records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor.placement_types import Placement

if TYPE_CHECKING:
    from veragged.dbuffer.tp_param import TPParam

__all__ = ["Entry"]


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a DBuffer lives."""

    name: str
    shape: torch.Size
    start: int  # range [start, end) in the unsharded (P * S) buffer
    end: int
    # End of the elements the tensor fills in [start, end): `end`, or for a tensor/expert-parallel
    # parameter ([Note: FSDP over TP]) the end of its TP block, padding after it when TP cut
    # unevenly (and for a block-scaled one its last partial tile-row's, [Note: block-scaled
    # weights])
    stop: int
    local: tuple[int, int]  # this rank's [begin, end) inside its shard
    placement: Placement  # on the shard mesh dim: a RaggedShard, or Shard(d) if chunked
    view_shape: tuple[int, ...]  # of the tensor's view of the unsharded (and gradient) buffer
    tp: "TPParam | None" = None  # a TP parameter's ([Note: FSDP over TP])
    placements: tuple[Placement, ...] | None = None  # on tp.mesh
