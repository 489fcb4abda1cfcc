"""Python side of the tile ops: fake kernels (so `torch.compile` traces them) and the checks they
share with the C++ ops (csrc/quant/tiles.h). The real kernels are C++ (CPU) and CUDA."""

from __future__ import annotations

import torch

__all__ = ["TABLE_COLS", "dequantize_tiles_", "quantize_tiles_"]

TABLE_COLS = 9
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(op: str, flat: torch.Tensor, packed: torch.Tensor, table: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"{op}: packed must be a contiguous uint8 tensor, got {packed.dtype}")
    if flat.dtype not in _FLOATS or not flat.is_contiguous():
        raise ValueError(f"{op}: the flat tensor must be a contiguous float32, bfloat16 or "
                         f"float16 tensor, got {flat.dtype}")
    if not (table.dtype == torch.int64 and table.dim() == 2 and table.shape[1] == TABLE_COLS):
        raise ValueError(f"{op}: table must be an int64 tensor of [n, {TABLE_COLS}], got "
                         f"{table.dtype} {list(table.shape)}")
    if not (packed.device == flat.device == table.device):
        raise ValueError(f"{op}: tensors on {flat.device}, {packed.device}, {table.device}")


@torch.library.register_fake("veragged::quantize_tiles_")
def _quantize_fake(packed, src, table, tiles, param_dtype):
    _check("quantize_tiles_", src, packed, table)
    if param_dtype not in _FLOATS:
        raise ValueError(f"quantize_tiles_: param_dtype must be float32, bfloat16 or float16, "
                         f"got {param_dtype}")


@torch.library.register_fake("veragged::dequantize_tiles_")
def _dequantize_fake(dst, packed, table, tiles):
    _check("dequantize_tiles_", dst, packed, table)


@torch.library.register_fake("veragged::check_tile_table")
def _check_tile_table_fake(table, numel, bytes, tiles, raw_itemsize):
    return None


def quantize_tiles_(packed: torch.Tensor, src: torch.Tensor, table: torch.Tensor, tiles: int,
                    param_dtype: torch.dtype) -> None:
    """Every tile of `table` quantised from `src` (the shard) into `packed` (csrc/quant/tiles.h)."""
    torch.ops.veragged.quantize_tiles_(packed, src, table, tiles, param_dtype)


def dequantize_tiles_(dst: torch.Tensor, packed: torch.Tensor, table: torch.Tensor,
                      tiles: int) -> None:
    """Every tile of `table` dequantised from `packed` into `dst` (csrc/quant/tiles.h)."""
    torch.ops.veragged.dequantize_tiles_(dst, packed, table, tiles)
