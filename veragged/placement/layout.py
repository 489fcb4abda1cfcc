"""Where a RaggedShard DTensor's elements live: validation, the LCM rule and per-rank ranges.

[Note: ragged layout on an N-D mesh]
At most one mesh dim carries a RaggedShard (or StridedRaggedShard). The other mesh dims carry
Replicate, Partial or `Shard(d)`. The ragged split is applied last: torch computes the
block this rank holds under the other placements (the RaggedShard counted as Replicate), and the
block's leading `dims` are then split into whole rows (see [Note: RaggedShard semantics]). Two rules
keep this consistent with DTensor's "placements are applied in mesh order" reading and with
checkpoint boxes:
- `Shard(d)`, d > 0 (TP row/column), with `dims` that reach past d (k > d): the ragged rows of
  the block cut dim d. `normalize_placements` applies the paper's LCM rule where it does not
  change any rank's elements: the granularity becomes lcm(prod(shape[k:]), prod(shape[d:]))
  elements, rows of `shape[d:]`, so the placement becomes `dims[:d]` with `local_units`
  recomputed for those coarser rows (every rank's boundary, in the block's finer rows, must fall
  on a whole coarser row). Then sharding dim d before or after the ragged split gives the same
  local data. When some boundary falls inside a coarser row there is no such placement, and the
  given `dims` stay: the ragged split is applied to the block, cutting dim d inside it, as
  veScale does (veScale's own DCP tests save such layouts).
- `Shard(0)` on a later mesh dim than the RaggedShard (FSDP over EP/TP, applied first): the
  placement must be a `StridedRaggedShard` whose `split_factor` is the number of dim-0 pieces,
  so the order of application is recorded in the placements.
- Uneven `Shard(d)` (a dim the mesh dim size does not divide, e.g. TP of 9 rows over 2 ranks:
  torch.chunk pieces of 5 and 4 rows, or of 1 and 0) needs `local_units` with exactly one nonzero
  entry: each block then goes whole to one rank of the ragged mesh dim, whatever its row count.
  With several holders, blocks of 5 and 4 rows could not both be split in the same proportions
  and ranks would disagree on whether the placements are valid. Blocks then differ in shape (or
  are empty) between coordinates of the other mesh dims, but never inside one process group of
  the ragged mesh dim (its ranks share every other coordinate): bounds, the ragged collectives
  and the checkpoint boxes (boxes.py, offsets from torch's block offsets)
  are per block and stay consistent; torch's own redistribute handles the uneven dims.
Every check here depends only on shapes and the mesh, so all ranks raise or pass together.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from veragged.placement.ragged_shard import RaggedShard, StridedRaggedShard
from veragged.runtime import caches

__all__ = [
    "RaggedLayout",
    "check_placements",
    "normalize_placements",
    "ragged_layout",
    "ragged_mesh_dim",
]


def ragged_mesh_dim(placements: Sequence[Placement]) -> int | None:
    """Index of the ragged placement in `placements`, or None; ValueError if there are several."""
    found = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(found) > 1:
        raise ValueError(f"placements may hold at most one RaggedShard, got {tuple(placements)}")
    return found[0] if found else None


def _dim0_split_after(mesh: DeviceMesh, placements: Sequence[Placement], i: int) -> int:
    return math.prod(
        mesh.size(j) for j in range(i + 1, len(placements)) if placements[j] == Shard(0)
    )


def check_placements(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> int | None:
    """Validate `placements` for a tensor of `shape` on `mesh`.

    Return the ragged mesh dim (or None).

    Raises ValueError naming the offending values; see [Note: ragged layout on an N-D mesh].
    """
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"placements {placements} must have one entry per mesh dim ({mesh.ndim})")
    i = ragged_mesh_dim(placements)
    if i is None:
        return None
    ragged = placements[i]
    shape = tuple(shape)
    if ragged.num_ranks != mesh.size(i):
        raise ValueError(
            f"{ragged!r} has {ragged.num_ranks} local_units "
            f"but mesh dim {i} has {mesh.size(i)} ranks"
        )
    if len(ragged.dims) > len(shape):
        raise ValueError(
            f"{ragged!r}: dims {ragged.dims} do not fit a tensor of shape {list(shape)}"
        )
    for j, p in enumerate(placements):
        if j == i or isinstance(p, (Replicate, Partial)):
            continue
        if type(p) is not Shard:
            raise ValueError(
                f"{p!r} cannot be combined with a RaggedShard (placements {placements})"
            )
        d = p.dim if p.dim >= 0 else p.dim + len(shape)
        if not 0 <= d < len(shape):
            raise ValueError(
                f"Shard({p.dim}) on mesh dim {j} does not fit a tensor of shape {list(shape)}"
            )
        if shape[d] % mesh.size(j) and ragged._units.nonzero != 1:
            raise ValueError(
                f"Shard({d}) on mesh dim {j} next to a RaggedShard needs dim {d} "
                f"(size {shape[d]}) to be divisible by the mesh dim size {mesh.size(j)}, or "
                f"local_units with exactly one nonzero entry (got {ragged!r})"
            )
    split = _dim0_split_after(mesh, placements, i)
    strided = isinstance(ragged, StridedRaggedShard)
    if split > 1 and not (strided and ragged.split_factor == split):
        raise ValueError(
            f"{ragged!r} on mesh dim {i} is applied after Shard(0) on a later mesh dim; spell it "
            f"StridedRaggedShard({ragged.dims}, local_units, split_factor={split})"
        )
    if split == 1 and strided and ragged.split_factor != 1:
        raise ValueError(
            f"{ragged!r} needs Shard(0) on later mesh dims with {ragged.split_factor} pieces"
        )
    layout = ragged_layout(shape, mesh, placements)
    ragged.check_rows(layout.rows)
    return i


def normalize_placements(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[Placement, ...]:
    """Apply the LCM rule and the StridedRaggedShard spelling, then validate.

    A RaggedShard whose `dims` cut a dim that `Shard(d)` shards keeps its `local_units` but gets
    `dims=(0, ..., d-1)`; one applied after a later mesh dim's `Shard(0)` becomes a
    `StridedRaggedShard`. Negative Shard dims are normalised.
    """
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements {tuple(placements)} must have one entry per mesh dim ({mesh.ndim})"
        )
    for j, p in enumerate(placements):
        if type(p) is Shard and p.dim < 0:
            placements[j] = Shard(p.dim + len(shape))
    i = ragged_mesh_dim(placements)
    if i is not None:
        ragged = placements[i]
        k = len(ragged.dims)
        for p in placements:
            if type(p) is Shard and 0 < p.dim < k:
                k = p.dim
        units = ragged.local_units
        if k != len(ragged.dims):
            coarse = _coarser_units(shape, mesh, placements, i, k)
            if coarse is None:
                k = len(ragged.dims)  # no exact conversion: the rows of the block stay as given
            else:
                units = coarse
        split = _dim0_split_after(mesh, placements, i)
        if split > 1:
            placements[i] = StridedRaggedShard(tuple(range(k)), units, split)
        elif k != len(ragged.dims) or isinstance(ragged, StridedRaggedShard):
            placements[i] = RaggedShard(tuple(range(k)), units)
    placements = tuple(placements)
    check_placements(shape, mesh, placements)
    return placements


def _coarser_units(shape, mesh, placements, i: int, k: int) -> tuple[int, ...] | None:
    """The LCM rule's `local_units` for rows of `shape[k:]`, giving every rank exactly the
    elements the given RaggedShard gives it in rows of its finer `dims`: the given units when
    they divide the coarser rows (the same boundaries then), else the boundaries recounted in
    coarser rows; None when a boundary falls inside a coarser row (or the given placement is
    invalid: check_placements says so)."""
    ragged = placements[i]
    others = tuple(Replicate() if j == i else p for j, p in enumerate(placements))
    if len(ragged.dims) > len(shape) or any(
            type(p) is Shard and not 0 <= p.dim < len(shape) for p in others):
        return None
    with torch.device("cpu"):
        block, _ = compute_local_shape_and_global_offset(tuple(shape), mesh, others)
    fine, coarse = math.prod(block[: len(ragged.dims)]), math.prod(block[:k])
    units = ragged._units
    if coarse % units.total == 0 or units.nonzero == 1:
        return units.values  # valid as they are, and then the same elements
    per_row = fine // coarse if coarse else 0
    if per_row == 0 or fine % units.total:
        return None
    bounds = [p * fine // units.total for p in units.prefix]  # in fine rows
    if any(b % per_row for b in bounds):
        return None
    return tuple((b - a) // per_row for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class RaggedLayout:
    """This rank's share of a RaggedShard DTensor; see [Note: ragged layout on an N-D mesh].

    Attributes:
        mesh_dim: the mesh dim carrying the ragged placement.
        placement: that placement.
        block_shape, block_offset: the block this rank holds under the other placements, and its
            offset in the global tensor (the whole tensor on a 1-D mesh).
        rows, row_numel: rows of the block's flattened `dims`, and elements per row.
        coordinate: this rank's index along `mesh_dim`.
        begin, end: the rows `[begin, end)` of the block this rank holds.
    """

    mesh_dim: int
    placement: RaggedShard
    block_shape: tuple[int, ...]
    block_offset: tuple[int, ...]
    rows: int
    row_numel: int
    coordinate: int
    begin: int
    end: int

    @property
    def local_numel(self) -> int:
        return (self.end - self.begin) * self.row_numel

    @property
    def flat_offset(self) -> int:
        """Offset of the local elements in the row-major block."""
        return self.begin * self.row_numel

    @functools.cached_property
    def bounds(self) -> tuple[int, ...]:
        """Element bounds of every rank of the mesh dim in the block.

        Rank r holds [b[r], b[r+1]).
        """
        units = self.placement._units
        return tuple(p * self.rows // units.total * self.row_numel for p in units.prefix)


@caches.register_function("placement.layout ragged layouts")
@functools.lru_cache(maxsize=4096)
def _ragged_layout(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> RaggedLayout:
    i = ragged_mesh_dim(placements)
    ragged = placements[i]
    others = tuple(Replicate() if j == i else p for j, p in enumerate(placements))
    with torch.device("cpu"):  # torch's helper makes index tensors: not on a meta default device
        block_shape, block_offset = compute_local_shape_and_global_offset(shape, mesh, others)
    k = len(ragged.dims)
    rows, row_numel = math.prod(block_shape[:k]), math.prod(block_shape[k:])
    coordinate = mesh.get_coordinate()[i]
    begin, end = ragged.row_range(rows, coordinate)
    return RaggedLayout(
        i, ragged, tuple(block_shape), tuple(block_offset), rows, row_numel, coordinate, begin, end
    )


def ragged_layout(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> RaggedLayout:
    """The cached `RaggedLayout` of this rank for a tensor of `shape`.

    `placements` hold a RaggedShard.
    """
    return _ragged_layout(tuple(shape), mesh, tuple(placements))


def spec_layout(spec) -> RaggedLayout:
    """`ragged_layout` of a DTensorSpec."""
    return ragged_layout(spec.tensor_meta.shape, spec.mesh, spec.placements)
