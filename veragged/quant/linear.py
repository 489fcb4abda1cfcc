"""`block_scaled_linear`: `F.linear` with block-scaled FP8 operands, what a `BlockScaledWeight`
runs ([Note: FP8 compute]).

[Note: FP8 compute]
With `compute="fp8"` a weight's unsharded parameter is a `BlockScaledWeight` (tensor.py): the
dequantised weight in the param dtype (what every other op sees, exactly `compute="bf16"`'s)
plus the gathered E4M3 bytes and scales of the weight, unpacked from the all-gather output
by `QuantDBuffer` (never quantised again). `F.linear(x, weight, bias)` on it runs
`block_scaled_linear`:
- forward: x is quantised in 1 x tile-cols blocks (one scale per row and block of columns,
  the weight's scale rule: `BlockFormat.activation_format`), then
  - `F.scaled_mm(BlockWise1x128, BlockWise128x128)` where cuBLASLt has that GEMM (SM90, CUDA
    >= 12.9, torch with `F.scaled_mm`), for a 128 x 128 weight format whose in-features are a
    multiple of 128 and out-features of 16: the weight's data as they were gathered, row-major
    [out, in] passed transposed (column-major, as cuBLASLt wants), its scales [out/128,
    round_up(in/128, 4)] (K blocks padded to a multiple of 4, the layout the GEMM reads:
    `QuantDBuffer` unpacks them so), the activations' scales M-major with M padded to 4;
  - everywhere else (CPU, other formats or shapes) the exact reference: `F.linear` of the
    dequantised activations and the dequantised weight, in the activations' dtype.
  Both compute the same product of the same 8-bit values; they differ by the GEMM's
  accumulation order only.
- backward (straight-through over both quantisers): grad_input = grad_out @ W, with W the
  dequantised weight the forward multiplied; grad_weight = grad_out^T @ x with the
  unquantised activations, in their dtype (a high-precision weight gradient: the master gets
  it through the usual reduce-scatter in `reduce_dtype`); grad_bias = grad_out summed.
Nothing else changes: the gradient lands on the unsharded parameter as any other. Under
`torch.compile` each such `F.linear` runs eagerly (a graph break; the rest compiles).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from veragged.quant.formats import FP32_SCALE, UE8M0, BlockFormat
from veragged.quant.reference import dequantize, quantize, scale_inv

__all__ = ["block_scaled_linear", "gemm_supported"]

_GEMM_TILE = 128


@functools.lru_cache(maxsize=None)
def _device_has_blockwise_gemm(index: int) -> bool:
    """cuBLASLt's 1x128 x 128x128 FP8 GEMM: SM90 with CUDA >= 12.9 and `F.scaled_mm`."""
    if not hasattr(F, "scaled_mm") or torch.version.cuda is None:
        return False
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 9) and torch.cuda.get_device_capability(index) == (9, 0)


def gemm_supported(x: torch.Tensor, weight_shape, fmt: BlockFormat) -> bool:
    """Whether `block_scaled_linear` multiplies `x` by a weight of `weight_shape` in `fmt` with
    `F.scaled_mm` ([Note: FP8 compute]); otherwise it runs the dequantised reference."""
    N, K = weight_shape
    return (x.is_cuda and fmt.format_id in (FP32_SCALE, UE8M0)
            and tuple(fmt.tile) == (_GEMM_TILE, _GEMM_TILE)
            and K % _GEMM_TILE == 0 and N % 16 == 0
            and _device_has_blockwise_gemm(x.device.index or 0))


def _scaled_mm(x2d: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
               fmt: BlockFormat) -> torch.Tensor:
    """x2d @ W^T by `F.scaled_mm` (BlockWise1x128 x BlockWise128x128); `data` [N, K] E4M3,
    `scales` [N/128, round_up(K/128, 4)] fp32 ([Note: FP8 compute])."""
    M = x2d.shape[0]
    pad = -M % 4
    xp = F.pad(x2d, (0, 0, 0, pad)) if pad else x2d
    act = fmt.activation_format()
    a, a_scales = quantize(xp, act)
    a_scales = scale_inv(a_scales, act).t().contiguous().t()  # M-major
    out = F.scaled_mm(a.view(torch.float8_e4m3fn), data.t(), a_scales,
                      F.ScalingType.BlockWise1x128, scales.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=x2d.dtype)
    return out[:M] if pad else out


class _BlockScaledLinear(torch.autograd.Function):
    """[Note: FP8 compute]: forward in FP8 (or its exact reference), straight-through
    backward. `weight` is a `BlockScaledWeight` (or, for a reference model, any tensor with
    the dequantised values: `operands` None)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fmt, operands):
        w = getattr(weight, "dequantized", weight)
        x2d = x.reshape(-1, x.shape[-1])
        if operands is not None and gemm_supported(x2d, w.shape, fmt):
            out = _scaled_mm(x2d, *operands(), fmt)
            if bias is not None:
                out = out + bias
        else:
            act = fmt.activation_format()
            xq = dequantize(*quantize(x2d, act), act, x2d.dtype)
            out = F.linear(xq, w, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        w = getattr(weight, "dequantized", weight)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g.mm(w.to(g.dtype)).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t().mm(x.reshape(-1, x.shape[-1]).to(g.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


# Under torch.compile this runs eagerly (a graph break at each such F.linear; the rest of the
# model compiles): traced, the autograd Function would see the weight's dequantised tensor as
# the graph input and the gradient would never reach the BlockScaledWeight parameter.
@torch.compiler.disable
def block_scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        fmt: BlockFormat, operands=None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with x quantised in `fmt.activation_format()` blocks and the
    weight's 8-bit values ([Note: FP8 compute]). `weight`: a `BlockScaledWeight`, or a tensor
    holding the dequantised weight (a reference model); `operands`: a callable returning the
    weight's (E4M3 data [N, K], GEMM-layout fp32 scales), or None for the reference path."""
    if weight.dim() != 2:
        raise ValueError(f"block_scaled_linear: weight must be 2-D, got {list(weight.shape)}")
    return _BlockScaledLinear.apply(x, weight, bias, fmt, operands)
