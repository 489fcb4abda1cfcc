"""The single-collective moves between a ragged layout and another layout on one mesh dim.

Every function works on local tensors of one mesh dim's process group and returns a `Pending`:
the collective is already launched (asynchronously), `finish()` waits for it and returns the new
local tensor. A layout is described by its element bounds in the block (see
[Note: ragged layout on an N-D mesh]): rank r of the mesh dim holds flat elements `[b[r], b[r+1])`.

[Note: ragged gathers without world-sized send buffers]
Gloo cannot gather or reduce-scatter unequal pieces (nor take the list forms of all-gather and
all-to-all with unequal pieces), so Ragged -> Replicate and Partial -> Ragged choose between:
- one rank holds everything (root-only layouts, whole tensors on one rank): a broadcast from it,
  or a reduce to it; buffers are exactly the tensor, no padding;
- otherwise an all-gather (reduce-scatter) of pieces padded to the largest piece: the send
  buffer is one padded piece (the full tensor padded, for a reduce-scatter), whatever the world
  size; when every piece has the same size no copy is made before or after. The receive side of
  the all-gather is `world x largest piece`, the price of gloo's equal pieces.
An `all_to_all_single` is no way to gather: each destination's split is a separate part of
one input buffer, so sending the same piece to every rank needs `world` copies of it (the send
buffer of `world x local` elements that an earlier version built for skewed layouts). It
remains the collective for true all-to-alls (ragged <-> ragged, Shard(0), distribute), where each
destination gets different elements and the send buffer is the local shard itself.
Packing and unpacking of padded buffers are one `split` and one `cat` of views, with the split
sizes computed once per layout (cached), not a Python loop over ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from veragged.runtime import caches

__all__ = [
    "Pending",
    "alive",
    "all_gather",
    "all_to_all",
    "done",
    "reduce_scatter",
    "shard0_bounds",
    "slice_local",
]


def alive(group: dist.ProcessGroup) -> bool:
    """Whether `group` is still registered, i.e. not destroyed by `destroy_process_group` since
    it was made (for caches of process groups: a destroyed one must be made again)."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


class Pending:
    """A launched collective: `finish()` waits for it and returns the new local tensor (once)."""

    __slots__ = ("_work", "_finish", "_result")

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._finish = finish
        self._result: torch.Tensor | None = None

    def is_completed(self) -> bool:
        return self._result is not None or self._work is None or self._work.is_completed()

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Pending":
        """The same collective, with `fn` applied to its result."""
        return Pending(self._work, lambda: fn(self._finish()))

    def finish(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._work = self._finish = None
        return self._result


def done(t: torch.Tensor) -> Pending:
    """A result that needs no communication."""
    return Pending(None, lambda: t)


def shard0_bounds(dim0: int, row_numel: int, num_ranks: int) -> tuple[int, ...]:
    """Element bounds of `Shard(0)` (torch.chunk semantics) of a block with `dim0` rows."""
    chunk = -(-dim0 // num_ranks) if num_ranks else 0
    return tuple(min(r * chunk, dim0) * row_numel for r in range(num_ranks + 1))


def slice_local(full: torch.Tensor, bounds: Sequence[int], rank: int) -> Pending:
    """Replicate -> ragged: this rank's elements of the block, copied (no communication)."""
    return done(full.reshape(-1)[bounds[rank] : bounds[rank + 1]].clone())


@dataclass(frozen=True)
class _Ragged:
    """Split sizes of a layout for the padded collectives (one per distinct bounds, cached)."""

    sizes: list[int]  # per rank
    width: int  # the largest piece
    total: int
    holders: tuple[int, ...]  # ranks with a non-empty piece
    even: bool  # every piece is `width` long
    padded: list[int]  # (piece, padding) per rank, interleaved: the padded buffer's parts
    pads: list[int]  # padding after each rank's piece


@caches.register_function("placement.collectives ragged splits")
@functools.lru_cache(maxsize=4096)
def _ragged(bounds: tuple[int, ...]) -> _Ragged:
    sizes = np.diff(np.asarray(bounds, dtype=np.int64))
    width = int(sizes.max()) if len(sizes) else 0
    pads = width - sizes
    return _Ragged(
        sizes=sizes.tolist(),
        width=width,
        total=int(sizes.sum()),
        holders=tuple(np.flatnonzero(sizes).tolist()),
        even=bool((pads == 0).all()),
        padded=np.stack([sizes, pads], axis=1).reshape(-1).tolist(),
        pads=pads.tolist(),
    )


def all_gather(
    local: torch.Tensor, bounds: Sequence[int], group, block_shape: Sequence[int]
) -> Pending:
    """Ragged -> Replicate in one collective ([Note: ragged gathers without world-sized send
    buffers]): a broadcast when one rank holds everything, else an all-gather of pieces padded
    to the largest (no copy when they are equal); no collective for an empty tensor."""
    r = _ragged(tuple(bounds))
    local = local.reshape(-1)
    if r.total == 0:
        return done(local.new_empty(0).view(block_shape))
    if len(r.holders) == 1:
        src = r.holders[0]
        if dist.get_rank(group) == src:
            out = local.clone(memory_format=torch.contiguous_format)
        else:
            out = local.new_empty(r.total)
        work = dist.broadcast(out, group_src=src, group=group, async_op=True)
        return Pending(work, lambda: out.view(block_shape))
    if local.numel() != r.width:
        padded = local.new_empty(r.width)
        padded[: local.numel()].copy_(local)
        local = padded
    elif not local.is_contiguous():
        local = local.contiguous()
    out = local.new_empty(r.width * len(r.sizes))
    work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)

    def finish() -> torch.Tensor:
        if r.even:
            return out.view(block_shape)
        return torch.cat(out.split(r.padded)[0::2]).view(block_shape)

    return Pending(work, finish)


def all_to_all(
    local: torch.Tensor, src_bounds: Sequence[int], dst_bounds: Sequence[int], rank: int, group
) -> Pending:
    """Any flat-interval layout -> another (ragged, root-only, Shard(0)): one all-to-all."""
    send, recv = torch.ops.veragged.interval_overlaps(list(src_bounds), list(dst_bounds), rank)
    local = local.reshape(-1).contiguous()
    out = local.new_empty(sum(recv))
    work = dist.all_to_all_single(
        out, local, output_split_sizes=recv, input_split_sizes=send, group=group, async_op=True
    )
    return Pending(work, lambda: out)


def reduce_scatter(
    full: torch.Tensor, bounds: Sequence[int], rank: int, group, reduce_op: str
) -> Pending:
    """Partial(sum | avg) -> ragged in one collective ([Note: ragged gathers without world-sized
    send buffers]): a reduce when one rank holds everything, else a reduce-scatter of pieces
    padded to the largest; no collective for an empty tensor.

    The reduction is always a SUM (avg divides afterwards): gloo has silently summed for AVG in some
    torch versions (pytorch issue #162338).
    """
    if reduce_op not in ("sum", "avg"):
        raise ValueError(
            f"Partial({reduce_op!r}) -> RaggedShard is not supported; only sum and avg are"
        )
    r = _ragged(tuple(bounds))
    n, width, mine = len(r.sizes), r.width, r.sizes[rank]
    flat = full.reshape(-1)

    def scaled(result: torch.Tensor) -> torch.Tensor:
        return result.div_(n) if reduce_op == "avg" else result

    if r.total == 0:
        return done(flat.new_empty(0))
    if len(r.holders) == 1:
        dst = r.holders[0]
        buf = flat.clone(memory_format=torch.contiguous_format)  # reduced in place
        work = dist.reduce(buf, group_dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Pending(work, lambda: scaled(buf) if rank == dst else flat.new_empty(0))
    if r.even:
        buf = flat.contiguous()
    else:  # each piece followed by its padding: one cat of views
        parts: list = [None] * (2 * n)
        parts[0::2] = flat.split(r.sizes)
        parts[1::2] = flat.new_zeros(n * width - r.total).split(r.pads)
        buf = torch.cat(parts)
    out = flat.new_empty(width)
    work = dist.reduce_scatter_tensor(out, buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, lambda: scaled(out[:mine] if mine != width else out))
