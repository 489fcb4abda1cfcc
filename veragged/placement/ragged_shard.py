"""The RaggedShard and StridedRaggedShard DTensor placements.

[Note: RaggedShard semantics]
`RaggedShard(dims, local_units)` shards one mesh dimension of size P. `dims` is a prefix
`(0, ..., k-1)` of the tensor's dims; they are flattened into one axis of `rows`, each row of shape
`shape[k:]` (so `dims=()` makes the whole tensor one row and `dims=tuple(range(ndim))` makes every
element a row). Rank `i` holds the `i`-th contiguous slice of
`local_units[i] * rows / sum(local_units)` rows, zero allowed; its local tensor is the 1-D flat
view of those rows. With other placements on
a 2-D mesh, the ragged split is applied last: to the block each rank holds under the other
placements (see `veragged.placement.layout`). `StridedRaggedShard` is the same split, spelled for
the case where a `Shard(0)` on a *later* mesh dim was applied before it (FSDP over TP/EP): DTensor
lists placements in the order they are applied, and `split_factor` records how many `Shard(0)`
pieces the tensor was cut into first (torch.chunk pieces: of unequal sizes only with one nonzero
`local_units` entry, [Note: ragged layout on an N-D mesh]), so the full tensor is the
concatenation, over those pieces, of each piece's ragged gather.

Placements are hashed and compared on every DTensor op, so both must be O(1) at any world size:
`local_units` tuples are interned (one object per distinct tuple), equality compares the interned
object by identity and the hash is computed once.
"""

from __future__ import annotations

import itertools
import math
import numbers
import sys
import weakref
from typing import Sequence

import torch
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import Placement

from veragged.placement.torch_callers import refuse_torch_caller

__all__ = ["RaggedShard", "StridedRaggedShard"]

_REPR_MAX_UNITS = 16  # longer local_units are summarised in repr

# [Note: torch's redistribute to RaggedShard]
# torch's `DTensor.redistribute` on a plain torch DTensor knows nothing of RaggedShard: its
# per-mesh-dim loop (`redistribute_local_tensor`) asks the target placement `is_replicate()`,
# `is_shard()`, `is_partial()`, finds none true, does nothing, and torch wraps the unchanged
# local tensor (a full replica, say) under the RaggedShard spec: silently wrong data. torch
# offers no hook for a placement it does not know (the method is not dispatched, and patching
# it or DTensor would be global), so RaggedShard.is_replicate, the first question that loop
# asks a target, checks whether its caller is that loop and raises there. Everywhere else
# (sharding propagation, our own layout code) it answers False as before, at the cost of one
# frame lookup. A mesh dim of size 1 never reaches the question (torch skips it), and there a
# RaggedShard holds what Replicate holds, so the relabelling is right. DTensors veragged hands
# out route `.redistribute` to veragged.redistribute instead ([Note: DTensors veragged hands
# out], tensor.py), so only DTensors made by torch itself reach this error.
_TORCH_REDISTRIBUTE = redistribute_local_tensor.__code__


class _Units:
    """One interned `local_units` tuple with its sum, hash and (lazily) prefix sums."""

    __slots__ = ("values", "total", "nonzero", "hash", "_prefix", "__weakref__")

    _table: "weakref.WeakValueDictionary[tuple[int, ...], _Units]" = weakref.WeakValueDictionary()

    def __init__(self, values: tuple[int, ...]):
        self.values = values
        self.total = sum(values)
        self.nonzero = sum(1 for u in values if u)
        self.hash = hash(values)
        self._prefix: tuple[int, ...] | None = None

    @classmethod
    def intern(cls, local_units: Sequence[int]) -> "_Units":
        values = tuple(local_units)
        if not all(type(u) is int for u in values):
            values = tuple(_as_int(u, f"local_units[{i}]") for i, u in enumerate(values))
        units = cls._table.get(values)
        if units is not None:
            return units
        if not values:
            raise ValueError("RaggedShard: local_units must have one entry per rank, got ()")
        for i, u in enumerate(values):
            if u < 0:
                raise ValueError(f"RaggedShard: local_units[{i}] must be >= 0, got {u}")
        units = cls(values)
        if units.total == 0:
            raise ValueError(f"RaggedShard: local_units must not all be zero, got {_short(values)}")
        cls._table[values] = units
        return units

    @property
    def prefix(self) -> tuple[int, ...]:
        """`prefix[i]` = sum of `values[:i]`; P + 1 entries."""
        if self._prefix is None:
            self._prefix = (0, *itertools.accumulate(self.values))
        return self._prefix


def _as_int(value, name: str) -> int:
    """`value` as a Python int: any integral type (numpy integers, `numbers.Integral`) or a
    0-dim integer tensor; bools and everything else raise TypeError naming `name`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if (isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point()
            and not value.is_complex() and value.dtype is not torch.bool):
        return int(value.item())
    raise TypeError(f"RaggedShard: {name} must be an integer, got {value!r}")


def _short(values: tuple[int, ...]) -> str:
    if len(values) <= _REPR_MAX_UNITS:
        return str(values)
    head = ", ".join(map(str, values[:8]))
    return f"({head}, ... {len(values)} entries, sum {sum(values)})"


def _check_dims(dims: Sequence[int]) -> tuple[int, ...]:
    dims = tuple(_as_int(d, f"dims[{i}]") for i, d in enumerate(dims))
    if dims != tuple(range(len(dims))):
        raise ValueError(
            f"RaggedShard: dims must be a prefix (0, ..., k-1) of the tensor dims, got {dims}"
        )
    return dims


class RaggedShard(Placement):
    """Shard the flattened leading `dims` of a tensor into whole rows.

    `local_units[i]` parts go to rank i. See [Note: RaggedShard semantics]. Immutable, hashable,
    picklable; equality and hashing are O(1).

    Args:
        dims: a prefix `(0, ..., k-1)` of the tensor's dims, flattened into rows of shape
            `shape[k:]`.
        local_units: one non-negative int per rank of the mesh dim; rank `i` holds
            `local_units[i] * rows / sum(local_units)` consecutive rows.
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int]):
        super().__init__()  # the pybind11 base must be initialised
        object.__setattr__(self, "dims", _check_dims(dims))
        object.__setattr__(self, "_units", _Units.intern(local_units))
        object.__setattr__(self, "_hash", hash((type(self).__name__, self.dims, self._units.hash)))

    dims: tuple[int, ...]
    _units: _Units

    @classmethod
    def for_counts(cls, shape: Sequence[int], counts: Sequence[int]) -> "RaggedShard":
        """The coarsest RaggedShard giving each rank `counts[r]` elements of a tensor of
        `shape` (a DBuffer's planned ranges give them).

        Rows of `shape[k:]` for the smallest k whose row size divides every count (k = ndim,
        single elements, always does), so row- and block-granular parameters keep row units.
        """
        shape = tuple(shape)
        if not any(counts):  # numel 0: rank 0 holds the (empty) whole
            return cls((0,), (1,) + (0,) * (len(counts) - 1))
        for k in range(len(shape) + 1):
            row = math.prod(shape[k:])
            if row and all(c % row == 0 for c in counts):
                return cls(tuple(range(k)), tuple(c // row for c in counts))
        raise AssertionError("unreachable: single elements (k = ndim) divide every count")

    @property
    def local_units(self) -> tuple[int, ...]:
        return self._units.values

    @property
    def num_ranks(self) -> int:
        return len(self._units.values)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other) -> bool:
        return (
            type(other) is type(self)
            and self._hash == other._hash
            and self.dims == other.dims
            and self._units is other._units
            and self._extra() == other._extra()
        )

    def __hash__(self) -> int:
        return self._hash

    def _extra(self) -> tuple:
        return ()

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={_short(self.local_units)})"

    def __str__(self) -> str:
        refuse_torch_caller(self)  # [Note: torch's entry points without the routing]
        return f"RS{self.dims}"

    def __reduce__(self):
        return (type(self), (self.dims, self.local_units))

    def is_replicate(self) -> bool:
        # [Note: torch's redistribute to RaggedShard]
        if sys._getframe(1).f_code is _TORCH_REDISTRIBUTE:
            raise ValueError(
                f"torch's DTensor.redistribute cannot produce {self!r}: it would keep every "
                "rank's local data and only relabel it. Use veragged.redistribute(dt, mesh, "
                "placements), or create the DTensor with veragged.distribute_tensor / "
                "veragged.DTensor.from_local, whose .redistribute does this"
            )
        return False

    def row_range(self, rows: int, rank: int) -> tuple[int, int]:
        """Rows `[begin, end)` of the flattened prefix that rank `rank` holds, out of `rows`."""
        units = self._units
        prefix = units.prefix
        return prefix[rank] * rows // units.total, prefix[rank + 1] * rows // units.total

    def local_numel_and_offset(self, shape: Sequence[int], rank: int) -> tuple[int, int]:
        """Rank `rank`'s local numel and flat offset in a tensor (or block) of shape `shape`."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"{self!r}: rank must be in [0, {self.num_ranks}), got {rank}")
        shape = tuple(shape)
        if len(self.dims) > len(shape):
            raise ValueError(
                f"{self!r}: dims {self.dims} do not fit a tensor of shape {list(shape)}"
            )
        k = len(self.dims)
        rows, row_numel = math.prod(shape[:k]), math.prod(shape[k:])
        self.check_rows(rows)
        begin, end = self.row_range(rows, rank)
        return (end - begin) * row_numel, begin * row_numel

    def check_rows(self, rows: int) -> None:
        """Raise ValueError unless every rank's share of `rows` rows is a whole number of rows."""
        units = self._units
        if rows % units.total and not (units.nonzero == 1):
            raise ValueError(
                f"{self!r}: sum(local_units) = {units.total} does not divide the {rows} rows of "
                f"dims {self.dims}"
            )


class StridedRaggedShard(RaggedShard):
    """A RaggedShard applied after a `Shard(0)` that sits on a later mesh dim (FSDP over TP/EP).

    Each of the `split_factor` dim-0 pieces is ragged-sharded on its own with the same `dims` and
    `local_units`; see [Note: RaggedShard semantics].
    """

    def __init__(self, dims: Sequence[int], local_units: Sequence[int], split_factor: int):
        if type(split_factor) is not int:
            split_factor = _as_int(split_factor, "split_factor")
        if split_factor < 1:
            raise ValueError(
                f"StridedRaggedShard: split_factor must be an int >= 1, got {split_factor!r}"
            )
        super().__init__(dims, local_units)
        object.__setattr__(self, "split_factor", split_factor)
        object.__setattr__(self, "_hash", hash((self._hash, split_factor)))

    split_factor: int

    def _extra(self) -> tuple:
        return (self.split_factor,)

    def __repr__(self) -> str:
        return (
            f"StridedRaggedShard(dims={self.dims}, local_units={_short(self.local_units)}, "
            f"split_factor={self.split_factor})"
        )

    def __str__(self) -> str:
        refuse_torch_caller(self)  # as RaggedShard's
        return f"SRS{self.dims}x{self.split_factor}"

    def __reduce__(self):
        return (type(self), (self.dims, self.local_units, self.split_factor))
