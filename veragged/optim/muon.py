"""`veragged.optim.Muon`: Muon for 2-D parameters and AdamW for the rest, sharded or not."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch.optim import Optimizer

from veragged.optim.common import GradPresence, check_grad_agreement, local, local_grads
from veragged.optim.exchange import Exchange, MatrixLayout, matrix_layout
from veragged.optim.newton_schulz import DEFAULT_COEFFICIENTS, adjusted_lr, orthogonalize
from veragged.optim.owners import OwnerPlan, plan_owners
from veragged.optim.pieces import check_placements
from veragged.placement.collectives import all_gather

__all__ = ["Muon"]

STRATEGIES = ("lpt", "alpha", "naive", "replicated")


@dataclass
class _Matrix:
    """One Muon parameter as the step sees it."""

    param: torch.Tensor
    group: dict[str, Any]
    layout: MatrixLayout
    blocks: tuple[tuple[int, int, float], ...]  # per row block met locally: local [b, e), lr scale

    def apply(self, piece: torch.Tensor, lr: float) -> None:
        """p -= lr_block * update on this rank's piece, `piece` being the update's elements
        there (flat, in the local tensor's order)."""
        flat = local(self.param).view(-1)
        for begin, end, scale in self.blocks:
            flat[begin:end].add_(piece[begin:end], alpha=-lr * scale)


def _local_blocks(layout: MatrixLayout, shape, splits, scales) -> tuple:
    """The local element ranges of each row block (`splits` rows, lr `scales`) in this rank's
    piece ([Note: optimizer pieces on N-D meshes]): an interval [off, off + n) of the flat
    matrix, or runs that are whole rows (TP Shard(1): row `off // cols + k` is run k)."""
    r = layout.rank
    off, count, length = layout.offsets[r], layout.counts[r], layout.lengths[r]
    size, cols = count * length, shape[1]
    out, start = [], 0
    for rows, scale in zip(splits, scales):
        lo, hi = start, start + rows
        start = hi
        if count <= 1:
            b, e = max(lo * cols, off) - off, min(hi * cols, off + size) - off
        else:
            first = off // cols
            b = (max(lo, first) - first) * length
            e = (min(hi, first + count) - first) * length
        if b < e:
            out.append((b, e, scale))
    return tuple(out)


@dataclass
class _Domain:
    """The Muon matrices of one domain process group (None: whole on every rank) and their plan."""

    matrices: list[_Matrix]
    plan: OwnerPlan | None
    exchange: Exchange | None


class Muon(Optimizer):
    """Muon (momentum, then Newton-Schulz orthogonalisation) with AdamW for non-matrix params.

    Semantics follow `torch.optim.Muon` (and Keller Jordan's reference) per 2-D parameter:
    EMA momentum `m <- lerp(m, g, 1 - momentum)`; with `nesterov` the update is
    `lerp(g, m, momentum)`, else `m`; the quintic Newton-Schulz iteration with `ns_coefficients`
    runs `ns_steps` times on the update divided by its Frobenius norm (clamped at `eps`), on the
    transpose for tall matrices, in `ns_dtype` (default bfloat16 on CUDA and float32 on CPU,
    where bfloat16 matmuls are slow; with bfloat16 the result equals torch.optim.Muon's
    bitwise); then `p <- p * (1 - lr * weight_decay) - adjusted_lr * O` with
    `adjust_lr_fn` None/"original": `lr * sqrt(max(1, A/B))` or "match_rms_adamw":
    `lr * 0.2 * sqrt(max(A, B))` for an A x B matrix.

    Param groups may set:
      - `use_muon`: True/False for the whole group; default (None): 2-D parameters use Muon,
        all others AdamW. Embeddings and output heads are 2-D: put them in a group with
        `use_muon=False`, as the Muon authors recommend.
      - `split_sizes`: rows per block (summing to the rows of every matrix in the group): each
        row block, e.g. q, k and v of a fused QKV weight, is orthogonalised and lr-scaled as a
        matrix of its own.
      - AdamW's `betas` and `adamw_eps` (weight decay is decoupled, math in torch.optim.AdamW's
        order, bitwise equal to `torch.optim.AdamW(foreach=False)`), and any Muon hyper-parameter.

    Distributed (DTensor parameters: veragged's RaggedShard or torch's Shard(0) on one mesh dim,
    and FSDP over tensor parallelism on a (dp, tp) or HSDP (replicate, dp, tp) mesh: TP Shard(0)
    with StridedRaggedShard, TP Shard(1) with RaggedShard, TP Replicate; any placements of
    [Note: optimizer pieces on N-D meshes]): momentum runs on the local shards; each matrix's
    domain (the mesh dims that shard it, e.g. dp x tp) is one process group, on which every
    matrix has an owner (host) rank from a deterministic plan (`owners`: "lpt" greedy LPT over
    Newton-Schulz FLOPs with loads carried across micro-groups, "alpha" Canzona's
    alpha-balanced contiguous partition per param group, "naive" round robin, or "replicated":
    every rank gathers and orthogonalises every matrix); matrices travel to their owners in
    micro-groups, one all-to-all each over the domain group, the update comes back the same
    way, and the next micro-group's transfer overlaps the current one's Newton-Schulz
    ([Note: Muon matrix exchange]). The owner runs the same kernels as one process would, so
    the result is bitwise the single-process one.
    `owner_plans` holds the plan per domain group (`ratio` is its max/mean load). `split_sizes`
    blocks are rows of the global matrix, whatever TP cut: the owner orthogonalises them apart on
    the whole matrix and each rank scales its part of every block by that block's lr.

    grad=None: see [Note: symmetric grad presence]: a parameter no rank has a gradient for is
    skipped, one some rank has is stepped everywhere with zeros for missing shards; how the
    ranks agree is `grad_agreement`'s ("auto", "mesh" or "local").
    """

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
        grad_agreement: str = "auto",
    ):
        self.grad_agreement = check_grad_agreement("Muon", grad_agreement)
        if owners not in STRATEGIES:
            raise ValueError(f"owners must be one of {STRATEGIES}, got {owners!r}")
        self.ns_dtype, self.owners, self.cost = ns_dtype, owners, cost
        self.alpha, self.capacity = alpha, capacity
        self.owner_plans: list[OwnerPlan] = []
        self._domains: list[_Domain] | None = None
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, betas=tuple(betas), adamw_eps=adamw_eps,
            use_muon=None, split_sizes=None,
        )
        super().__init__(params, defaults)

    # --- groups and state ----------------------------------------------------------------------

    @staticmethod
    def _uses_muon(group: dict, p: torch.Tensor) -> bool:
        return p.ndim == 2 if group["use_muon"] is None else bool(group["use_muon"])

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate(group)
        for i, p in enumerate(group["params"]):
            muon = self._uses_muon(group, p)
            if muon and p.ndim != 2:
                raise ValueError(
                    f"use_muon=True needs 2-D parameters; param {i} of group "
                    f"{len(self.param_groups) - 1} has shape {list(p.shape)}"
                )
            split = group["split_sizes"]
            if muon and split is not None and sum(split) != p.shape[0]:
                raise ValueError(
                    f"split_sizes={list(split)} must sum to the rows of every matrix of the "
                    f"group; param {i} has shape {list(p.shape)}"
                )
            if muon:
                check_placements(p)  # unsupported placements raise here, not at the first step
            # State exists for every parameter on every rank from the start (checkpoints see
            # the same keys everywhere, and the first step allocates nothing).
            state = self.state[p]
            if muon:
                state.setdefault("momentum_buffer", torch.zeros_like(p))
            else:
                state.setdefault("step", torch.tensor(0.0))
                state.setdefault("exp_avg", torch.zeros_like(p))
                state.setdefault("exp_avg_sq", torch.zeros_like(p))
        self._domains = None  # the owner plan covers all groups: rebuild it

    # --- the plan ------------------------------------------------------------------------------

    def _matrix(self, group: dict, p: torch.Tensor) -> _Matrix:
        rows, cols = p.shape
        splits = tuple(group["split_sizes"] or (rows,))
        scales = [adjusted_lr(1.0, group["adjust_lr_fn"], r, cols) for r in splits]
        layout = matrix_layout(p)
        return _Matrix(p, group, layout, _local_blocks(layout, p.shape, splits, scales))

    def _build_domains(self) -> list[_Domain]:
        by_group: dict[Any, list[_Matrix]] = {}
        buckets: dict[Any, list[int]] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if self._uses_muon(group, p):
                    m = self._matrix(group, p)
                    by_group.setdefault(m.layout.group, []).append(m)
                    buckets.setdefault(m.layout.group, []).append(gi)
        domains, self.owner_plans = [], []
        for pg, matrices in by_group.items():  # first-appearance order: the same on every rank
            if pg is None or self.owners == "replicated":
                domains.append(_Domain(matrices, None, None))
                continue
            plan = plan_owners(
                [tuple(m.param.shape) for m in matrices],
                matrices[0].layout.world,
                strategy=self.owners,
                cost=self.cost,
                alpha=self.alpha,
                capacity=self.capacity,
                split_sizes=[m.group["split_sizes"] for m in matrices],
                buckets=buckets[pg],
            )
            self.owner_plans.append(plan)
            exchange = Exchange(pg, [m.layout for m in matrices], plan.owners)
            domains.append(_Domain(matrices, plan, exchange))
        return domains

    # --- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._domains is None:
            self._domains = self._build_domains()
        params = [p for g in self.param_groups for p in g["params"]]
        presence = GradPresence(params, self.grad_agreement)
        grads = dict(zip(map(id, params), local_grads(params, presence.verdicts())))
        updates: dict[int, torch.Tensor] = {}  # id(param) -> local momentum update
        for group in self.param_groups:
            for p in group["params"]:
                g = grads[id(p)]
                if g is None:
                    continue
                if self._uses_muon(group, p):
                    updates[id(p)] = self._momentum(p, g, group)
                else:
                    _adamw(p, g, self.state[p], group)
        for domain in self._domains:
            if domain.exchange is None:
                self._step_whole(domain, updates)
            else:
                self._step_owned(domain, updates)
        presence.finish()
        return loss

    def _momentum(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> torch.Tensor:
        """Momentum and weight decay on the local shard; returns the update to orthogonalise."""
        mu = group["momentum"]
        buf = local(self.state[p]["momentum_buffer"])
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf
        local(p).mul_(1 - group["lr"] * group["weight_decay"])
        return update

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def _orthogonalize(self, m: _Matrix, full: torch.Tensor) -> torch.Tensor:
        """The flat, contiguous orthogonalised update of matrix `m` from its full flat values."""
        g = m.group
        blocks = orthogonalize(
            full.view(m.param.shape),
            split_sizes=g["split_sizes"],
            coefficients=g["ns_coefficients"],
            steps=g["ns_steps"],
            eps=g["eps"],
            dtype=self._ns_dtype(full.device),
        )
        if len(blocks) == 1:
            return blocks[0].reshape(-1)
        return torch.cat([b.reshape(-1) for b in blocks])

    def _step_whole(self, domain: _Domain, updates: dict[int, torch.Tensor]) -> None:
        """Matrices every rank has whole (plain tensors, replicated DTensors), or with
        owners="replicated": gather each to every rank and orthogonalise it everywhere."""
        for m in domain.matrices:
            u = updates.get(id(m.param))
            if u is None:
                continue
            lay = m.layout
            if lay.group is not None:
                bounds = (0, *itertools.accumulate(lay.sizes))  # pieces in rank order
                u = all_gather(u, bounds, lay.group, (lay.numel,)).finish()
                if not lay.in_rank_order:
                    u = lay.assemble(u.split(lay.sizes))
            ortho = self._orthogonalize(m, u.reshape(-1))
            m.apply(lay.mine(ortho) if lay.group is not None else ortho, m.group["lr"])

    def _step_owned(self, domain: _Domain, updates: dict[int, torch.Tensor]) -> None:
        """Owners orthogonalise; micro-groups pipelined ([Note: Muon matrix exchange])."""
        ex, matrices = domain.exchange, domain.matrices
        index = {id(m.param): i for i, m in enumerate(matrices)}
        groups = [
            [i for i in group if id(matrices[i].param) in updates] for group in domain.plan.groups
        ]
        groups = [g for g in groups if g]  # the same on every rank (the mask is symmetric)
        if not groups:
            return
        pieces = {index[k]: u for k, u in updates.items() if k in index}
        device = next(iter(pieces.values())).device
        like = torch.empty(0, dtype=self._ns_dtype(device), device=device)
        gathering = ex.gather(groups[0], pieces)
        scattering = None
        for k, items in enumerate(groups):
            fulls = gathering.wait()
            if k + 1 < len(groups):
                gathering = ex.gather(groups[k + 1], pieces)
            ortho = {i: self._orthogonalize(matrices[i], f) for i, f in fulls.items()}
            launched = ex.scatter(items, ortho, like)
            if scattering is not None:
                self._apply(matrices, scattering)
            scattering = launched
        self._apply(matrices, scattering)

    @staticmethod
    def _apply(matrices: list[_Matrix], scattering) -> None:
        for i, piece in scattering.wait().items():
            matrices[i].apply(piece, matrices[i].group["lr"])


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
        ("adjust_lr_fn", group["adjust_lr_fn"] in (None, "original", "match_rms_adamw")),
    ]
    for name, ok in checks:
        if not ok:
            raise ValueError(f"Muon: invalid {name}={group[name]!r}")
    split = group["split_sizes"]
    if split is not None and (not split or any(int(s) <= 0 for s in split)):
        raise ValueError(f"Muon: split_sizes must be positive row counts, got {split!r}")
