"""`veragged.optim.Shampoo`: Kronecker-factored preconditioning with Adam grafting, sharded or
not."""

from __future__ import annotations

import warnings
from typing import Iterable

import torch

from veragged.optim.common import local
from veragged.optim.batched import chains
from veragged.optim.engine import Matrix, MatrixOptimizer, aligned_input
from veragged.optim.kronecker import inverse_root_into, tiles
from veragged.optim.refresh import AsyncRefresh

__all__ = ["Shampoo"]


class Shampoo(AsyncRefresh, MatrixOptimizer):
    """Shampoo (Gupta et al. 2018) as Distributed Shampoo runs it (Shi et al. 2023,
    facebookresearch/optimizers), with Adam grafting, per 2-D parameter.

    Blocking: a matrix is cut into tiles of at most `max_preconditioner_dim` rows and columns
    (torch.split on each dim: whole rows of the matrix, column ranges of them); every tile is a
    block with its own factors and its own grafting norm, exactly as if it were a parameter.
    All the tiles of one matrix live on the matrix's owner, which the plan charges their summed
    cost (cost model "shampoo"); the matrix travels whole, as one item.

    Per block G (a x b), with step t = 1, 2, ... counted per parameter:
      - factors: L = beta2 L + (1 - beta2) G G^T, R = beta2 R + (1 - beta2) G^T G (beta2 = 1:
        plain sums); on step t = `start_preconditioning_step` and on the later steps that
        `precondition_frequency` divides, after the factors took G, the roots L^-1/4, R^-1/4
        are recomputed from the bias-corrected factors F / (1 - beta2^t) (when beta2 < 1) by
        an eigendecomposition (in float64, where Distributed Shampoo uses float32 and retries
        in float64) with `epsilon` added and, if the smallest eigenvalue is below it, all
        shifted up to it;
      - grafting (Adam): V = graft_beta2 V + (1 - graft_beta2) G^2, graft = M_hat /
        (sqrt(V / (1 - graft_beta2^t)) + graft_epsilon);
      - M = beta1 M + (1 - beta1) G, M_hat = M / (1 - beta1^t) (beta1 = 0: M_hat = G);
      - from `start_preconditioning_step` on the direction is S = L^-1/4 M_hat R^-1/4 scaled to
        the grafting direction's norm, S * ||graft|| / (||S|| + 1e-16); before it, graft;
      - decoupled weight decay dir <- dir + weight_decay * p, then (with `momentum`) the
        buffer B = momentum B + (1 - dampening) dir and dir <- B (Nesterov: (1 - dampening) dir
        + momentum B, as Distributed Shampoo), then p <- p - lr * dir.
    Where this differs from Distributed Shampoo's defaults (on purpose): 1-D parameters take
    the Adam grafting step instead of a full-matrix factor, 2-D parameters are never merged
    into one vector however small (always two factors, 4th roots), Adam grafting is on by
    default, and the step counter is per parameter (a parameter no rank has a gradient for
    does not advance it; Distributed Shampoo counts per group).
    Parameters that are not matrices (1-D, or a group with `precondition=False`) take the
    grafting step alone, elementwise on the local shard.

    Distributed: as Muon ([Note: matrix optimizer engine]); the owner holds every factor, root
    and moment of its matrices whole ([Note: owner-resident state]) and sends back the direction.

    Background roots ([Note: asynchronous roots]): with `async_precondition=True` and
    `staleness=k` (0 <= k <= precondition_frequency) the roots of a refresh at step s are
    computed by `async_workers` threads and installed before the direction of step s + k,
    exactly, whatever the timing; steps start .. start + k - 1 take the grafting direction.
    `async_stats` says what the workers did; k = 0 computes them inline (the default path).
    """

    _NAME = "Shampoo"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = -1,
        use_nesterov: bool = False,
        use_bias_correction: bool = True,
        graft_beta2: float = 0.999,
        graft_epsilon: float = 1e-10,
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
        if start_preconditioning_step == -1:
            start_preconditioning_step = precondition_frequency
        self.root_failures: dict[str, int] = {}  # matrix label -> refreshes that kept the root
        defaults = dict(
            lr=lr, betas=tuple(betas), epsilon=epsilon, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step, use_nesterov=use_nesterov,
            use_bias_correction=use_bias_correction, graft_beta2=graft_beta2,
            graft_epsilon=graft_epsilon, precondition=None,
        )
        super().__init__(params, defaults, owners=owners, alpha=alpha, capacity=capacity,
                         locality_slack=locality_slack,
                         grad_agreement=grad_agreement)

    # --- engine hooks ([Note: matrix optimizer engine]) -----------------------------------------

    def _is_matrix(self, group: dict, p: torch.Tensor) -> bool:
        return p.ndim >= 2 if group["precondition"] is None else bool(group["precondition"])

    def _validate_group(self, group: dict) -> None:
        b1, b2 = group["betas"] if len(group["betas"]) == 2 else (-1, -1)
        checks = [
            ("lr", group["lr"] >= 0),
            ("betas", 0 <= b1 < 1 and 0 < b2 <= 1),
            ("epsilon", group["epsilon"] > 0),
            ("momentum", 0 <= group["momentum"] < 1),
            ("dampening", 0 <= group["dampening"] < 1),
            ("weight_decay", group["weight_decay"] >= 0),
            ("max_preconditioner_dim", _positive_int(group["max_preconditioner_dim"])),
            ("precondition_frequency", _positive_int(group["precondition_frequency"])),
            ("start_preconditioning_step", _positive_int(group["start_preconditioning_step"])),
            ("graft_beta2", 0 < group["graft_beta2"] <= 1),
            ("graft_epsilon", group["graft_epsilon"] > 0),
            ("precondition", group["precondition"] in (None, False, True)),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"Shampoo: invalid {name}={group[name]!r}")
        if group["start_preconditioning_step"] < group["precondition_frequency"]:
            raise ValueError(
                "Shampoo: start_preconditioning_step="
                f"{group['start_preconditioning_step']} must be >= precondition_frequency="
                f"{group['precondition_frequency']} (the roots are first computed then)")
        self._check_staleness(group)

    def _init_state(self, p: torch.Tensor, group: dict, matrix: bool) -> None:
        state = self.state[p]
        state.setdefault("step", torch.tensor(0.0))
        if not matrix:
            state.setdefault("exp_avg", torch.zeros_like(p))
            state.setdefault("exp_avg_sq", torch.zeros_like(p))
        if group["momentum"] > 0:
            state.setdefault("momentum_buffer", torch.zeros_like(p))

    def _tiles(self, m: Matrix) -> list[tuple[int, int, int, int]]:
        """(row0, rows, col0, cols) of every block of `m`, row-major."""
        d = m.group["max_preconditioner_dim"]
        rows, cols = m.shape
        out, r0 = [], 0
        for a in tiles(rows, d):
            c0 = 0
            for b in tiles(cols, d):
                out.append((r0, a, c0, b))
                c0 += b
            r0 += a
        return out

    def _owner_state(self, m: Matrix) -> dict:
        shape = m.shape
        out = {"exp_avg": (shape, torch.float32), "exp_avg_sq": (shape, torch.float32)}
        for k, (_, a, _, b) in enumerate(self._tiles(m)):
            out[f"factor_left_{k}"] = ((a, a), torch.float32)
            out[f"factor_right_{k}"] = ((b, b), torch.float32)
            out[f"root_left_{k}"] = ((a, a), torch.float32)
            out[f"root_right_{k}"] = ((b, b), torch.float32)
            if self.staleness:  # a refresh in flight ([Note: asynchronous roots])
                out[f"pending_root_left_{k}"] = ((a, a), torch.float32)
                out[f"pending_root_right_{k}"] = ((b, b), torch.float32)
        if self.staleness:
            out["pending_step"] = ((1,), torch.int64)
        return out

    def _refresh_at(self, m: Matrix, t: int) -> bool:
        group = m.group
        f, start = group["precondition_frequency"], group["start_preconditioning_step"]
        return (t % f == 0 and t > start) or t == start  # Distributed Shampoo's rule

    def _counter(self, m: Matrix) -> int:
        return int(self.state[m.param]["step"]) + 1

    def _jobs_per_refresh(self, m: Matrix) -> int:
        return len(self._tiles(m))

    def _plan_options(self, group: dict) -> dict:
        return dict(cost="shampoo", precondition_frequency=group["precondition_frequency"],
                    max_preconditioner_dim=group["max_preconditioner_dim"])

    def _prepare(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> torch.Tensor:
        return g

    def _after_param(self, p: torch.Tensor) -> None:
        self.state[p]["step"] += 1

    def _compute(self, m: Matrix, full: torch.Tensor) -> torch.Tensor:
        return self._compute_many([m], [full])[0]

    def _compute_many(self, ms: list[Matrix], fulls: list[torch.Tensor]) -> list:
        """The directions of `ms`, tile by tile; each product (G G^T, G^T G, L^-1/4 M R^-1/4)
        runs over the tiles of every matrix at once, batched by shape where that is bitwise
        the one-by-one product ([Note: batched owner products]). Tiles are independent, so
        doing every tile's factors, then roots, then direction is doing them tile by tile."""
        works = [_Work(self, m, aligned_input(full)) for m, full in zip(ms, fulls)]
        tiles = [(w, k) for w in works for k in range(len(w.tiles))]
        blocks = [w.block(w.g, k) for w, k in tiles]
        grams = chains([(b, b.T) for b in blocks] + [(b.T, b) for b in blocks])
        for j, (w, k) in enumerate(tiles):
            b2 = w.m.group["betas"][1]
            _accumulate(w.owned(f"factor_left_{k}"), grams[j], b2)
            _accumulate(w.owned(f"factor_right_{k}"), grams[len(tiles) + j], b2)
        for w, k in tiles:  # the roots of step t - staleness, then (k = 0: and) those of t
            if w.install is not None and self._take(w.m, k, w.install, w.t):
                for side in SIDES:
                    self._install_root(w.m, k, side, w.owned(f"pending_root_{side}_{k}"),
                                       w.install)
            if w.refresh:
                self._submit_roots(w, k)
        ready = [(w, k) for w, k in tiles if w.precondition]
        products = chains([(w.owned(f"root_left_{k}"), w.block(w.filtered, k),
                            w.owned(f"root_right_{k}")) for w, k in ready])
        for (w, k), s in zip(ready, products):  # scaled to the grafting direction's norm
            w.tile(w.direction, k).copy_(
                s.mul_(w.tile(w.graft, k).norm() / (s.norm() + 1e-16)))
        for w, k in tiles:
            if not w.precondition:
                w.tile(w.direction, k).copy_(w.tile(w.graft, k))
        return [w.m.to_flat(w.direction) for w in works]

    def _submit_roots(self, w: _Work, k: int) -> None:
        """Tile k's roots from its bias-corrected factors after G_t (snapshots: the division
        copies them), into its pending state (in the background) or temporaries (inline, then
        installed now)."""
        group = w.m.group
        b2 = group["betas"][1]
        scale = 1.0 - b2**w.t if (b2 < 1 and group["use_bias_correction"]) else 1.0
        factors = [w.owned(f"factor_{side}_{k}") / scale for side in SIDES]
        outs = [w.owned(f"pending_root_{side}_{k}") if self._roots is not None
                else torch.empty_like(f) for side, f in zip(SIDES, factors)]
        epsilon = group["epsilon"]

        def run() -> None:
            for factor, out in zip(factors, outs):  # NaN where eigh fails: kept, counted
                inverse_root_into(out, factor, 4, epsilon)

        self._submit(w.m, k, w.t, run)
        if self._roots is None:
            for side, out in zip(SIDES, outs):
                self._install_root(w.m, k, side, out, w.t)

    def _install_root(self, m: Matrix, k: int, side: str, new: torch.Tensor, s: int) -> None:
        """root <- `new`, the root of tile k's factor at step `s`, unless it is not finite (the
        factor was not, or its eigendecomposition failed): then the previous root stays, the
        failure is counted in `root_failures[m.label]` and warned about once per matrix
        (Distributed Shampoo's tolerance for failed root computations; the owner alone sees
        its factors, so raising here would leave the other ranks waiting in the next
        exchange)."""
        if bool(torch.isfinite(new).all()):
            self.owned_state(m, f"root_{side}_{k}").copy_(new)
            return
        count = self.root_failures.get(m.label, 0) + 1
        self.root_failures[m.label] = count
        if count == 1:
            warnings.warn(f"Shampoo: factor_{side}_{k} of {m.label} is not finite or its "
                          f"eigendecomposition failed at step {s} (a NaN or inf gradient?); "
                          "keeping its previous root (counted in Shampoo.root_failures)",
                          RuntimeWarning, stacklevel=2)

    def _apply(self, m: Matrix, piece: torch.Tensor) -> None:
        buf = self.state[m.param].get("momentum_buffer")
        _descend(m.local(m.param), piece, None if buf is None else m.local(buf), m.group)

    def _step_elementwise(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        t = int(state["step"]) + 1
        exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
        direction, _ = _graft(g, exp_avg, exp_avg_sq, t, group)
        state["step"] += 1
        buf = state.get("momentum_buffer")
        _descend(local(p).view(-1), direction.reshape(-1),
                 None if buf is None else local(buf).view(-1), group)


class _Work:
    """One matrix's step on its owner: its gradient, grafting direction and first moment
    (moments already moved), its tiles, and whether its roots refresh and precondition."""

    def __init__(self, opt: Shampoo, m: Matrix, full: torch.Tensor):
        group = m.group
        self.m, self.owned = m, (lambda name: opt.owned_state(m, name))
        self.g = m.as_matrix(full).float()
        self.t = t = opt._counter(m)
        self.graft, self.filtered = _graft(self.g, self.owned("exp_avg"),
                                           self.owned("exp_avg_sq"), t, group)
        self.refresh = opt._refresh_at(m, t)
        self.install = opt._due(m, t)  # the submit step of the roots installed now, if any
        # the first roots are installed at start + staleness; the grafting direction before
        self.precondition = t >= group["start_preconditioning_step"] + opt.staleness
        self.tiles = opt._tiles(m)
        self.direction = torch.empty_like(self.g)

    def tile(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Tile k of the (rows, cols) `x`: a view."""
        r0, a, c0, b = self.tiles[k]
        return x[r0:r0 + a, c0:c0 + b]

    def block(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Tile k of `x` as a matrix of its own (copied out unless it is the whole `x`), as
        the products take it ([Note: batched owner products])."""
        return self.tile(x, k).contiguous()


SIDES = ("left", "right")


def _accumulate(factor: torch.Tensor, gram: torch.Tensor, beta2: float) -> None:
    if beta2 == 1.0:
        factor.add_(gram)
    else:
        factor.mul_(beta2).add_(gram, alpha=1 - beta2)


def _filtered(exp_avg: torch.Tensor, g: torch.Tensor, t: int, group: dict) -> torch.Tensor:
    """M_hat: the bias-corrected first moment (already updated), or G when beta1 = 0."""
    b1 = group["betas"][0]
    if b1 == 0:
        return g
    if group["use_bias_correction"]:
        return exp_avg / (1.0 - b1**t)
    return exp_avg


def _graft(g, exp_avg, exp_avg_sq, t: int, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves M and V by G; returns Adam's grafting direction M_hat / (sqrt(V_hat) + eps) and
    M_hat."""
    b1, gb2 = group["betas"][0], group["graft_beta2"]
    if b1 > 0:
        exp_avg.mul_(b1).add_(g, alpha=1 - b1)
    if gb2 == 1.0:
        exp_avg_sq.addcmul_(g, g)
    else:
        exp_avg_sq.mul_(gb2).addcmul_(g, g, value=1 - gb2)
    v = exp_avg_sq / (1.0 - gb2**t) if (gb2 < 1 and group["use_bias_correction"]) else exp_avg_sq
    filtered = _filtered(exp_avg, g, t, group)
    return filtered / v.sqrt().add_(group["graft_epsilon"]), filtered


def _descend(param: torch.Tensor, direction: torch.Tensor, buf: torch.Tensor | None,
             group: dict) -> None:
    """Decoupled weight decay (direction += weight_decay * p), momentum (Nesterov), then
    p -= lr * direction, on flat local values (`param`, its momentum `buf`, `direction` in the
    same order)."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    if wd > 0:
        direction = direction.add(param, alpha=wd)
    if mu > 0:
        buf.mul_(mu).add_(direction, alpha=1 - group["dampening"])
        if group["use_nesterov"]:  # Distributed Shampoo's: (1 - dampening) P + momentum M
            direction = direction.mul(1 - group["dampening"]).add_(buf, alpha=mu)
        else:
            direction = buf
    param.add_(direction, alpha=-lr)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
