"""Python side of the DBuffer group ops: fake kernels, so `torch.compile` can trace them.

The kernels are C++ (CPU) and CUDA; see [Note: DBuffer group ops] in csrc/dbuffer/group_ops.h.
Each op mutates its first argument in place and returns nothing, so its fake kernel only checks
what the real kernels check and returns None.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["accumulate_", "cast_scale_", "scale_", "zero_ranges_"]


def _check_pair(op: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() != src.numel():
        raise ValueError(f"{op}: dst has {dst.numel()} elements but src has {src.numel()}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"{op}: dst and src must be contiguous")


@torch.library.register_fake("veragged::cast_scale_")
def _cast_scale_fake(dst, src, alpha=1.0):
    _check_pair("cast_scale_", dst, src)


@torch.library.register_fake("veragged::accumulate_")
def _accumulate_fake(dst, src, alpha=1.0):
    _check_pair("accumulate_", dst, src)


@torch.library.register_fake("veragged::scale_")
def _scale_fake(dst, alpha):
    if not dst.is_contiguous():
        raise ValueError("scale_: dst must be contiguous")


@torch.library.register_fake("veragged::zero_ranges_")
def _zero_ranges_fake(dst, ranges):
    if len(ranges) % 2:
        raise ValueError(
            f"zero_ranges_: ranges must hold (begin, end) pairs, got {len(ranges)} values"
        )


def cast_scale_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`dst = (alpha * src).to(dst.dtype)` in one pass; returns `dst`."""
    torch.ops.veragged.cast_scale_(dst, src, alpha)
    return dst


def accumulate_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`dst += alpha * src.to(dst.dtype)` in one pass; returns `dst`."""
    torch.ops.veragged.accumulate_(dst, src, alpha)
    return dst


def scale_(dst: torch.Tensor, alpha: float) -> torch.Tensor:
    """`dst *= alpha`; returns `dst`."""
    torch.ops.veragged.scale_(dst, alpha)
    return dst


def zero_ranges_(dst: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Zero the flat ranges `[begin, end)` of `dst` in one launch; returns `dst`."""
    torch.ops.veragged.zero_ranges_(dst, [int(x) for r in ranges for x in r])
    return dst
