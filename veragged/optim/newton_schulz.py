"""Muon's matrix math: quintic Newton-Schulz orthogonalisation and the learning-rate scale.

The arithmetic is torch.optim.Muon's (`torch/optim/_muon.py`) op for op, so on the same matrix,
dtype and thread count the result is bitwise the same; distributed Muon runs this function on
the owner rank's gathered matrix and therefore matches a single process bitwise.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from veragged.optim.batched import aligned_stack, enabled
from veragged.runtime import caches

__all__ = ["orthogonalize", "orthogonalize_batch", "interleave", "adjusted_lr",
           "DEFAULT_COEFFICIENTS"]

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
    split_repeat: int = 1,
) -> list[torch.Tensor]:
    """Orthogonalised row blocks of the 2-D `update` (one block: the whole matrix).

    `split_sizes` (rows per block, summing to `update.size(0)`) orthogonalises each row block on
    its own, e.g. the q, k and v blocks of a fused QKV weight. With `split_repeat` k the
    pattern repeats k times down the rows (sum(split_sizes) * k rows): block j is part j of
    every repetition, rows in order, as layouts that interleave their parts keep them (per-head
    q, k, v: `(head_dim,) * 3` repeated `heads` times; gate and up row by row: `(1, 1)`
    repeated `hidden` times). Returns one `dtype` matrix per block, in block order.
    """
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {list(update.shape)}")
    if split_sizes and split_repeat > 1:
        parts = update.view(split_repeat, sum(split_sizes), update.size(1))
        blocks, start = [], 0
        for s in split_sizes:  # a copy: the block's rows, contiguous, as a matrix of its own
            blocks.append(parts[:, start:start + s].reshape(split_repeat * s, update.size(1)))
            start += s
    else:
        blocks = update.split(list(split_sizes), 0) if split_sizes else (update,)
    return [_newton_schulz(b, coefficients, steps, eps, dtype) for b in blocks]


def interleave(blocks: Sequence[torch.Tensor], split_sizes: Sequence[int],
               split_repeat: int) -> torch.Tensor:
    """The flat matrix whose rows are `blocks` laid out as `orthogonalize` cut them: block
    j's rows back into part j of every repetition."""
    cols = blocks[0].size(1)
    out = blocks[0].new_empty(split_repeat, sum(split_sizes), cols)
    start = 0
    for b, s in zip(blocks, split_sizes):
        out[:, start:start + s].copy_(b.view(split_repeat, s, cols))
        start += s
    return out.reshape(-1)


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



# [Note: batched Newton-Schulz]
# Newton-Schulz is the longest chain of owner products (three per iteration, fifteen per
# matrix), so an owner's same-shape matrices run it batched (bmm / baddbmm over a stack) where
# that changes no bit, under the rules of [Note: batched owner products]: each (shape, count,
# dtype, device, iteration, thread count) is probed once per process, the whole iteration
# batched against `_newton_schulz` one by one, and batched only if every result is bitwise
# the same (on this CPU, MKL: 7 x 5 and 6 x 10 are not, 33 x 17 and larger are). The
# normalisation divides each matrix by its own norm computed alone (a batched norm reduces in
# another order).

_BATCHABLE: dict = caches.register("optim.newton_schulz probe verdicts", {})


def _newton_schulz_batch(gs: Sequence[torch.Tensor], coefficients: Sequence[float], steps: int,
                         eps: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """`_newton_schulz` of each same-shape `gs[i]`, the products batched."""
    a, b, c = coefficients
    tall = gs[0].size(0) > gs[0].size(1)
    x = aligned_stack([g.to(dtype=dtype) for g in gs])
    if tall:
        x = x.transpose(1, 2)
    norms = torch.stack([xi.norm() for xi in x]).clamp(min=eps)
    x.div_(norms.view(-1, 1, 1))
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(1, 2))
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return list((x.transpose(1, 2) if tall else x).unbind(0))


def _batchable(shape, n: int, coefficients, steps: int, eps: float, dtype, device) -> bool:
    key = (tuple(shape), n, tuple(coefficients), steps, eps, dtype, device,
           torch.get_num_threads())
    ok = _BATCHABLE.get(key)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        probe = [torch.randn(shape, generator=g, device=device) for _ in range(n)]
        alone = [_newton_schulz(x, coefficients, steps, eps, dtype) for x in probe]
        batched = _newton_schulz_batch(probe, coefficients, steps, eps, dtype)
        ok = _BATCHABLE[key] = all(torch.equal(u, v) for u, v in zip(alone, batched))
    return ok


def orthogonalize_batch(
    updates: Sequence[torch.Tensor],
    *,
    coefficients: Sequence[float] = DEFAULT_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """`orthogonalize(u)[0]` of every 2-D `u` of `updates`, bitwise: the matrices of each
    shape in one batch where that is bitwise the same, one by one elsewhere ([Note: batched
    Newton-Schulz])."""
    out: list = [None] * len(updates)
    by_shape: dict = {}
    for i, u in enumerate(updates):
        by_shape.setdefault(tuple(u.shape), []).append(i)
    for shape, idx in by_shape.items():
        gs = [updates[i] for i in idx]
        if len(idx) > 1 and 0 not in shape and enabled() and _batchable(
                shape, len(idx), coefficients, steps, eps, dtype, gs[0].device):
            results = _newton_schulz_batch(gs, coefficients, steps, eps, dtype)
        else:
            results = [_newton_schulz(g, coefficients, steps, eps, dtype) for g in gs]
        for i, r in zip(idx, results):
            out[i] = r
    return out
