"""`veragged.optim.SOAP`: Adam in the eigenbasis of Shampoo's Kronecker factors, sharded or not."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from veragged.optim.common import local
from veragged.optim.batched import chains
from veragged.optim.engine import Matrix, MatrixOptimizer, aligned_input
from veragged.optim.kronecker import eigenbasis, project, project_back, refresh_eigenbasis_into
from veragged.optim.refresh import AsyncRefresh

__all__ = ["SOAP"]


class SOAP(AsyncRefresh, MatrixOptimizer):
    """SOAP (Vyas et al. 2024, arXiv 2409.11321; nikhilvyas/SOAP's `soap.py`).

    Per 2-D parameter G (r x c) with Kronecker factors L (r x r) and R (c x c) and their
    eigenbases Q_L, Q_R (a side longer than `max_precond_dim` is not preconditioned: identity):
      - the first step only sets L = (1 - b) G G^T, R = (1 - b) G^T G (b = `shampoo_beta`, or
        `betas[1]` when negative) and Q_L, Q_R = eigh eigenvectors by descending eigenvalue; the
        parameter does not move (nor decay) on that step;
      - each later step t = 1, 2, ...: G' = Q_L^T G Q_R; Adam's moments in the eigenbasis
        M = b1 M + (1 - b1) G', V = b2 V + (1 - b2) G'^2; N = Q_L (M / (sqrt(V) + eps)) Q_R^T;
        p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * N (`correct_bias`, else lr * N); then the
        decoupled decay p -= lr * weight_decay * p; then L, R take G (the same EMA), and every
        `precondition_frequency` steps the bases are refreshed by one power iteration and QR
        (Q <- qr(F Q[:, order]), order by the estimated eigenvalues diag(Q^T F Q) descending),
        V's rows/columns are permuted by that order and M is rotated from the old basis into
        the new one. (The reference rotates M back and forth on every step; with an unchanged
        basis that is the identity up to round-off, so it is done only on a refresh.)
    Other parameters (1-D, both sides longer than `max_precond_dim`, or a group with
    `precondition=False`) take the same Adam steps in their own coordinates, elementwise on
    the local shard, also skipping their first step (as the reference does).

    Distributed: as Muon ([Note: matrix optimizer engine]): each matrix's gradient travels whole
    to its owner (plan cost model "soap"), which holds L, R, Q_L, Q_R, M and V whole
    ([Note: owner-resident state]) and returns N; every rank applies its piece.
    Param groups may set any hyper-parameter and `precondition` (None: 2-D parameters, False:
    Adam only).

    Background bases ([Note: asynchronous roots]): with `async_precondition=True` and
    `staleness=k` (0 <= k <= precondition_frequency) a refresh at step s (power iteration and QR
    from the factors after G_s and the basis then) runs on `async_workers` threads and is
    installed at step s + k exactly, after that step's update (V permuted, M rotated then);
    the first step's eigendecomposition stays inline. k = 0 refreshes inline (the default).
    """

    _NAME = "SOAP"

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1.0,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        correct_bias: bool = True,
        *,
        owners: str = "lpt",
        alpha: float = 1.0,
        capacity: int | None = None,
        locality_slack: float = 0.05,
        grad_agreement: str = "auto",
        async_precondition: bool = False,
        staleness: int = 0,
        async_workers: int = 1,
    ):
        self._init_async(async_precondition, staleness, async_workers)
        defaults = dict(
            lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
            weight_decay=weight_decay, precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim, correct_bias=correct_bias, precondition=None,
        )
        super().__init__(params, defaults, owners=owners, alpha=alpha, capacity=capacity,
                         locality_slack=locality_slack,
                         grad_agreement=grad_agreement)

    # --- engine hooks ([Note: matrix optimizer engine]) -----------------------------------------

    @staticmethod
    def _sides(group: dict, shape: tuple[int, int]) -> tuple[bool, bool]:
        d = group["max_precond_dim"]
        return shape[0] <= d, shape[1] <= d

    def _is_matrix(self, group: dict, p: torch.Tensor) -> bool:
        if group["precondition"] is False or p.ndim < 2:
            return False
        return any(self._sides(group, self._matrix_shape(group, p)))

    def _validate_group(self, group: dict) -> None:
        b1, b2 = group["betas"] if len(group["betas"]) == 2 else (-1, -1)
        checks = [
            ("lr", group["lr"] >= 0),
            ("betas", 0 <= b1 < 1 and 0 <= b2 < 1),
            ("shampoo_beta", group["shampoo_beta"] < 1),
            ("eps", group["eps"] >= 0),
            ("weight_decay", group["weight_decay"] >= 0),
            ("precondition_frequency", _positive_int(group["precondition_frequency"])),
            ("max_precond_dim", _positive_int(group["max_precond_dim"])),
            ("precondition", group["precondition"] in (None, False, True)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"SOAP: invalid {name}={group[name]!r}")
        self._check_staleness(group)

    def _init_state(self, p: torch.Tensor, group: dict, matrix: bool) -> None:
        state = self.state[p]
        state.setdefault("step", torch.tensor(0.0))  # calls so far; the first only initialises
        if not matrix:
            state.setdefault("exp_avg", torch.zeros_like(p))
            state.setdefault("exp_avg_sq", torch.zeros_like(p))

    def _owner_state(self, m: Matrix) -> dict:
        rows, cols = m.shape
        left, right = self._sides(m.group, m.shape)
        moment = ((rows, cols), torch.float32)
        out = {"exp_avg": moment, "exp_avg_sq": moment}
        if left:
            out["factor_left"] = ((rows, rows), torch.float32)
            out["basis_left"] = ((rows, rows), torch.float32)
        if right:
            out["factor_right"] = ((cols, cols), torch.float32)
            out["basis_right"] = ((cols, cols), torch.float32)
        if self.staleness:  # a refresh in flight ([Note: asynchronous roots])
            for side, n, there in (("left", rows, left), ("right", cols, right)):
                if there:
                    out[f"pending_basis_{side}"] = ((n, n), torch.float32)
                    out[f"pending_order_{side}"] = ((n,), torch.int64)
            out["pending_step"] = ((1,), torch.int64)
        return out

    def _refresh_at(self, m: Matrix, t: int) -> bool:
        return t > 0 and t % m.group["precondition_frequency"] == 0

    def _counter(self, m: Matrix) -> int:
        return int(self.state[m.param]["step"])

    def _plan_options(self, group: dict) -> dict:
        return dict(cost="soap", precondition_frequency=group["precondition_frequency"],
                    max_preconditioner_dim=group["max_precond_dim"])

    def _prepare(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> torch.Tensor:
        return g

    def _has_update(self, m: Matrix) -> bool:
        return bool(self.state[m.param]["step"] > 0)

    def _after_param(self, p: torch.Tensor) -> None:
        self.state[p]["step"] += 1

    def _compute(self, m: Matrix, full: torch.Tensor):
        return self._compute_many([m], [full])[0]

    def _compute_many(self, ms: list[Matrix], fulls: list[torch.Tensor]) -> list:
        """The updates of `ms` (None on a matrix's first step); each product (Q_L^T G Q_R,
        Q_L N Q_R^T, G G^T, G^T G) runs over every matrix at once, batched by shape where that
        is bitwise the one-by-one product ([Note: batched owner products]). Matrices are
        independent, so doing each product for all of them in turn is doing them one by one."""
        works = [_Work(self, m, aligned_input(full)) for m, full in zip(ms, fulls)]
        live = [w for w in works if w.t > 0]
        projected = chains([_chain(_t(w.ql), w.g, w.qr) for w in live])
        for w, x in zip(live, projected):  # Adam in the eigenbasis
            b1, b2 = w.m.group["betas"]
            exp_avg, exp_avg_sq = w.owned("exp_avg"), w.owned("exp_avg_sq")
            exp_avg.mul_(b1).add_(x, alpha=1 - b1)
            exp_avg_sq.mul_(b2).add_(x.square(), alpha=1 - b2)
            w.normalized = exp_avg / exp_avg_sq.sqrt().add_(w.m.group["eps"])
        updates = chains([_chain(w.ql, w.normalized, _t(w.qr)) for w in live])
        sides = [(w.fl, w, (w.g, w.g.T)) for w in works if w.fl is not None]
        sides += [(w.fr, w, (w.g.T, w.g)) for w in works if w.fr is not None]
        for (factor, w, _), gram in zip(sides, chains([c for _, _, c in sides])):
            factor.lerp_(gram, w.decay)  # L <- lerp(L, G G^T), R <- lerp(R, G^T G)
        for w in works:
            if w.t == 0:  # the first step only sets the factors and their bases
                for f, q in ((w.fl, w.ql), (w.fr, w.qr)):
                    if f is not None:
                        q.copy_(eigenbasis(f))
                continue
            install = self._due(w.m, w.t)  # the refresh of step t - staleness, then t's
            if install is not None and self._take(w.m, 0, install, w.t):
                _install(w, [(w.owned(f"pending_basis_{side}"), w.owned(f"pending_order_{side}"))
                             if f is not None else None for side, f in w.sides()])
            if self._refresh_at(w.m, w.t):
                self._submit_bases(w)
        out = {id(w): w.m.to_flat(u) for w, u in zip(live, updates)}
        return [out.get(id(w)) for w in works]

    def _submit_bases(self, w: _Work) -> None:
        """The new bases and their column orders from snapshots of the factors (after G_t)
        and the bases, into the pending state (in the background) or temporaries (inline,
        then installed now)."""
        inputs = [None if f is None else (f.clone(), q.clone())
                  for f, q in ((w.fl, w.ql), (w.fr, w.qr))]
        outs = []
        for (side, f), q in zip(w.sides(), (w.ql, w.qr)):
            if f is None:
                outs.append(None)
            elif self._roots is not None:
                outs.append((w.owned(f"pending_basis_{side}"), w.owned(f"pending_order_{side}")))
            else:
                outs.append((torch.empty_like(q), torch.empty(q.size(0), dtype=torch.int64,
                                                                device=q.device)))

        def run() -> None:
            for snapshot, out in zip(inputs, outs):
                if snapshot is not None:
                    refresh_eigenbasis_into(*out, *snapshot)

        self._submit(w.m, 0, w.t, run)
        if self._roots is None:
            _install(w, outs)

    def _step_size(self, group: dict, t: int) -> float:
        if not group["correct_bias"]:
            return group["lr"]
        b1, b2 = group["betas"]
        return group["lr"] * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)

    def _apply(self, m: Matrix, piece: torch.Tensor) -> None:
        step_size = self._step_size(m.group, int(self.state[m.param]["step"]))
        _descend(m.local(m.param), piece, step_size, m.group)

    def _step_elementwise(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        t = int(state["step"])
        state["step"] += 1
        if t == 0:
            return
        b1, b2 = group["betas"]
        exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
        exp_avg.mul_(b1).add_(g, alpha=1 - b1)
        exp_avg_sq.mul_(b2).add_(g.square(), alpha=1 - b2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        _descend(local(p), exp_avg / denom, self._step_size(group, t), group)


class _Work:
    """One matrix's step on its owner: its gradient, factors and bases (None: a side that is
    not preconditioned), the calls so far, and the factors' EMA weight."""

    def __init__(self, opt: SOAP, m: Matrix, full: torch.Tensor):
        group = m.group
        self.m, self.owned = m, (lambda name: opt.owned_state(m, name))
        self.g = m.as_matrix(full).float()
        left, right = opt._sides(group, m.shape)
        self.fl, self.ql = (self.owned("factor_left"), self.owned("basis_left")) if left \
            else (None, None)
        self.fr, self.qr = (self.owned("factor_right"), self.owned("basis_right")) if right \
            else (None, None)
        self.t = opt._counter(m)
        self.decay = 1 - (group["shampoo_beta"] if group["shampoo_beta"] >= 0
                          else group["betas"][1])
        self.normalized = None  # M / (sqrt(V) + eps), once the moments moved

    def sides(self):
        """(side, its factor or None) for left and right."""
        return (("left", self.fl), ("right", self.fr))


def _install(w: _Work, results: list) -> None:
    """Install a refresh: M back to the parameter's coordinates in the old bases, each side's
    new basis (V's rows or columns permuted by its order), M into the new bases."""
    exp_avg, exp_avg_sq = w.owned("exp_avg"), w.owned("exp_avg_sq")
    moment = project_back(exp_avg, w.ql, w.qr)
    for dim, (q, result) in enumerate(zip((w.ql, w.qr), results)):
        if result is None:
            continue
        basis, order = result
        exp_avg_sq.copy_(exp_avg_sq.index_select(dim, order))
        q.copy_(basis)
    exp_avg.copy_(project(moment, w.ql, w.qr))


def _t(q: torch.Tensor | None) -> torch.Tensor | None:
    return None if q is None else q.T


def _chain(*xs: torch.Tensor | None) -> list[torch.Tensor]:
    """The product's operands, a side that is not preconditioned (None) left out."""
    return [x for x in xs if x is not None]


def _descend(param: torch.Tensor, update: torch.Tensor, step_size: float, group: dict) -> None:
    """p -= step_size * update, then the decoupled decay p -= lr * weight_decay * p."""
    param.add_(update, alpha=-step_size)
    if group["weight_decay"] > 0:
        param.add_(param, alpha=-group["lr"] * group["weight_decay"])


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
