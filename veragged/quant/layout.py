"""`Packing`: the Python face of `quant_layout` (csrc/quant/layout.h): a block-scaled DBuffer's
packed all-gather slot and the tile tables its ops run over ([Note: block-scaled weights])."""

from __future__ import annotations

from typing import Sequence

import torch

from veragged.quant.formats import RAW, BlockFormat
from veragged.quant.ops import TABLE_COLS

__all__ = ["Packing"]

_SEGMENT_INTS = 9


def _tiles(row: Sequence[int]) -> int:
    _, _, rows, cols, tr, tc = row[:6]
    return -(-rows // tr) * -(-cols // tc)


def _table(rows: list[list[int]]) -> tuple[torch.Tensor, int]:
    """Rows of (format, elem_off, rows, cols, tile_rows, tile_cols, data_off, scale_off) with
    their first_tile column, as the ops' int64 table; and the tile count."""
    out, first = [], 0
    for r in rows:
        out.append([*r, first])
        first += _tiles(r)
    table = torch.tensor(out, dtype=torch.int64).reshape(-1, TABLE_COLS)
    return table, first


class Packing:
    """Where each rank's tiles, scales and raw tensors go in its packed slot.

    Args:
        entries: the DBuffer's entries (start, stop, shape in the global buffer).
        formats: per entry, its `BlockFormat` or None (sent raw, in the param dtype).
        shard_size, world, rank: the DBuffer's S, P and this rank.
        param_dtype: the unsharded dtype (what raw tensors are sent in).
        align: bytes every slot is a multiple of.

    Attributes: `slot_bytes` (Q: every rank's slot; the all-gather moves P * Q), `rank_bytes`
    (what each rank's segments use), `quantize` / `quantize_tiles` (this rank's table: offsets in
    its shard and its slot) and `dequantize` / `dequantize_tiles` (every rank's: offsets in the
    unsharded buffer and the gathered P * Q bytes), host tensors checked by `check_tile_table`;
    `segments`: the rows of `dequantize` as lists (format, elem_off, rows, cols, tile_rows,
    tile_cols, data_off, scale_off).
    """

    def __init__(self, entries, formats: Sequence[BlockFormat | None], shard_size: int,
                 world: int, rank: int, param_dtype: torch.dtype, align: int):
        item = param_dtype.itemsize
        specs: list[int] = []
        for e, f in zip(entries, formats):
            numel = e.stop - e.start
            if f is None:
                specs += [e.start, numel, 1, 1, RAW, 1, 1, item]
            else:
                _, R, C = f.matrix(e.shape)
                specs += [e.start, numel, R, C, f.format_id, f.tile[0], f.tile[1], 0]
        Q, flat, rank_bytes = torch.ops.veragged.quant_layout(specs, shard_size, world, align)
        self.slot_bytes, self.rank_bytes = Q, list(rank_bytes)
        self.world, self.shard_size = world, shard_size
        segments = [flat[i : i + _SEGMENT_INTS] for i in range(0, len(flat), _SEGMENT_INTS)]
        mine = [s[1:] for s in segments if s[0] == rank]
        every = [[f, r * shard_size + off, rows, cols, tr, tc, r * Q + d, r * Q + sc]
                 for r, f, off, rows, cols, tr, tc, d, sc in segments]
        self.segments = every  # every rank's, as the dequantize table's rows
        self.quantize, self.quantize_tiles = _table(mine)
        self.dequantize, self.dequantize_tiles = _table(every)
        check = torch.ops.veragged.check_tile_table
        check(self.quantize, shard_size, Q, self.quantize_tiles, item)
        check(self.dequantize, world * shard_size, world * Q, self.dequantize_tiles, item)
        self.elements = sum(e.stop - e.start for e in entries)
        self.quantized_elements = sum(e.stop - e.start for e, f in zip(entries, formats) if f)

    @property
    def gather_bytes(self) -> int:
        """Bytes one all-gather writes on every rank: P slots of Q."""
        return self.world * self.slot_bytes
