"""`MatrixOptimizer`: the owner engine Muon, Shampoo and SOAP share.

[Note: matrix optimizer engine]
A matrix optimizer updates each 2-D parameter from the whole matrix (Newton-Schulz, Kronecker
factors and their roots or eigenbases), while FSDP, TP and EP leave every rank a piece of it
([Note: optimizer pieces on N-D meshes]). The engine runs every such optimizer the same way:
1. grad presence: the ranks of each parameter's mesh agree whether it has a gradient anywhere
   ([Note: symmetric grad presence]); parameters nobody has a gradient for are skipped, state
   and all, on every rank;
2. local work: each matrix's `_prepare` turns this rank's gradient piece into the piece to send
   (Muon: momentum and weight decay on the local shard; Shampoo and SOAP: the gradient itself);
   parameters the optimizer treats elementwise (1-D, embeddings for Muon) are stepped locally
   by `_step_elementwise`;
3. ownership: on each domain group every matrix has one owner rank from the C++ plan
   ([Note: matrix owner plan]) under the optimizer's own cost model; matrices travel whole to
   their owners in micro-groups, one all-to-all each, and updates come back the same way, the
   next micro-group's gather overlapping the current one's compute ([Note: Muon matrix
   exchange]);
4. owner compute: `_compute` maps the whole (flat) matrix to its whole (flat) update; it may
   read and write the matrix's *owner state*, tensors that exist whole on the owner only
   ([Note: owner-resident state]); `_has_update` (a function of symmetric step counters only)
   says whether the matrix sends an update back this step (SOAP's first step does not);
5. apply: `_apply` writes this rank's piece of the update into its shard.
A parameter with more than two dims (an expert stack [E, out, in]) is that many matrices, each
planned, owned, computed and applied on its own ([Note: matrices of a stack]); its elementwise
work (`_prepare`, momentum, weight decay) runs once on the whole local shard, and a step
counter advances once per parameter (`_after_param`, when every matrix of the domain is done).
A matrix whose owner holds it whole (a RaggedShard layout can keep an expert on one rank, and
`owners="local"` keeps it there) is computed where it lies, outside the exchange: no bytes
travel for it.
Plain tensors and replicated DTensors are whole on every rank: every rank computes them, with
the same kernels. `owners="replicated"` gathers every matrix to every rank and computes it
everywhere (what DDP-style implementations do; Canzona's SC baseline); `owners="layer"` puts
each param group whole on one rank (the layer-wise baseline: a group per layer). The owner runs
exactly the kernels a single process runs on the same whole matrix, so distributed results are
bitwise the single-process ones.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.optim import Optimizer

from veragged.dbuffer.ops import ALIGN_BYTES
from veragged.optim.common import (
    GradPresence,
    check_grad_agreement,
    consume_backward_verdicts,
    local,
    local_grads,
)
from veragged.optim.exchange import Exchange, MatrixLayout, matrix_layout
from veragged.optim.owner_state import OwnerResidence, residence
from veragged.optim.owners import OwnerPlan, plan_owners
from veragged.optim.pieces import check_placements, slice_layout
from veragged.placement.collectives import all_gather

__all__ = ["Matrix", "MatrixOptimizer", "STRATEGIES", "aligned_input"]

STRATEGIES = ("lpt", "local", "alpha", "naive", "layer", "replicated")


@dataclass(eq=False)
class Matrix:
    """One matrix the engine steps: a 2-D parameter, or one matrix of a stack ([Note: matrices
    of a stack]); its group, its pieces on its domain and where its owner state lives. `extra`
    is the optimizer's own per-matrix data."""

    param: torch.Tensor
    group: dict[str, Any]
    layout: MatrixLayout
    shape: tuple[int, int] = (0, 0)  # (rows, cols) as the optimizer sees the matrix
    index: int | None = None  # its position in the stack (None: a 2-D parameter)
    span: tuple[int, int] = (0, 0)  # its piece in this rank's flat local tensor
    transposed: bool = False  # stored as (cols, rows): matrix_dims=(-1, -2)
    owner: int | None = None  # its owner's index on the domain group (None: every rank)
    home: OwnerResidence | None = None  # where its owner state lives, if it has any
    extra: Any = None
    label: str = ""  # "param i of group g" (", matrix e" in a stack), for messages

    def key(self, name: str) -> str:
        """The state key of its owner-state tensor `name` (suffixed with the stack index)."""
        return name if self.index is None else f"{name}[{self.index}]"

    def as_matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """The (rows, cols) matrix from its flat values in storage order (contiguous)."""
        if not self.transposed:
            return flat.view(self.shape)
        return flat.view(self.shape[1], self.shape[0]).T.contiguous()

    def to_flat(self, x: torch.Tensor) -> torch.Tensor:
        """A (rows, cols) result back to flat storage order."""
        return (x.T if self.transposed else x).reshape(-1)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """Its piece of a tensor sharded like its parameter (flat view)."""
        return local(t).view(-1)[self.span[0]:self.span[1]]


def aligned_input(full: torch.Tensor) -> torch.Tensor:
    """`full`, or a copy of it where it does not start where a matrix of its own would
    ([Note: aligned owner inputs]): a view into a stack, or into an unaligned buffer."""
    return full.clone() if full.data_ptr() % ALIGN_BYTES else full


@dataclass
class _Domain:
    """The matrices of one domain process group (None: whole on every rank) and their plan."""

    matrices: list[Matrix]
    plan: OwnerPlan | None
    exchange: Exchange | None
    index: dict[int, int] = field(default_factory=dict)  # id(matrix) -> position


class MatrixOptimizer(Optimizer):
    """Base class of the matrix optimizers ([Note: matrix optimizer engine]).

    Subclasses supply the per-matrix math (`_prepare`, `_compute`, `_apply`), the elementwise
    step for the other parameters, which parameters are matrices, their state and the cost
    model the owner plan balances (`_plan_options`).
    """

    _NAME = "MatrixOptimizer"

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        *,
        owners: str = "lpt",
        alpha: float = 1.0,
        capacity: int | None = None,
        locality_slack: float = 0.05,
        grad_agreement: str = "auto",
    ):
        self.grad_agreement = check_grad_agreement(self._NAME, grad_agreement)
        if owners not in STRATEGIES:
            raise ValueError(f"{self._NAME}: owners must be one of {STRATEGIES}, got {owners!r}")
        self.owners, self.alpha, self.capacity = owners, alpha, capacity
        if isinstance(locality_slack, bool) or not isinstance(locality_slack, (int, float)) \
                or not locality_slack >= 0:
            raise ValueError(f"{self._NAME}: locality_slack must be a number >= 0, got "
                             f"{locality_slack!r}")
        self.locality_slack = float(locality_slack)
        self.owner_plans: list[OwnerPlan] = []
        self._domains: list[_Domain] | None = None
        self._building = True
        defaults = {**defaults, "matrix_dims": defaults.get("matrix_dims", (-2, -1))}
        super().__init__(params, defaults)
        self._building = False
        self._domains = self._build_domains()  # owner state exists from the start

    # --- hooks ---------------------------------------------------------------------------------

    def _is_matrix(self, group: dict, p: torch.Tensor) -> bool:
        raise NotImplementedError

    def _validate_group(self, group: dict) -> None:
        """Raise ValueError naming a bad hyper-parameter of `group`."""

    def _check_matrix(self, group: dict, p: torch.Tensor, index: str) -> None:
        """Raise ValueError for a matrix parameter this optimizer cannot take (`index` names
        it); the optimizer's own checks of each matrix go in `_check_one`."""
        if p.ndim < 2:
            raise ValueError(f"{self._NAME}: matrix parameters must have 2 dims or more (a "
                             f"stack of matrices); {index} has shape {list(p.shape)}")
        dims = group["matrix_dims"]
        if not isinstance(dims, (tuple, list)) or tuple(dims) not in ((-2, -1), (-1, -2)):
            raise ValueError(f"{self._NAME}: matrix_dims={dims!r}: the matrices are the last "
                             "two dims, as (-2, -1) (rows, cols) or (-1, -2) (stored "
                             "transposed, e.g. [E, in, out] experts)")
        self._check_one(group, self._matrix_shape(group, p), index)

    def _check_one(self, group: dict, shape: tuple[int, int], index: str) -> None:
        """Raise ValueError for a (rows, cols) matrix this optimizer cannot take."""

    @staticmethod
    def _matrix_shape(group: dict, p: torch.Tensor) -> tuple[int, int]:
        rows, cols = p.shape[-2:]
        return (cols, rows) if tuple(group["matrix_dims"]) == (-1, -2) else (rows, cols)

    def _matrices_of(self, group: dict, p: torch.Tensor) -> list[Matrix]:
        """The matrices of matrix parameter `p`: itself, or each matrix of a stack ([Note:
        matrices of a stack])."""
        layout = matrix_layout(p)
        shape = self._matrix_shape(group, p)
        transposed = tuple(group["matrix_dims"]) == (-1, -2)
        if p.ndim == 2 and not transposed:
            return [Matrix(p, group, layout, shape, None, (0, local(p).numel()))]
        size = shape[0] * shape[1]
        out = []
        for e in range(math.prod(p.shape[:-2])):
            sub, span = slice_layout(layout, e * size, size)
            out.append(Matrix(p, group, sub, shape, e if p.ndim > 2 else None, span, transposed))
        return out

    def _init_state(self, p: torch.Tensor, group: dict, matrix: bool) -> None:
        """Create the state that is sharded like `p` (every rank, from the start)."""

    def _owner_state(self, m: Matrix) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the state the owner holds whole ([Note: owner-resident
        state])."""
        return {}

    def _plan_options(self, group: dict) -> dict:
        """plan_owners keyword arguments (cost model and its parameters) for `group`'s
        matrices; every matrix of one domain must give the same cost options."""
        return {}

    def _make_extra(self, m: Matrix) -> Any:
        return None

    def _plan_blocks(self, m: Matrix):
        """The row-block sizes plan_owners costs separately (None: the whole matrix)."""
        return None

    def _prepare(self, p: torch.Tensor, group: dict, g: torch.Tensor) -> torch.Tensor:
        """This rank's values to send for matrix parameter `p` (all of its matrices), from its
        local gradient `g`; elementwise, in the local tensor's order."""
        raise NotImplementedError

    def _compute(self, m: Matrix, full: torch.Tensor) -> torch.Tensor:
        """The flat, contiguous update of `m` from the whole flat `full`; runs where `m.mine`."""
        raise NotImplementedError

    def _compute_many(self, ms: list[Matrix], fulls: list[torch.Tensor]) -> list:
        """`_compute` of each matrix (an owner's matrices of one micro-group, or those it
        holds at home); an optimizer may batch same-shape matrices where that changes no bit
        ([Note: batched Newton-Schulz])."""
        return [self._compute_aligned(m, f) for m, f in zip(ms, fulls)]

    def _has_update(self, m: Matrix) -> bool:
        """Whether `m` sends an update back this step (symmetric on every rank)."""
        return True

    def _apply(self, m: Matrix, piece: torch.Tensor) -> None:
        """Write this rank's flat `piece` of the update into its shard (`m.local(...)`)."""
        raise NotImplementedError

    def _after_param(self, p: torch.Tensor) -> None:
        """Per stepped matrix parameter, on every rank, once all its matrices are updated
        (step counters)."""

    def _step_elementwise(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    def _update_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype updates travel in."""
        return torch.float32

    def _start_step(self, grads: dict[int, torch.Tensor | None]) -> None:
        """Once every parameter's gradient (or None: nobody has one) is known, before any
        parameter changes (background refreshes: [Note: asynchronous roots])."""

    def _settle(self) -> None:
        """Before the plan is rebuilt (background refreshes: [Note: asynchronous roots])."""

    # --- groups and state ----------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        self._validate_group(group)
        for i, p in enumerate(group["params"]):
            if p.is_complex():  # as torch.optim.Muon: the math is for real matrices
                raise ValueError(f"{self._NAME}: param {i} of group {gi} is complex "
                                 f"({p.dtype}); complex parameters are not supported")
            matrix = self._is_matrix(group, p)
            if matrix:
                self._check_matrix(group, p, f"param {i} of group {gi}")
                check_placements(p)  # unsupported placements raise here, not at the first step
            self._init_state(p, group, matrix)
        if not self._building:  # the plan covers every group: rebuild it, moving owner state
            self._settle()
            self._domains = self._build_domains()

    def owned_state(self, m: Matrix, name: str) -> torch.Tensor:
        """The owner's whole `name` tensor of `m`, in its shape (only where `m.mine`)."""
        value = local(self.state[m.param][m.key(name)])
        return value.view(self._owner_state(m)[name][0])

    # --- the plan ------------------------------------------------------------------------------

    def matrices(self) -> list[Matrix]:
        """Every matrix the engine steps, domain by domain."""
        return [m for d in self._domains for m in d.matrices]

    def _build_domains(self) -> list[_Domain]:
        by_group: dict[Any, list[Matrix]] = {}
        buckets: dict[Any, list[int]] = {}
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if not self._is_matrix(group, p):
                    continue
                for m in self._matrices_of(group, p):
                    if m.layout.numel == 0:  # (n, 0) or (0, n): nothing to update, no state
                        continue
                    m.label = f"param {i} of group {gi}" + (
                        "" if m.index is None else f", matrix {m.index}")
                    m.extra = self._make_extra(m)
                    by_group.setdefault(m.layout.group, []).append(m)
                    buckets.setdefault(m.layout.group, []).append(gi)
        domains, self.owner_plans = [], []
        for pg, matrices in by_group.items():  # first-appearance order: the same on every rank
            plan = exchange = None
            if pg is not None and self.owners != "replicated":
                options = self._plan_options(matrices[0].group)  # [Note: matrix owner plan]
                plan = plan_owners(
                    [m.shape for m in matrices],
                    matrices[0].layout.world,
                    strategy=self.owners,
                    alpha=self.alpha,
                    capacity=self.capacity,
                    split_sizes=[self._plan_blocks(m) for m in matrices],
                    buckets=buckets[pg],
                    held=[m.layout.sizes for m in matrices],
                    locality_slack=self.locality_slack,
                    **options,
                )
                self.owner_plans.append(plan)
                exchange = Exchange(pg, [m.layout for m in matrices], plan.owners)
            for i, m in enumerate(matrices):
                m.owner = None if plan is None else plan.owners[i]
                if self._owner_state(m):
                    m.home = residence(m.param, m.owner)
                    self._place_owner_state(m)
            index = {id(m): i for i, m in enumerate(matrices)}
            domains.append(_Domain(matrices, plan, exchange, index))
        return domains

    def _place_owner_state(self, m: Matrix) -> None:
        """Create `m`'s owner state where the plan puts it, or move it there (a changed plan,
        or state loaded from another plan: [Note: owner-resident state])."""
        state = self.state[m.param]
        for name, (shape, dtype) in self._owner_state(m).items():
            key = m.key(name)
            value = state.get(key)
            if value is None:
                state[key] = m.home.zeros(shape, dtype)
            else:
                state[key] = m.home.adopt(value, shape, dtype, key)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for m in self.matrices():  # the same order on every rank
            self._place_owner_state(m)

    # --- the step ------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`; fully_shard's backward records of these parameters then serve
        no later step ([Note: grad verdicts for optimizers], dbuffer/grads.py)."""
        super().zero_grad(set_to_none)
        consume_backward_verdicts(p for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        presence = GradPresence(params, self.grad_agreement, type(self).__name__)
        grads = dict(zip(map(id, params), local_grads(params, presence.verdicts())))
        self._start_step(grads)
        for group in self.param_groups:
            for p in group["params"]:
                g = grads[id(p)]
                if g is not None and not self._is_matrix(group, p):
                    self._step_elementwise(p, g, group)
        for domain in self._domains:
            prepared: dict[int, torch.Tensor] = {}  # id(param) -> its flat local values
            pieces: dict[int, torch.Tensor] = {}  # id(matrix) -> its local piece to send
            stepped = []  # its matrix parameters with a gradient, in order
            for m in domain.matrices:
                p = m.param
                g = grads[id(p)]
                if g is None:
                    continue
                if id(p) not in prepared:
                    prepared[id(p)] = self._prepare(p, m.group, g).reshape(-1)
                    stepped.append(p)
                pieces[id(m)] = prepared[id(p)][m.span[0]:m.span[1]]
            if domain.exchange is None:
                self._step_whole(domain, pieces)
            else:
                self._step_owned(domain, pieces)
            for p in stepped:  # once per parameter, after all its matrices
                self._after_param(p)
        presence.finish()
        return loss

    def _compute_aligned(self, m: Matrix, full: torch.Tensor):
        """`_compute` on `full` where a matrix of its own would start ([Note: aligned owner
        inputs]): a view into a stack, or into an unaligned buffer, is copied first."""
        return self._compute(m, aligned_input(full))

    def _step_whole(self, domain: _Domain, pieces: dict[int, torch.Tensor]) -> None:
        """Matrices every rank has whole (plain tensors, replicated DTensors): computed
        together, so same-shape ones can batch; with owners="replicated", each is gathered to
        every rank and computed everywhere, one at a time (a gathered copy of every matrix at
        once would cost the whole model's gradients in memory)."""
        whole = [m for m in domain.matrices if id(m) in pieces and m.layout.group is None]
        sends = [self._has_update(m) for m in whole]
        outs = self._compute_many(whole, [pieces[id(m)].reshape(-1) for m in whole])
        for m, send, full in zip(whole, sends, outs):
            if send:
                self._apply(m, full)
        for m in domain.matrices:
            lay = m.layout
            if id(m) not in pieces or lay.group is None:
                continue
            bounds = (0, *itertools.accumulate(lay.sizes))  # pieces in rank order
            u = all_gather(pieces[id(m)], bounds, lay.group, (lay.numel,)).finish()
            if not lay.in_rank_order:
                u = lay.assemble(u.split(lay.sizes))
            sends = self._has_update(m)
            full = self._compute_many([m], [u.reshape(-1)])[0]
            if sends:
                self._apply(m, lay.mine(full))

    def _step_owned(self, domain: _Domain, pieces: dict[int, torch.Tensor]) -> None:
        """Owners compute; micro-groups pipelined ([Note: Muon matrix exchange]). A matrix its
        owner holds whole is computed there, outside the exchange."""
        ex, matrices = domain.exchange, domain.matrices
        stepped = [[i for i in g if id(matrices[i]) in pieces] for g in domain.plan.groups]
        # (the same on every rank: the plan, the layouts and the grad mask are symmetric)
        at_home = [i for g in stepped for i in g
                   if matrices[i].layout.size(matrices[i].owner) == matrices[i].layout.numel]
        home = set(at_home)
        groups = [g for g in ([i for i in g if i not in home] for g in stepped) if g]
        local_pieces = {domain.index[k]: u for k, u in pieces.items()}
        gathering = ex.gather(groups[0], local_pieces) if groups else None
        mine = [i for i in at_home if matrices[i].owner == ex.rank]
        if mine:  # while the first gather is on the wire
            outs = self._compute_many([matrices[i] for i in mine],
                                      [local_pieces[i] for i in mine])
            for i, u in zip(mine, outs):
                if self._has_update(matrices[i]):
                    self._apply(matrices[i], u)
        if not groups:
            return
        device = next(iter(local_pieces.values())).device
        like = torch.empty(0, dtype=self._update_dtype(device), device=device)
        scattering = None
        for k, items in enumerate(groups):
            fulls = gathering.wait()
            if k + 1 < len(groups):
                gathering = ex.gather(groups[k + 1], local_pieces)
            sending = [i for i in items if self._has_update(matrices[i])]
            sends = set(sending)
            owned = list(fulls)
            outs = self._compute_many([matrices[i] for i in owned], [fulls[i] for i in owned])
            updates = {i: u for i, u in zip(owned, outs) if i in sends}
            launched = ex.scatter(sending, updates, like) if sending else None
            if scattering is not None:
                self._apply_scattered(matrices, scattering)
            scattering = launched
        if scattering is not None:
            self._apply_scattered(matrices, scattering)

    def _apply_scattered(self, matrices: list[Matrix], scattering) -> None:
        for i, piece in scattering.wait().items():
            self._apply(matrices[i], piece)
