"""Python side of the DBuffer ops: the calls the DBuffer makes and their fake kernels, so
`torch.compile` and FakeTensorMode (memory estimates) can trace them; and the DBuffer's aligned
allocations (`aligned_empty`, [Note: aligned buffers]).

The kernels are C++ (CPU) and CUDA; see [Note: DBuffer group ops] in csrc/dbuffer/group_ops.h.
Each op mutates its first argument in place and returns nothing, so its fake kernel only checks
what the real kernels check (shapes, devices and the dtypes of "Dtypes" in the Note) and returns
None.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ALIGN_BYTES", "accumulate_", "aligned_empty", "cast_scale_", "land_", "zero_ranges_"]


def _check_pair(op: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"{op}: dst and src must be contiguous")
    if dst.numel() != src.numel():
        raise ValueError(f"{op}: dst has {dst.numel()} elements but src has {src.numel()}")
    if dst.device != src.device:
        raise ValueError(f"{op}: dst is on {dst.device} but src is on {src.device}")


def _both(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Both floating or both complex: the dtypes the ops compute in (see "Dtypes" in the Note)."""
    return (dst.is_floating_point() and src.is_floating_point()) or (
        dst.is_complex() and src.is_complex()
    )


@torch.library.register_fake("veragged::aligned_empty")
def _aligned_empty_fake(numel, dtype, device, pin_memory=False):
    # Exactly `numel` elements: what a device's caching allocator gives (its blocks are aligned).
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    return torch.empty(numel, dtype=dtype, device=device)


@torch.library.register_fake("veragged::cast_scale_")
def _cast_scale_fake(dst, src, alpha=1.0):
    _check_pair("cast_scale_", dst, src)
    if not (dst.dtype == src.dtype and alpha == 1.0) and not _both(dst, src):
        raise ValueError(
            f"cast_scale_: cannot cast {src.dtype} to {dst.dtype} with alpha={alpha}: only "
            "floating (or only complex) tensors are cast and scaled; other dtypes are copied, "
            "into the same dtype with alpha=1"
        )


@torch.library.register_fake("veragged::accumulate_")
def _accumulate_fake(dst, src, alpha=1.0):
    _check_pair("accumulate_", dst, src)
    if not _both(dst, src):
        raise ValueError(
            "accumulate_: dst and src must both be floating or both complex tensors, "
            f"got {dst.dtype} and {src.dtype}"
        )


@torch.library.register_fake("veragged::zero_ranges_")
def _zero_ranges_fake(dst, ranges):
    if not dst.is_contiguous():
        raise ValueError("zero_ranges_: dst must be contiguous")
    if len(ranges) % 2:
        raise ValueError(
            f"zero_ranges_: ranges must hold (begin, end) pairs, got {len(ranges)} values"
        )


LAND_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@torch.library.register_fake("veragged::land_")
def _land_fake(dst, srcs, pieces, alpha=1.0):
    if not dst.is_contiguous():
        raise ValueError("land_: dst must be contiguous")
    if len(pieces) % 5:
        raise ValueError("land_: pieces must hold (src, src_offset, dst_offset, count, add) "
                         f"tuples, got {len(pieces)} values")
    for t in (dst, *srcs):
        if t.dtype not in LAND_DTYPES:
            raise ValueError(f"land_: dst and srcs must be float, double, half or bfloat16, "
                             f"got {t.dtype}")


def cast_scale_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`dst = (alpha * src).to(dst.dtype)` in one pass; returns `dst`.

    Floating or complex dtypes (both of one kind); any dtype for a copy (same dtype, alpha=1).
    """
    torch.ops.veragged.cast_scale_(dst, src, alpha)
    return dst


def accumulate_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`dst += alpha * src.to(dst.dtype)` in one pass (floating or complex); returns `dst`."""
    torch.ops.veragged.accumulate_(dst, src, alpha)
    return dst


def zero_ranges_(dst: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Zero the flat ranges `[begin, end)` of `dst` in one launch; returns `dst`."""
    torch.ops.veragged.zero_ranges_(dst, [int(x) for r in ranges for x in r])
    return dst


def land_(dst: torch.Tensor, srcs: Sequence[torch.Tensor], pieces: Sequence[int],
          alpha: float = 1.0) -> torch.Tensor:
    """For each piece (i, s, d, n, add) of `pieces` (five ints each):
    `dst[d:d+n] = (dst[d:d+n] if add else +0.0) + alpha * srcs[i][s:s+n]`, cast to dst's dtype,
    in one launch (the gradient landing of [Note: gradient landing]); returns `dst`."""
    torch.ops.veragged.land_(dst, list(srcs), [int(x) for x in pieces], alpha)
    return dst


ALIGN_BYTES = 256


def aligned_empty(numel: int, dtype: torch.dtype, device: torch.device,
                  pin_memory: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` elements whose first element is 256-byte aligned (in pinned host
    memory if `pin_memory`: the host side of CPU offload), taking exactly their bytes.

    [Note: aligned buffers]
    A DBuffer's flat allocations (the shard, the sharded gradients) start on 256 bytes, so a
    tensor planned at an aligned offset starts aligned (the owner engine then uses it in place:
    `optim/engine.py aligned_input`), and hold exactly the planned bytes: no allocation pays
    for its own alignment, which torch's fully_shard would not either (benchmarks/memory.py
    measures both).
    `veragged::aligned_empty` (csrc/dbuffer/memory.cpp) takes host memory from a 256-byte
    aligned allocator and device or pinned memory from torch's caching allocators, whose blocks
    are aligned already; under FakeTensorMode (memory estimates) it is `numel` elements."""
    return torch.ops.veragged.aligned_empty(int(numel), dtype, torch.device(device),
                                            bool(pin_memory))
