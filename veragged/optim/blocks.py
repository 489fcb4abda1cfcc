"""AdamW8bit's quantisation blocks on sharded parameters: which block sizes a placement allows,
and the global shape and placements of the per-block absmax state.

[Note: AdamW8bit blocks under TP]
Quantisation blocks are blocks of the *global* tensor flattened row-major ([Note: AdamW8bit on
RaggedShard]); the kernel walks each rank's local tensor in `block_size` chunks from its start,
so every rank's local elements, in local order, must be whole global blocks (the tensor's partial
last block allowed at its end). Which block sizes a placement allows:
- one mesh dim splits the tensor into flat ranges (RaggedShard, or Shard(0) as torch's FSDP2),
  Replicate elsewhere: every rank's range starts on a block boundary and ends on one or at the
  tensor's end. The absmax is 1-D, (num_blocks,), `RaggedShard((0,), blocks per rank)` there.
- a plain `Shard(d)` (TP/EP; on one or more mesh dims, one tensor dim d), with or without a
  RaggedShard / StridedRaggedShard (FSDP) and Replicate (HSDP) on other mesh dims: `block_size`
  must divide the TP-local row length `prod(local_shape[d:])` on every rank of the Shard mesh
  dims (for d = 0: the numel of every TP piece). A TP-local row is contiguous in the global
  tensor and starts at a multiple of it, so TP then cuts no block, and there is no partial block.
  On top, every FSDP cut of a TP block must fall on a block boundary (always so for d > 0, where
  the ragged rows are whole TP-local rows by the LCM rule; for d = 0 the ragged cut must be at a
  multiple of `block_size` within the block). The absmax then has the global shape
  `shape[:d] + (shape[d] // f, inner // g)`, inner = prod(shape[d+1:]), g = gcd(inner,
  block_size), f = block_size // g: f consecutive indices of dim d hold inner // g whole blocks,
  and f divides every TP-local size of dim d, so torch.chunk of `shape[d] // f` over the TP ranks
  gives each exactly its blocks: the absmax keeps the parameter's Shard(d) and Replicate
  placements; its ragged placement is the parameter's for d > 0 (the same rows) and, for d = 0,
  element-wise over the absmax blocks with the parameter's units divided by their gcd (the
  same cuts).
Checkpoints of the absmax are therefore independent of dp and tp, but a TP run's absmax (2-D for
d = 0) is not loadable into a run without TP (1-D) or with TP on another dim: those differ in
global shape. All checks depend only on shapes, placements and the mesh: every rank raises or
passes together.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from veragged.optim.pieces import shard_blocks
from veragged.placement.ragged_shard import RaggedShard, StridedRaggedShard

__all__ = ["absmax_layout"]


def absmax_layout(
    p: torch.Tensor, bs: int, name: str
) -> tuple[tuple[int, ...], tuple[Placement, ...]] | None:
    """The absmax's global shape and placements for an 8-bit parameter `p` with block size
    `bs` after checking that no rank's shard cuts a block ([Note: AdamW8bit blocks under TP]);
    None for a plain tensor. ValueError naming the parameter, the block size, the shapes and the
    offending rank otherwise."""
    if not isinstance(p, DTensor):
        return None
    placements, shape, n = tuple(p.placements), tuple(p.shape), p.numel()
    nblocks = math.ceil(n / bs)
    sharded = [j for j, q in enumerate(placements) if not isinstance(q, Replicate)]
    for q in placements:
        if not (isinstance(q, Replicate) or type(q) is Shard or isinstance(q, RaggedShard)):
            raise ValueError(
                f"AdamW8bit: parameter {name} has placements {placements}, not supported for "
                "8-bit state: use Replicate, Shard(d) and at most one RaggedShard"
            )
    if not sharded:
        return (nblocks,), placements
    first = placements[sharded[0]]
    if len(sharded) == 1 and (isinstance(first, RaggedShard) or first.dim in (0, -len(shape))):
        counts = _flat_counts(p, sharded[0], bs, name)
        out = list(placements)
        out[sharded[0]] = RaggedShard((0,), counts)
        return (nblocks,), tuple(out)
    return _tp_layout(p, bs, name)


def _flat_counts(p: DTensor, dim: int, bs: int, name: str) -> tuple[int, ...]:
    """Blocks per rank of mesh dim `dim`, whose ranks hold flat ranges, after checking them."""
    placement, ranks = p.placements[dim], p.device_mesh.size(dim)
    shape, n = tuple(p.shape), p.numel()
    if isinstance(placement, RaggedShard):
        ranges = [placement.local_numel_and_offset(shape, r)[::-1] for r in range(ranks)]
    else:
        row = math.prod(shape[1:])
        ranges = []
        for r in range(ranks):
            rows, start = Shard.local_shard_size_and_offset(shape[0], ranks, r)
            ranges.append((start * row, rows * row))
    for rank, (offset, size) in enumerate(ranges):
        if size and (offset % bs or (size % bs and offset + size != n)):
            raise ValueError(
                f"AdamW8bit: parameter {name} (shape {list(shape)}, {n} elements) is sharded "
                f"so that rank {rank} of mesh dim {dim} holds {size} elements at flat offset "
                f"{offset}, which is not a whole number of {bs}-element quantisation blocks. "
                f"Shard with veragged.fully_shard(..., granularity_fn=adamw8bit_granularity("
                f"{bs})), or raise min_8bit_size above {n} to keep this parameter in fp32."
            )
    return tuple(math.ceil(size / bs) for _, size in ranges)


def _tp_layout(p: DTensor, bs: int, name: str):
    mesh, placements, shape, n = p.device_mesh, tuple(p.placements), tuple(p.shape), p.numel()
    tp_dims = [j for j, q in enumerate(placements) if type(q) is Shard]
    coords = np.zeros((math.prod(mesh.size(j) for j in tp_dims), mesh.ndim), dtype=np.int64)
    grid = np.indices([mesh.size(j) for j in tp_dims]).reshape(len(tp_dims), -1).T
    coords[:, tp_dims] = grid
    try:
        d, sizes, _ = shard_blocks(shape, mesh, placements, coords)
    except NotImplementedError as e:
        raise ValueError(f"AdamW8bit: parameter {name}: {e}") from None
    inner = math.prod(shape[d + 1:])
    rows = sorted({int(w) * inner for w in sizes})
    if any(r % bs for r in rows):
        raise ValueError(
            f"AdamW8bit: parameter {name} (shape {list(shape)}, placements {placements}): "
            f"block_size={bs} must divide the TP-local row length prod(local_shape[{d}:]) on "
            f"every rank of the Shard({d}) mesh dims, which is {rows} (local sizes of dim {d}: "
            f"{sorted({int(w) for w in sizes})}), so that tensor parallelism cuts no "
            f"quantisation block of the global tensor; use a block size dividing "
            f"{math.gcd(*rows)}, or raise min_8bit_size above {n} to keep it in fp32"
        )
    out = list(placements)
    ragged = [j for j, q in enumerate(placements) if isinstance(q, RaggedShard)]
    if ragged:
        i = ragged[0]
        pl = placements[i]
        _check_ragged_cuts(pl, i, shape, d, sorted({int(w) for w in sizes}), bs, name)
        if d == 0:
            g = math.gcd(*pl.local_units)
            units = tuple(u // g for u in pl.local_units)
            if isinstance(pl, StridedRaggedShard):
                out[i] = StridedRaggedShard((0, 1), units, pl.split_factor)
            else:
                out[i] = RaggedShard((0, 1), units)
    g = math.gcd(inner, bs)
    f = bs // g
    return (*shape[:d], shape[d] // f, inner // g), tuple(out)


def _check_ragged_cuts(pl: RaggedShard, dim: int, shape: Sequence[int], d: int,
                       widths: Sequence[int], bs: int, name: str) -> None:
    """Every rank of the ragged mesh dim `dim` holds whole blocks of each TP block (one per TP
    width of dim d)."""
    k = len(pl.dims)
    for w in widths:
        block = list(shape)
        block[d] = w
        rows, row_numel = math.prod(block[:k]), math.prod(block[k:])
        for r in range(pl.num_ranks):
            b, e = pl.row_range(rows, r)
            offset, size = b * row_numel, (e - b) * row_numel
            if size and (offset % bs or size % bs):
                raise ValueError(
                    f"AdamW8bit: parameter {name} (shape {list(shape)}) is sharded so that rank "
                    f"{r} of mesh dim {dim} holds {size} elements at flat offset {offset} of its "
                    f"TP block of shape {block}, which is not a whole number of {bs}-element "
                    f"quantisation blocks; choose local_units (or a granularity) whose cuts fall "
                    f"on multiples of {bs} elements of the block"
                )
