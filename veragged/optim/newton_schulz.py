"""Muon's matrix math: quintic Newton-Schulz orthogonalisation and the learning-rate scale.

The arithmetic is torch.optim.Muon's (`torch/optim/_muon.py`) op for op, so on the same matrix,
dtype and thread count the result is bitwise the same; distributed Muon runs this function on
the owner rank's gathered matrix and therefore matches a single process bitwise.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["orthogonalize", "adjusted_lr", "DEFAULT_COEFFICIENTS"]

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


def _newton_schulz(
    g: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """X <- aX + (bA + cA^2)X with A = XX^T, `steps` times, on g / ||g||_F (wide orientation)."""
    a, b, c = coefficients
    x = g.to(dtype=dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def orthogonalize(
    update: torch.Tensor,
    *,
    split_sizes: Sequence[int] | None = None,
    coefficients: Sequence[float] = DEFAULT_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """Orthogonalised row blocks of the 2-D `update` (one block: the whole matrix).

    `split_sizes` (rows per block, summing to `update.size(0)`) orthogonalises each row block on
    its own, e.g. the q, k and v blocks of a fused QKV weight. Returns one `dtype` matrix per
    block, in row order.
    """
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {list(update.shape)}")
    blocks = update.split(list(split_sizes), 0) if split_sizes else (update,)
    return [_newton_schulz(b, coefficients, steps, eps, dtype) for b in blocks]


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate scale for an A x B (block of a) matrix.

    "original" (None): lr * sqrt(max(1, A/B)); "match_rms_adamw": lr * 0.2 * sqrt(max(A, B)), which
    gives the update the RMS of a typical AdamW update (Moonshot); "spectral_unclamped":
    lr * sqrt(A/B) (Bernstein's scaling, torch 2.15).
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    if adjust_lr_fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")

