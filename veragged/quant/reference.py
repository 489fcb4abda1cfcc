"""A one-process quantiser in plain torch ops: the reference the tile kernels, the gathered bytes
and the DeepSeek export are checked against ([Note: block-scaled rules] in csrc/quant/rules.h
states the rules; this file implements them independently of the C++ code)."""

from __future__ import annotations

import torch

from veragged.quant.formats import FP32_SCALE, MX_FLOOR, MX_RCEIL, UE8M0, BlockFormat

__all__ = ["dequantize", "e8m0_to_float", "fake_quantize", "quantize", "scale_inv"]

_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-12


def _rceil(v: torch.Tensor) -> torch.Tensor:
    bits = v.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = torch.where(exponent == 0, mantissa > 0x400000, mantissa != 0)
    e = exponent + up.to(torch.int32)
    return torch.where(torch.isfinite(v), e, torch.full_like(e, 255))


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """The fp32 power of two each E8M0 byte of `e` means (0: 2^-127, 255: NaN)."""
    e = e.to(torch.int32) & 0xFF
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _scales(amax: torch.Tensor, format_id: int):
    """(mul, scale_inv, stored) per tile; stored is fp32 (FP32_SCALE) or the E8M0 byte."""
    if format_id == FP32_SCALE:
        a = amax.clamp(min=_AMAX_FLOOR)
        mul = torch.full_like(a, _E4M3_MAX) / a
        inv = torch.ones_like(mul) / mul
        return mul, inv, inv
    if format_id == UE8M0:
        e = _rceil(amax.clamp(min=_AMAX_FLOOR) / _E4M3_MAX)
    elif format_id == MX_RCEIL:
        e = _rceil(amax * torch.tensor(1.0 / _E4M3_MAX, dtype=torch.float32))
    elif format_id == MX_FLOOR:
        exponent = (amax.view(torch.int32) >> 23) & 0xFF
        e = (exponent - 127 - 8).clamp(-127, 128) + 127
        e = torch.where(torch.isfinite(amax), e, torch.full_like(e, 255))
    else:
        raise ValueError(f"unknown format id {format_id}")
    return e8m0_to_float(254 - e), e8m0_to_float(e), e.to(torch.uint8)


def _tiled(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """`x` (fp32, the parameter's shape) as [B, Rt, tr, Ct, tc] tiles, zero-padded (zeros never
    raise an amax: the padding is excluded in effect)."""
    B, R, C = fmt.matrix(x.shape)
    tr, tc = fmt.tile
    _, Rt, Ct = fmt.tiles(x.shape)
    padded = x.new_zeros(B, Rt * tr, Ct * tc)
    padded[:, :R, :C] = x.reshape(B, R, C)
    return padded.view(B, Rt, tr, Ct, tc)


def _scale_shape(shape, fmt: BlockFormat) -> tuple[int, ...]:
    _, Rt, Ct = fmt.tiles(shape)
    return (Ct,) if len(shape) == 1 else (*tuple(shape)[:-2], Rt, Ct)


def quantize(w: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`(data, scales)` of the full weight `w` (in the param dtype): data is uint8 (E4M3 bits)
    of `w`'s shape; scales are [..., tile-rows, tile-cols] (a 1-D `w`: [tile-cols]), fp32
    scale_inv for fp32 scales, else the uint8 E8M0 byte."""
    B, R, C = fmt.matrix(w.shape)
    tiles = _tiled(w.detach().float(), fmt)
    amax = tiles.abs().amax(dim=(2, 4))
    mul, _, stored = _scales(amax, fmt.format_id)
    q = (tiles * mul[:, :, None, :, None]).clamp(-_E4M3_MAX, _E4M3_MAX)
    q = q.to(torch.float8_e4m3fn).view(torch.uint8)
    _, Rt, Ct = fmt.tiles(w.shape)
    data = q.reshape(B, Rt * fmt.tile[0], Ct * fmt.tile[1])[:, :R, :C].reshape(w.shape)
    return data.contiguous(), stored.reshape(_scale_shape(w.shape, fmt))


def scale_inv(scales: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The fp32 factor each stored scale multiplies its tile's E4M3 values by."""
    return scales.float() if fmt.format_id == FP32_SCALE else e8m0_to_float(scales)


def dequantize(data: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight `quantize`'s output means, in `dtype`: fp32(q) * scale_inv, then rounded."""
    B, R, C = fmt.matrix(data.shape)
    _, Rt, Ct = fmt.tiles(data.shape)
    s = scales.reshape(B, Rt, Ct)
    inv = scale_inv(s, fmt)
    q = _tiled(data.view(torch.float8_e4m3fn).float(), fmt)
    x = q * inv[:, :, None, :, None]
    x = x.reshape(B, Rt * fmt.tile[0], Ct * fmt.tile[1])[:, :R, :C]
    return x.reshape(data.shape).to(dtype).contiguous()


def fake_quantize(w: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """`w` quantised and dequantised, in `w`'s dtype: what `compute="bf16"` unshards."""
    return dequantize(*quantize(w, fmt), fmt, w.dtype)
