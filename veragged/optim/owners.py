"""`plan_owners()`, `OwnerPlan` and `block_costs()`: which rank computes the update of each
matrix of a distributed matrix optimizer (Muon, Shampoo, SOAP), and when.

The Python face of the C++ owner plan (csrc/optim/owners.h, ``[Note: matrix owner plan]``).
Distributed Muon, Shampoo and SOAP gather each whole 2-D matrix onto one owner rank, compute its
update there (Newton-Schulz, or the Kronecker-factored preconditioner) and send the update back.
The plan is computed by every rank from the same shapes, and is identical everywhere (integer
costs, total orders, no hash containers), so it needs no communication.
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["OwnerPlan", "plan_owners", "block_costs", "STRATEGIES", "COSTS"]

#: Owner strategies (csrc/optim/owners.h): Keller Jordan's round robin, global LPT with
#: capacity-bounded micro-groups (Canzona Algorithm 3), alpha-balanced contiguous runs per
#: bucket (Canzona Algorithm 1), the layer-wise baseline (each bucket whole on one rank,
#: buckets by LPT over their total costs), and locality-aware LPT (a matrix one rank holds
#: whole is owned there, unless the load bound says otherwise).
STRATEGIES = ("naive", "lpt", "alpha", "layer", "local")
#: Cost models per row block ``r x c`` (``[Note: matrix owner plan]``): ``"flops"``, Muon's
#: Newton-Schulz FLOPs ``ns_steps * (4 s^2 l + 2 s^3)`` with ``s = min(r, c)``,
#: ``l = max(r, c)``; ``"numel"``, ``r * c``; ``"shampoo"`` and ``"soap"``, the FLOPs of a step
#: plus the preconditioner refresh amortised over ``precondition_frequency`` steps, with sides up
#: to ``max_preconditioner_dim`` (Shampoo tiles the block, SOAP leaves a larger side
#: unpreconditioned).
COSTS = ("flops", "numel", "shampoo", "soap")


@dataclass(frozen=True)
class OwnerPlan:
    """Owner rank of every matrix and the micro-groups to run them in.

    Attributes:
        owners: per matrix (input order), the rank that computes its update, in ``[0, world)``.
        groups: micro-groups in execution order; each is a tuple of matrix indices, and every
            matrix is in exactly one. A group is one gather -> Newton-Schulz -> scatter round:
            ``lpt`` groups hold matrices in cost-descending order (ties: lower index) and bound
            what any rank computes per round by ``capacity``; ``naive`` groups are ``world``
            consecutive matrices; ``alpha`` has one group per bucket (ascending bucket id),
            matrices in input order; ``layer`` has one group of every matrix in input order.
        loads: per rank, the summed cost of the matrices it owns.
        capacity: ``lpt`` and ``local``: the most cost a rank gains within one group (only a
            lone matrix above it is allowed to exceed it); ``0`` for the other strategies.
        moved: with ``held``, the elements that travel to their owners per step (the updates
            travel back as many); ``-1`` without it.
    """

    owners: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    capacity: int = 0
    moved: int = -1

    def bytes_per_step(self, element_size: int) -> int:
        """Bytes the gathers and scatters put on the wire per step (every rank together):
        each moved element once to its owner and once back, at `element_size` bytes."""
        if self.moved < 0:
            raise ValueError("OwnerPlan.bytes_per_step: the plan was made without `held`")
        return 2 * self.moved * element_size

    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.loads)

    @property
    def ratio(self) -> float:
        """Load balance, max / mean over ranks (1.0 is perfect; 1.0 when every load is 0)."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = operator.index(value)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} = {value} does not fit in int64")
    return value


def _blocks(shapes, split_sizes) -> tuple[list[int], list[int], list[int]]:
    """Flattened row blocks: (block rows, block cols, blocks per matrix)."""
    shapes = list(shapes)
    if split_sizes is not None:
        split_sizes = list(split_sizes)
        if len(split_sizes) != len(shapes):
            raise ValueError(
                f"split_sizes must have one entry per shape, got {len(split_sizes)} for "
                f"{len(shapes)} shapes"
            )
    rows_out, cols_out, counts = [], [], []
    for i, shape in enumerate(shapes):
        shape = tuple(shape)
        if len(shape) != 2:
            raise ValueError(f"shapes[{i}] must be a (rows, cols) pair, got {shape!r}")
        rows, cols = _int(f"shapes[{i}][0]", shape[0]), _int(f"shapes[{i}][1]", shape[1])
        if rows < 0 or cols < 0:
            raise ValueError(f"shapes[{i}] must have rows and cols >= 0, got {shape!r}")
        split = None if split_sizes is None else split_sizes[i]
        if split is None:
            split = (rows,)
        else:
            split = tuple(_int(f"split_sizes[{i}][{b}]", s) for b, s in enumerate(split))
            if not split or min(split) < 1 or sum(split) != rows:
                raise ValueError(
                    f"split_sizes[{i}] must be row-block sizes >= 1 summing to rows = {rows}, "
                    f"got {split!r}"
                )
        rows_out += split
        cols_out += [cols] * len(split)
        counts.append(len(split))
    return rows_out, cols_out, counts


def _cost_args(cost, ns_steps, precondition_frequency, max_preconditioner_dim) -> tuple:
    """The cost-model arguments of the ops, type-checked; their values are checked in C++."""
    return (
        str(cost),
        _int("ns_steps", ns_steps),
        _int("precondition_frequency", precondition_frequency),
        _int("max_preconditioner_dim", max_preconditioner_dim),
    )


def plan_owners(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    strategy: str = "lpt",
    cost: str = "flops",
    alpha: float = 1.0,
    capacity: Optional[int] = None,
    ns_steps: int = 5,
    split_sizes: Optional[Sequence[Optional[Sequence[int]]]] = None,
    buckets: Optional[Sequence[int]] = None,
    precondition_frequency: int = 1,
    max_preconditioner_dim: int = 1024,
    held: Optional[Sequence[Sequence[int]]] = None,
    locality_slack: float = 0.05,
) -> OwnerPlan:
    """Plans which rank computes the update of each matrix (``[Note: matrix owner plan]``).

    Args:
        shapes: ``(rows, cols)`` of each 2-D matrix, in a fixed order every rank agrees on.
        world_size: number of ranks sharing the work.
        strategy: ``"lpt"`` (default: global LPT, loads carried across micro-groups),
            ``"naive"`` (matrix ``i`` on rank ``i % world_size``), ``"alpha"`` (Canzona's
            alpha-balanced contiguous runs within each bucket) or ``"layer"`` (the layer-wise
            baseline: each bucket whole on one rank, buckets largest total cost first onto the
            least loaded rank; without ``buckets`` each matrix is its own bucket) or
            ``"local"`` (locality-aware: a matrix one rank holds whole, per ``held``, is owned
            there; the rest by LPT around them; homes given up only while the most loaded rank
            is above lpt's max load plus ``locality_slack`` times the mean load).
        cost: the cost model balanced, per row block ``r x c`` (:func:`block_costs` gives the
            per-matrix values): ``"flops"`` (Muon's Newton-Schulz FLOPs, the default),
            ``"numel"`` (``r * c``), ``"shampoo"`` (blocked Shampoo on tiles of at most
            ``max_preconditioner_dim`` squared: per step ``4 a b (a + b)`` per ``a x b`` tile,
            per refresh ``11 (a^3 + b^3)``) or ``"soap"`` (per side ``n <= max_preconditioner_dim``
            with ``m`` the other: per step ``6 n^2 m``, per refresh ``9 n^3 + 4 n^2 m``; ``r * c``
            if neither side qualifies). Refresh work is amortised:
            ``per_step + ceil(refresh / precondition_frequency)``.
        alpha: ``"alpha"`` only, in ``[0, 1]``: 1 balances compute, 0 cuts each bucket evenly.
        capacity: ``"lpt"`` only: the most cost a rank may gain within one micro-group. ``None``
            picks ``max(largest matrix cost, ceil(total / world_size / 4))``.
        ns_steps: Newton-Schulz iterations (scales ``"flops"``; never changes the plan).
        split_sizes: optional, per matrix ``None`` or the sizes of its row blocks (summing to
            rows), e.g. ``(q, k, v)`` rows of a fused QKV: each block is orthogonalised or
            preconditioned on its own, so costs are per block, but the matrix keeps one owner.
        buckets: optional bucket id (``>= 0``) per matrix, e.g. its parameter group or layer;
            used by ``"alpha"`` and ``"layer"`` only.
        precondition_frequency: ``"shampoo"`` and ``"soap"`` only, ``>= 1``: steps between
            preconditioner refreshes.
        max_preconditioner_dim: ``"shampoo"`` and ``"soap"`` only, ``>= 1``: the largest
            preconditioned side (Shampoo's tile size; SOAP's largest factor).
        held: optional, per matrix the elements each of the ``world_size`` ranks already holds
            (what its layout puts there); ``"local"`` keeps matrices where they are whole, and
            every strategy then reports ``moved``.
        locality_slack: ``"local"`` only, ``>= 0``: how much compute (a share of the mean load)
            a plan may give up beyond lpt's balance to keep matrices home (default 0.05).

    Returns:
        A frozen :class:`OwnerPlan`.

    Raises:
        ValueError: a bad shape or split, ``world_size < 1``, an unknown strategy or cost,
            ``alpha`` outside ``[0, 1]``, ``capacity < 1``, ``ns_steps < 1``,
            ``precondition_frequency < 1``, ``max_preconditioner_dim < 1``, a bucket id < 0 or
            a ``buckets`` length that differs from ``shapes``, a ``held`` table of the wrong
            size or with an entry outside ``[0, numel]``, ``locality_slack < 0``, or costs
            overflowing int64; the message names the argument and its value.
        TypeError: a size is not an int.
    """
    rows, cols, counts = _blocks(shapes, split_sizes)
    if capacity is not None and _int("capacity", capacity) < 1:
        raise ValueError(f"capacity must be None or >= 1, got {capacity}")
    if not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a real number, got {alpha!r}")
    bucket_ids = (
        [] if buckets is None else [_int(f"buckets[{i}]", b) for i, b in enumerate(buckets)]
    )
    cost, ns_steps, frequency, max_dim = _cost_args(
        cost, ns_steps, precondition_frequency, max_preconditioner_dim
    )
    table = []
    if held is not None:
        held = list(held)
        if len(held) != len(counts):
            raise ValueError(f"held must have one row per shape, got {len(held)} rows for "
                             f"{len(counts)} shapes")
        world = _int("world_size", world_size)
        for i, row in enumerate(held):
            row = list(row)
            if len(row) != world:
                raise ValueError(f"held[{i}] must have world_size = {world} entries, got "
                                 f"{len(row)}")
            table += [_int(f"held[{i}][{r}]", h) for r, h in enumerate(row)]
    if not isinstance(locality_slack, numbers.Real):
        raise TypeError(f"locality_slack must be a real number, got {locality_slack!r}")
    owners, offsets, members, loads, used_capacity, moved = torch.ops.veragged.plan_owners(
        rows,
        cols,
        counts,
        bucket_ids,
        _int("world_size", world_size),
        str(strategy),
        cost,
        float(alpha),
        0 if capacity is None else capacity,
        ns_steps,
        frequency,
        max_dim,
        table,
        float(locality_slack),
    )
    groups = tuple(tuple(members[a:b]) for a, b in zip(offsets, offsets[1:], strict=False))
    if held is not None and not counts:  # no matrices: nothing moves
        moved = 0
    return OwnerPlan(tuple(owners), groups, tuple(loads), used_capacity, moved)


def block_costs(
    shapes: Sequence[Sequence[int]],
    cost: str = "flops",
    ns_steps: int = 5,
    precondition_frequency: int = 1,
    max_preconditioner_dim: int = 1024,
    split_sizes: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> list[int]:
    """Per matrix, the cost :func:`plan_owners` balances: the sum over its row blocks of the
    cost model (``[Note: matrix owner plan]``), computed by the same C++.

    The arguments mean what they mean for :func:`plan_owners`; a plan's ``loads[r]`` is the sum
    of these costs over the matrices it gives rank ``r``.

    Raises:
        ValueError: a bad shape or split, an unknown cost, ``ns_steps < 1``,
            ``precondition_frequency < 1``, ``max_preconditioner_dim < 1`` or costs
            overflowing int64, naming the argument and its value.
        TypeError: a size is not an int.
    """
    rows, cols, counts = _blocks(shapes, split_sizes)
    args = _cost_args(cost, ns_steps, precondition_frequency, max_preconditioner_dim)
    return list(torch.ops.veragged.matrix_costs(rows, cols, counts, *args))
