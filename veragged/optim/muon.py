"""`veragged.optim.Muon`: Muon for 2-D parameters and AdamW for the rest, sharded or not."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from veragged.optim.common import local
from veragged.optim.engine import Matrix, MatrixOptimizer
from veragged.optim.newton_schulz import (
    ADJUST_LR_FNS,
    DEFAULT_COEFFICIENTS,
    adjusted_lr,
    interleave,
    orthogonalize,
    orthogonalize_batch,
)
from veragged.optim.pieces import MatrixLayout

__all__ = ["Muon"]


def _row_ranges(splits, scales, repeat: int) -> list[tuple[int, int, float]]:
    """(first row, end row, lr scale) of the blocks' rows in row order, `splits` repeated
    `repeat` times; neighbours of the same scale merged (interleaved parts of one scale, such
    as gate and up, make one range)."""
    out: list = []
    start = 0
    for _ in range(repeat):
        for rows, scale in zip(splits, scales):
            if out and out[-1][2] == scale and out[-1][1] == start:
                out[-1] = (out[-1][0], start + rows, scale)
            else:
                out.append((start, start + rows, scale))
            start += rows
    return out


def _local_blocks(layout: MatrixLayout, shape, splits, scales, repeat: int = 1) -> tuple:
    """The element ranges of each row block (`splits` rows, lr `scales`, the pattern repeated
    `repeat` times) in this rank's piece of a matrix ([Note: optimizer pieces on N-D meshes]):
    an interval [off, off + n) of the flat matrix, or runs that are whole rows (TP Shard(1): row
    `off // cols + k` is run k)."""
    r = layout.rank
    off, count, length = layout.offsets[r], layout.counts[r], layout.lengths[r]
    size, cols = count * length, shape[1]
    ranges = _row_ranges(splits, scales, repeat)
    if len(ranges) == 1:  # one scale: the whole piece
        return ((0, size, scales[0]),) if size else ()
    out = []
    for lo, hi, scale in ranges:
        if count <= 1:
            b, e = max(lo * cols, off) - off, min(hi * cols, off + size) - off
        else:
            first = off // cols
            b = (max(lo, first) - first) * length
            e = (min(hi, first + count) - first) * length
        if b < e:
            out.append((b, e, scale))
    return tuple(out)


class Muon(MatrixOptimizer):
    """Muon (momentum, then Newton-Schulz orthogonalisation) with AdamW for non-matrix params.

    Semantics follow `torch.optim.Muon` (and Keller Jordan's reference) per 2-D parameter:
    EMA momentum `m <- lerp(m, g, 1 - momentum)`; with `nesterov` the update is
    `lerp(g, m, momentum)`, else `m`; the quintic Newton-Schulz iteration with `ns_coefficients`
    runs `ns_steps` times on the update divided by its Frobenius norm (clamped at `eps`), on the
    transpose for tall matrices, in `ns_dtype` (default bfloat16 on CUDA and float32 on CPU,
    where bfloat16 matmuls are slow; with bfloat16 the result equals torch.optim.Muon's
    bitwise); then `p <- p * (1 - lr * weight_decay) - adjusted_lr * O` with
    `adjust_lr_fn` None/"original": `lr * sqrt(max(1, A/B))`, "match_rms_adamw":
    `lr * 0.2 * sqrt(max(A, B))` or "spectral_unclamped": `lr * sqrt(A/B)` for an A x B matrix.

    Param groups may set:
      - `use_muon`: True/False for the whole group; default (None): parameters of 2 dims or
        more use Muon (more: a stack of matrices over the leading dims, e.g. [E, out, in]
        experts, each expert orthogonalised as a matrix of its own: [Note: matrices of a
        stack]), 1-D ones AdamW. Embeddings and output heads are 2-D, conv kernels 4-D: put
        them in a group with `use_muon=False`, as the Muon authors recommend.
      - `matrix_dims`: (-2, -1) (default) or (-1, -2) for stacks stored transposed
        ([E, in, out]).
      - `split_sizes`: rows per block (summing to the rows of every matrix in the group): each
        row block, e.g. q, k and v of a fused QKV weight, is orthogonalised and lr-scaled as a
        matrix of its own; `split_repeat` k: layouts that interleave their parts, the pattern
        repeated k times down the rows, block j being part j of every repetition (per-head
        q, k, v: `split_sizes=(head_dim,) * 3, split_repeat=heads`; gate and up interleaved
        row by row: `split_sizes=(1, 1), split_repeat=hidden`).
      - AdamW's `betas` and `adamw_eps` (weight decay is decoupled, math in torch.optim.AdamW's
        order, bitwise equal to `torch.optim.AdamW(foreach=False)`), and any Muon hyper-parameter.

    Distributed (DTensor parameters: veragged's RaggedShard or torch's Shard(0) on one mesh dim,
    and FSDP over tensor parallelism on a (dp, tp) or HSDP (replicate, dp, tp) mesh: TP Shard(0)
    with StridedRaggedShard, TP Shard(1) with RaggedShard, TP Replicate; any placements of
    [Note: optimizer pieces on N-D meshes]): momentum runs on the local shards; each matrix's
    domain (the mesh dims that shard it, e.g. dp x tp) is one process group, on which every
    matrix has an owner (host) rank from a deterministic plan (`owners`: "lpt" greedy LPT over
    Newton-Schulz FLOPs with loads carried across micro-groups, "local" the same around the
    matrices a rank holds whole, which are computed where they lie (`locality_slack`), "alpha"
    Canzona's alpha-balanced contiguous partition per param group, "naive" round robin, "layer"
    whole param groups per rank (the layer-wise baseline), or "replicated": every rank gathers and
    orthogonalises every matrix); matrices travel to their owners in micro-groups, one
    all-to-all each over the domain group, the update comes back the same way, and the next
    micro-group's transfer overlaps the current one's Newton-Schulz ([Note: Muon matrix
    exchange]). The owner runs the same kernels as one process would, so
    the result is bitwise the single-process one.
    `owner_plans` holds the plan per domain group (`ratio` is its max/mean load). `split_sizes`
    blocks are rows of the global matrix, whatever TP cut: the owner orthogonalises them apart on
    the whole matrix and each rank scales its part of every block by that block's lr.

    grad=None: see [Note: symmetric grad presence]: a parameter no rank has a gradient for is
    skipped, one some rank has is stepped everywhere with zeros for missing shards; how the
    ranks agree is `grad_agreement`'s ("auto", "mesh" or "local").
    """

    _NAME = "Muon"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Sequence[float] = DEFAULT_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        *,
        ns_dtype: torch.dtype | None = None,
        owners: str = "lpt",
        cost: str = "flops",
        alpha: float = 1.0,
        capacity: int | None = None,
        locality_slack: float = 0.05,
        grad_agreement: str = "auto",
    ):
        if cost not in ("flops", "numel"):
            raise ValueError(f"Muon: cost must be 'flops' or 'numel', got {cost!r}")
        self.ns_dtype, self.cost = ns_dtype, cost
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, betas=tuple(betas), adamw_eps=adamw_eps,
            use_muon=None, split_sizes=None, split_repeat=1,
        )
        super().__init__(params, defaults, owners=owners, alpha=alpha, capacity=capacity,
                         locality_slack=locality_slack,
                         grad_agreement=grad_agreement)

    # --- engine hooks ([Note: matrix optimizer engine]) -----------------------------------------

    def _is_matrix(self, group: dict, p: torch.Tensor) -> bool:
        return p.ndim >= 2 if group["use_muon"] is None else bool(group["use_muon"])

    def _validate_group(self, group: dict) -> None:
        _validate(group)

    def _check_one(self, group: dict, shape: tuple[int, int], index: str) -> None:
        split, repeat = group["split_sizes"], group["split_repeat"]
        if split is not None and sum(split) * repeat != shape[0]:
            raise ValueError(
                f"split_sizes={list(split)} repeated split_repeat={repeat} times must cover "
                f"the rows of every matrix of the group; {index} has matrices of shape "
                f"{list(shape)}"
            )
        if split is not None and tuple(group["matrix_dims"]) == (-1, -2):
            raise ValueError(f"Muon: split_sizes with matrix_dims=(-1, -2) ({index}): split "
                             "rows of matrices stored transposed are not supported")

    def _init_state(self, p: torch.Tensor, group: dict, matrix: bool) -> None:
        # State exists for every parameter on every rank from the start (checkpoints see
        # the same keys everywhere, and the first step allocates nothing).
        state = self.state[p]
        if matrix:
            state.setdefault("momentum_buffer", torch.zeros_like(p))
        else:
            state.setdefault("step", torch.tensor(0.0))
            state.setdefault("exp_avg", torch.zeros_like(p))
            state.setdefault("exp_avg_sq", torch.zeros_like(p))

    def _plan_options(self, group: dict) -> dict:
        return dict(cost=self.cost)

    def _plan_blocks(self, m: Matrix):
        split = m.group["split_sizes"]
        return None if not split else [s * m.group["split_repeat"] for s in split]

    def _make_extra(self, m: Matrix):
        rows, cols = m.shape
        group = m.group
        splits = tuple(group["split_sizes"] or (rows,))
        repeat = group["split_repeat"] if group["split_sizes"] else 1
        scales = [adjusted_lr(1.0, group["adjust_lr_fn"], r * repeat, cols) for r in splits]
        return _local_blocks(m.layout, m.shape, splits, scales, repeat)

    def _prepare(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> torch.Tensor:
        """Momentum and weight decay on the local shard; returns the update to orthogonalise."""
        mu = group["momentum"]
        buf = local(self.state[p]["momentum_buffer"])
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf
        local(p).mul_(1 - group["lr"] * group["weight_decay"])
        return update

    def _update_dtype(self, device: torch.device) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def _compute(self, m: Matrix, full: torch.Tensor) -> torch.Tensor:
        """The flat, contiguous orthogonalised update of matrix `m` from its full flat values."""
        g = m.group
        repeat = g["split_repeat"]
        blocks = orthogonalize(
            m.as_matrix(full),
            split_sizes=g["split_sizes"],
            coefficients=g["ns_coefficients"],
            steps=g["ns_steps"],
            eps=g["eps"],
            dtype=self._update_dtype(full.device),
            split_repeat=repeat,
        )
        if len(blocks) == 1:
            return m.to_flat(blocks[0])
        if repeat > 1:
            return interleave(blocks, g["split_sizes"], repeat)
        return torch.cat([b.reshape(-1) for b in blocks])

    def _compute_many(self, ms: list[Matrix], fulls: list[torch.Tensor]) -> list:
        """Matrices without `split_sizes` orthogonalised in same-shape batches where that is
        bitwise the same ([Note: batched Newton-Schulz]); the others one by one."""
        out: list = [None] * len(ms)
        batches: dict = {}
        for k, (m, full) in enumerate(zip(ms, fulls)):
            g = m.group
            if g["split_sizes"]:
                out[k] = self._compute_aligned(m, full)
                continue
            key = (g["ns_coefficients"], g["ns_steps"], g["eps"], self._update_dtype(full.device))
            batches.setdefault(key, []).append(k)
        for (coefficients, steps, eps, dtype), idx in batches.items():
            results = orthogonalize_batch([ms[k].as_matrix(fulls[k]) for k in idx],
                                          coefficients=coefficients, steps=steps, eps=eps,
                                          dtype=dtype)
            for k, r in zip(idx, results):
                out[k] = ms[k].to_flat(r)
        return out

    def _apply(self, m: Matrix, piece: torch.Tensor) -> None:
        """p -= lr_block * update on this rank's piece, `piece` being the update's elements
        there (flat, in the local tensor's order)."""
        flat = m.local(m.param)
        lr = m.group["lr"]
        for begin, end, scale in m.extra:
            flat[begin:end].add_(piece[begin:end], alpha=-lr * scale)

    def _step_elementwise(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        _adamw(p, g, self.state[p], group)


def _adamw(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.AdamW's single-tensor step on the local shard (elementwise, so a shard's
    result is the full tensor's)."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["adamw_eps"]
    beta1, beta2 = group["betas"]
    param, exp_avg, exp_avg_sq = local(p), local(state["exp_avg"]), local(state["exp_avg_sq"])
    step_t = state["step"]
    step_t += 1
    if wd != 0:
        param.mul_(1 - lr * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step = step_t.item()
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def _validate(group: dict) -> None:
    checks = [
        ("lr", group["lr"] >= 0),
        ("weight_decay", group["weight_decay"] >= 0),
        ("momentum", 0 <= group["momentum"] < 1),
        ("ns_steps", isinstance(group["ns_steps"], int) and 0 < group["ns_steps"] < 100),
        ("eps", group["eps"] >= 0),
        ("adamw_eps", group["adamw_eps"] >= 0),
        ("ns_coefficients", len(group["ns_coefficients"]) == 3),
        ("betas", len(group["betas"]) == 2 and all(0 <= b < 1 for b in group["betas"])),
        ("adjust_lr_fn", group["adjust_lr_fn"] in ADJUST_LR_FNS),
    ]
    for name, ok in checks:
        if not ok:
            raise ValueError(f"Muon: invalid {name}={group[name]!r}")
    split = group["split_sizes"]
    if split is not None and (not split or any(int(s) <= 0 for s in split)):
        raise ValueError(f"Muon: split_sizes must be positive row counts, got {split!r}")
    repeat = group["split_repeat"]
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"Muon: split_repeat must be a positive int, got {repeat!r}")
