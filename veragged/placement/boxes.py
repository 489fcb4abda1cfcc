"""A rank's rows of a RaggedShard as rectangular boxes, and the checkpoint hooks built on them.

DCP describes a rank's share of a tensor as N-D boxes (`ChunkStorageMetadata`) and reshards on
load by intersecting the saved boxes with the loading ones, so any two layouts that describe
themselves as boxes load into each other: other world sizes, other `local_units`, torch's
`Shard(0)`, plain tensors. A rank's rows of a RaggedShard are a contiguous row-major range of the
block's flattened `dims`; `torch.ops.veragged.flat_range_boxes` cuts it into at most 2k-1 boxes
(see [Note: flat range boxes]), each a contiguous slice of the local tensor, so saving reads and
loading writes the local storage through views: no communication, no copy. Reductions over
ragged-sharded dims reduce box by box (ragged_dim_reduce.py). `RaggedDTensor`'s DCP hooks
(`__create_write_items__`, ...) call the functions at the bottom; `veragged.checkpoint.local_boxes`
is this module's `local_boxes`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor.placement_types import Partial

from veragged.placement.layout import ragged_layout
from veragged.runtime import caches

__all__ = [
    "create_chunk_list", "create_write_items", "get_tensor_shard", "local_boxes", "row_boxes",
]


class Box(NamedTuple):
    offsets: torch.Size  # in the global tensor
    sizes: torch.Size
    start: int  # flat offset of the box's first element in the local tensor


@caches.register_function("placement.boxes row boxes")
@functools.lru_cache(maxsize=4096)
def row_boxes(prefix: tuple[int, ...], begin: int, end: int) -> tuple[tuple, ...]:
    """Rows `[begin, end)` of the row-major flattening of a block's leading dims `prefix` as at
    most 2k-1 boxes ([Note: flat range boxes]), in increasing row order: `(offsets, sizes,
    first)`, the box's offsets and sizes in those k dims (relative to the block) and its first
    row counted from `begin`. Each box is one contiguous slice of the local rows. Shared by the
    checkpoint boxes below and reductions over ragged-sharded dims (ragged_dim_reduce.py)."""
    k = len(prefix)
    if begin >= end:
        return ()
    if k == 0:
        return (((), (), 0),)
    flat = torch.ops.veragged.flat_range_boxes(list(prefix), begin, end)
    boxes = []
    for b in range(0, len(flat), 2 * k):
        offs, sizes = tuple(flat[b : b + k]), tuple(flat[b + k : b + 2 * k])
        row = 0
        for o, s in zip(offs, prefix):
            row = row * s + o
        boxes.append((offs, sizes, row - begin))
    return tuple(boxes)


@caches.register_function("placement.boxes local boxes")
@functools.lru_cache(maxsize=4096)
def _local_boxes(shape: tuple[int, ...], mesh, placements: tuple) -> tuple[Box, ...]:
    layout = ragged_layout(shape, mesh, placements)
    if math.prod(shape) == 0:
        # A tensor without elements still needs an entry in the checkpoint's metadata, or loading
        # it raises "Missing key": one empty box of the block, as torch writes for its DTensors.
        return (Box(torch.Size(layout.block_offset), torch.Size(layout.block_shape), 0),)
    block, origin = layout.block_shape, layout.block_offset
    if layout.local_numel == 0:
        # No rows here: one empty box at the tensor's end on dim 0, where torch puts an empty
        # Shard piece (offset = the dim's size), so that it overlaps no other box and starts
        # where no box with data does (DCP keys a box by its offsets, and deduplicates equal
        # keys across ranks). Every rank thereby names every tensor in its plan:
        # `dcp.save(use_collectives=False)` writes one metadata file per rank, and each rank
        # loads from its own.
        end = torch.Size([shape[0], *origin[1:]])
        return (Box(end, torch.Size([0, *block[1:]]), 0),)
    k = len(layout.placement.dims)
    rest = list(block[k:])
    return tuple(
        Box(
            torch.Size(o + g for o, g in zip(list(offs) + [0] * len(rest), origin)),
            torch.Size(list(sizes) + rest),
            first * layout.row_numel,
        )
        for offs, sizes, first in row_boxes(tuple(block[:k]), layout.begin, layout.end)
    )


def local_boxes(dt) -> tuple[Box, ...]:
    """This rank's boxes of RaggedShard DTensor `dt`, in local storage order."""
    return _local_boxes(tuple(dt.shape), dt.device_mesh, dt.placements)


def _check_no_partial(dt) -> None:
    if any(isinstance(p, Partial) for p in dt.placements):
        raise ValueError(
            f"checkpointing a DTensor with Partial placements {dt.placements} is not supported"
        )


def create_chunk_list(dt) -> list[ChunkStorageMetadata]:
    _check_no_partial(dt)
    return [ChunkStorageMetadata(offsets=b.offsets, sizes=b.sizes) for b in local_boxes(dt)]


def create_write_items(fqn: str, dt) -> list[WriteItem]:
    _check_no_partial(dt)
    properties = TensorProperties.create_from_tensor(dt._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, b.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=b.offsets, sizes=b.sizes),
                properties=properties,
                size=dt.size(),
            ),
        )
        for b in local_boxes(dt)
    ]


def get_tensor_shard(dt, index: MetadataIndex) -> torch.Tensor:
    """The local view holding the box that starts at `index.offset`."""
    boxes = local_boxes(dt)
    hint = index.index
    if hint is not None and 0 <= hint < len(boxes) and boxes[hint].offsets == index.offset:
        box = boxes[hint]
    else:
        box = next((b for b in boxes if b.offsets == index.offset), None)
        if box is None:
            raise ValueError(f"no local box of {index.fqn!r} starts at offset {list(index.offset)}")
    return dt._local_tensor[box.start : box.start + math.prod(box.sizes)].view(box.sizes)
