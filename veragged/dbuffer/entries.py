"""A DBuffer's per-tensor records, and the RaggedShard a planned range gives a tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch.distributed.tensor.placement_types import Placement

from veragged.placement.ragged_shard import RaggedShard

if TYPE_CHECKING:
    from veragged.dbuffer.spmd import SpmdParam

__all__ = ["Entry", "ragged_placement"]


def ragged_placement(shape: Sequence[int], counts: Sequence[int]) -> RaggedShard:
    """The coarsest RaggedShard giving each rank `counts[r]` elements of a tensor of `shape`.

    Rows of `shape[k:]` for the smallest k whose row size divides every count (k = ndim, single
    elements, always does), so row- and block-granular parameters keep row units.
    """
    shape = tuple(shape)
    if not any(counts):  # numel 0: rank 0 holds the (empty) whole
        return RaggedShard((0,), (1,) + (0,) * (len(counts) - 1))
    for k in range(len(shape) + 1):
        row = math.prod(shape[k:])
        if row and all(c % row == 0 for c in counts):
            return RaggedShard(tuple(range(k)), tuple(c // row for c in counts))
    raise AssertionError("unreachable: single elements (k = ndim) divide every count")


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a DBuffer lives."""

    name: str
    shape: torch.Size
    start: int  # range [start, end) in the unsharded (P * S) buffer
    end: int
    local: tuple[int, int]  # this rank's [begin, end) inside its shard
    placement: Placement  # on the shard mesh dim: a RaggedShard, or Shard(d) if chunked
    # A tensor/expert-parallel parameter ([Note: FSDP over TP]): its TP block fills
    # [start, start + used) of the planned range, padding after it when TP cut unevenly.
    spmd: "SpmdParam | None" = None
    used: int | None = None
    placements: tuple[Placement, ...] | None = None  # on spmd.mesh

    @property
    def stop(self) -> int:
        """End of the elements the tensor fills in [start, end)."""
        return self.end if self.used is None else self.start + self.used

    @property
    def view_shape(self) -> tuple[int, ...]:
        """Shape of the tensor's view of the unsharded (and gradient) buffer."""
        return tuple(self.shape) if self.spmd is None else self.spmd.local_shape

