"""`plan()` and `Layout`: the Python face of the C++ planner (csrc/planner)."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from veragged.runtime import caches

__all__ = ["Layout", "plan", "ORDERS"]

#: Names of the ways a layout can be found, in the planner's tie-breaking preference
#: (``Order`` in csrc/planner/planner.h).
ORDERS = ("given", "block_size", "shape", "fill", "fill_large", "exact")

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a group lives in a buffer of ``world_size * shard_size`` elements.

    Rank ``k`` owns buffer elements ``[k * shard_size, (k + 1) * shard_size)``. The rules every
    layout satisfies are in ``[Note: planner layout contract]`` (csrc/planner/planner.h).

    Attributes:
        shard_size: elements per rank, the same on every rank, a multiple of ``align``.
        padding: ``world_size * shard_size - sum(numels)``.
        ranges: per input tensor, in input order, its ``(start, end)`` in the global buffer.
        block_sizes: per input tensor, its block size in elements (as given).
        world_size: number of ranks.
        order: how this layout was found: the tensor orders ``"given"``, ``"block_size"``,
            ``"shape"`` (the paper's three), ``"fill"`` (chosen while placing, least padding
            first), ``"fill_large"`` (chosen while placing, larger blocks may pad half a
            block), or ``"exact"`` (the best of every order, searched exhaustively on small
            groups).
        permutation: input indices in buffer order.
    """

    shard_size: int
    padding: int
    ranges: tuple[tuple[int, int], ...]
    block_sizes: tuple[int, ...]
    world_size: int
    order: str
    permutation: tuple[int, ...]

    def rank_units(self, tensor: int) -> dict[int, int]:
        """Blocks of tensor ``tensor`` held by each rank that holds any, as ``{rank: count}``."""
        start, end = self.ranges[tensor]
        if end == start:
            return {}
        s, g = self.shard_size, self.block_sizes[tensor]
        first, last = start // s, (end - 1) // s
        return {k: (min(end, (k + 1) * s) - max(start, k * s)) // g for k in range(first, last + 1)}

    @functools.cached_property
    def units(self) -> tuple[tuple[int, ...], ...]:
        """Per input tensor, a tuple with the number of its blocks on each rank (zeros too)."""
        out = []
        for t in range(len(self.ranges)):
            counts = [0] * self.world_size
            for rank, count in self.rank_units(t).items():
                counts[rank] = count
            out.append(tuple(counts))
        return tuple(out)


def _as_int(name: str, value) -> int:
    if type(value) is not int:  # bool is an int subclass but never a size
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{name} must be an int, got {value!r}")
        value = operator.index(value)
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        raise ValueError(f"{name} = {value} does not fit in int64")
    return value


def plan(
    numels: Sequence[int], block_sizes: Sequence[int], world_size: int, align: int = 1
) -> Layout:
    """Plans one buffer for a group of tensors (veScale-FSDP Algorithm 1).

    Args:
        numels: element count of each tensor, in the order the caller would lay them out.
        block_sizes: each tensor's block size in elements; it must divide the numel. ``1`` is
            element-wise, a row's numel (``shape[1:]``) is row-wise, the numel is whole-tensor.
        world_size: number of ranks sharing the buffer.
        align: the shard size is a multiple of this many elements (collective alignment).

    Returns:
        A frozen :class:`Layout`. Identical arguments return the same (cached) object.

    Raises:
        ValueError: lengths differ, a numel is negative, a block size is < 1 or does not divide
            its numel, ``world_size < 1`` or ``align < 1``; the message names the tensor index
            and the values.
        TypeError: a size is not an int.
    """
    numels = _as_ints("numels", numels)
    block_sizes = _as_ints("block_sizes", block_sizes)
    return _plan_cached(
        numels, block_sizes, _as_int("world_size", world_size), _as_int("align", align)
    )


def _as_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(values)
    # Fast path in a C loop (groups can hold thousands of tensors): exact ints only. The int64
    # range is left to the op, which rejects a value outside it (_plan_cached then names it);
    # the slow path names any other culprit.
    if set(map(type, out)) <= {int}:
        return out
    return tuple(_as_int(f"{name}[{i}]", v) for i, v in enumerate(out))


@caches.register_function("planner plans")
@functools.lru_cache(maxsize=512)
def _plan_cached(
    numels: tuple[int, ...], block_sizes: tuple[int, ...], world_size: int, align: int
) -> Layout:
    # FSDP wraps many identical blocks; planning each distinct group once is enough.
    try:
        shard_size, starts, permutation, order = torch.ops.veragged.plan_layout(
            numels, block_sizes, world_size, align
        )
    except RuntimeError:  # the op's argument parser: a value outside int64
        for name, values in (("numels", numels), ("block_sizes", block_sizes)):
            for i, value in enumerate(values):
                _as_int(f"{name}[{i}]", value)  # raises ValueError naming it
        raise
    return Layout(
        shard_size=shard_size,
        padding=world_size * shard_size - sum(numels),
        ranges=tuple(zip(starts, map(operator.add, starts, numels), strict=True)),
        block_sizes=block_sizes,
        world_size=world_size,
        order=ORDERS[order],
        permutation=tuple(permutation),
    )


#: Drops every cached plan (benchmarks use it to time planning from scratch).
plan.cache_clear = _plan_cached.cache_clear
