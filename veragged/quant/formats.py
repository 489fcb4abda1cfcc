"""The block-scaled weight formats `fully_shard(..., quant_fn=...)` takes: `BlockFP8`, `MXFP8`.

A format is a value (frozen, hashable): where it tiles a parameter, the scale each tile gets
([Note: block-scaled rules] in csrc/quant/rules.h) and the granularity the planner keeps whole
(`plan_shape`), so every rank quantises its own tiles: [Note: block-scaled weights].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BlockFP8", "BlockFormat", "MXFP8", "QUANTIZABLE_DTYPES"]

#: Parameter (master) and param dtypes the tile kernels read and write.
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Format ids of the ops (quant::Format in csrc/quant/layout.h).
RAW, FP32_SCALE, UE8M0, MX_FLOOR, MX_RCEIL = range(5)


class BlockFormat:
    """What every format answers. `tile` is (rows, cols) of one scale's block of a matrix (the
    parameter's last two dims; a 1-D parameter is one row); `format_id` the ops' int."""

    tile: tuple[int, int]
    compute: str

    @property
    def format_id(self) -> int:
        raise NotImplementedError

    @property
    def scale_bytes(self) -> int:
        return 4 if self.format_id == FP32_SCALE else 1

    def matrix(self, shape) -> tuple[int, int, int]:
        """(matrices, rows, cols) of a parameter of `shape`: its last two dims are the matrix,
        the dims before them count matrices (an expert stack); a 1-D parameter is one row."""
        shape = tuple(shape)
        if len(shape) == 1:
            return 1, 1, shape[0]
        return math.prod(shape[:-2]), shape[-2], shape[-1]

    def plan_shape(self, shape) -> tuple[int, int]:
        """(planned numel, block) for the planner: the block is whole tile-rows of a matrix
        (whole matrices when a matrix has at most one tile-row, or when an expert stack's
        matrices end in a partial tile-row); a single matrix whose last tile-row is partial is
        planned as if padded to whole tile-rows (the padding rows are buffer padding, never
        sent: [Note: block-scaled weights])."""
        B, R, C = self.matrix(shape)
        tr = self.tile[0]
        n = B * R * C
        if n == 0:
            return 0, 1
        if R <= tr:
            return n, R * C
        if R % tr == 0:
            return n, tr * C
        if B == 1:
            return -(-R // tr) * tr * C, tr * C
        return n, R * C

    def activation_format(self) -> "BlockFormat":
        """How `compute="fp8"` quantises the activations a weight in this format multiplies:
        one scale per 1 x tile-cols block of a row, the same scale rule."""
        raise NotImplementedError

    def tiles(self, shape) -> tuple[int, int, int]:
        """(matrices, tile-rows, tile-cols) of the scales of a parameter of `shape`."""
        B, R, C = self.matrix(shape)
        return B, -(-R // self.tile[0]), -(-C // self.tile[1])


def _check_choice(cls: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{cls}: {name} must be one of {choices}, got {value!r}")


def _check_compute(cls: str, compute) -> None:
    _check_choice(cls, "compute", compute, ("bf16", "fp8"))


@dataclass(frozen=True)
class BlockFP8(BlockFormat):
    """FP8 E4M3 weights in `tile` blocks with one scale each (DeepSeek-V3's weights: 128x128,
    fp32 `weight_scale_inv`; `scale="ue8m0"`: one power-of-two byte per tile, DeepSeek-V3.1's
    `scale_fmt`). `tile` may be any (rows, cols) of positive ints, (1, 128) included.

    compute: "bf16": the gathered 8-bit weight is dequantised into the param-dtype unsharded
    parameter (the module is untouched; only communication is 8-bit). "fp8": the unsharded
    parameter is a `BlockScaledWeight` (veragged/quant/tensor.py) whose `F.linear` quantises
    the activations in 1 x tile-cols blocks and multiplies in FP8 ([Note: FP8 compute]); a 2-D
    weight only.
    """

    tile: tuple[int, int] = (128, 128)
    scale: str = "fp32"
    compute: str = "bf16"

    def __post_init__(self):
        tile = self.tile
        if (not isinstance(tile, tuple) or len(tile) != 2
                or not all(type(v) is int and v > 0 for v in tile)):
            raise ValueError(f"BlockFP8: tile must be a tuple of two positive ints, got {tile!r}")
        _check_choice("BlockFP8", "scale", self.scale, ("fp32", "ue8m0"))
        _check_compute("BlockFP8", self.compute)

    @property
    def format_id(self) -> int:
        return FP32_SCALE if self.scale == "fp32" else UE8M0

    def activation_format(self) -> "BlockFP8":
        return BlockFP8(tile=(1, self.tile[1]), scale=self.scale, compute=self.compute)

    def __str__(self) -> str:
        extra = ", fp8 compute" if self.compute == "fp8" else ""
        return f"BlockFP8({self.tile[0]}x{self.tile[1]}, {self.scale}{extra})"


@dataclass(frozen=True)
class MXFP8(BlockFormat):
    """MXFP8: E4M3 in 1x32 blocks along the last dim, one E8M0 scale each (OCP MX v1.0), the
    exponent rounded as torchao's `ScaleCalculationMode` FLOOR or RCEIL. compute: as BlockFP8's.
    """

    rounding: str = "floor"
    compute: str = "bf16"

    tile = (1, 32)

    def __post_init__(self):
        _check_choice("MXFP8", "rounding", self.rounding, ("floor", "rceil"))
        _check_compute("MXFP8", self.compute)

    @property
    def format_id(self) -> int:
        return MX_FLOOR if self.rounding == "floor" else MX_RCEIL

    def activation_format(self) -> "MXFP8":
        return self

    def __str__(self) -> str:
        extra = ", fp8 compute" if self.compute == "fp8" else ""
        return f"MXFP8({self.rounding}{extra})"
