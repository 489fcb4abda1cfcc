"""The single-collective moves between a ragged layout and another layout on one mesh dim.

Every function works on local tensors of one mesh dim's process group and returns a `Pending`:
the collective is already launched (asynchronously), `finish()` waits for it and returns the new
local tensor. A layout is described by its element bounds in the block (see
[Note: ragged layout on an N-D mesh]): rank r of the mesh dim holds flat elements `[b[r], b[r+1])`.
Gloo cannot gather or reduce-scatter unequal pieces, so those collectives run on buffers padded
to the largest piece; when every piece has the same size, no copy is made before or after.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Pending",
    "all_gather",
    "all_to_all",
    "done",
    "reduce_scatter",
    "shard0_bounds",
    "slice_local",
]


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


def _sizes(bounds: Sequence[int]) -> list[int]:
    return [bounds[r + 1] - bounds[r] for r in range(len(bounds) - 1)]


def shard0_bounds(dim0: int, row_numel: int, num_ranks: int) -> tuple[int, ...]:
    """Element bounds of `Shard(0)` (torch.chunk semantics) of a block with `dim0` rows."""
    chunk = -(-dim0 // num_ranks) if num_ranks else 0
    return tuple(min(r * chunk, dim0) * row_numel for r in range(num_ranks + 1))


def slice_local(full: torch.Tensor, bounds: Sequence[int], rank: int) -> Pending:
    """Replicate -> ragged: this rank's elements of the block, copied (no communication)."""
    return done(full.reshape(-1)[bounds[rank] : bounds[rank + 1]].clone())


# A gather whose padded all-gather would move more than this fraction of extra bytes runs as an
# all-to-all of the exact pieces instead (see `all_gather`).
PADDING_LIMIT = 0.125


def all_gather(
    local: torch.Tensor, bounds: Sequence[int], group, block_shape: Sequence[int]
) -> Pending:
    """Ragged -> Replicate in one collective.

    Pieces of (nearly) equal size: an all-gather of pieces padded to the largest, then a view of
    the output (no copy when they are equal). Pieces so uneven that padding would add more than
    `PADDING_LIMIT` of the tensor's bytes (root-heavy or skewed `local_units`): an all-to-all
    that sends this rank's piece to every rank and receives every piece at its final place, so
    the wire carries no padding and the output needs no compaction; the price is a send buffer
    of `world * local` elements.
    """
    sizes = _sizes(bounds)
    width, total, n = max(sizes), bounds[-1], len(sizes)
    local = local.reshape(-1)
    if n * width - total > PADDING_LIMIT * total:
        send = local.repeat(n)  # contiguous, also for an empty piece
        out = local.new_empty(total)
        work = dist.all_to_all_single(
            out, send, output_split_sizes=sizes, input_split_sizes=[local.numel()] * n,
            group=group, async_op=True,
        )
        return Pending(work, lambda: out.view(block_shape))
    if local.numel() != width:
        padded = local.new_empty(width)
        padded[: local.numel()].copy_(local)
        local = padded
    elif not local.is_contiguous():
        local = local.contiguous()
    out = local.new_empty(width * n)
    work = dist.all_gather_into_tensor(out, local, group=group, async_op=True)

    def finish() -> torch.Tensor:
        if all(s == width for s in sizes):
            return out.view(block_shape)
        rows = out.view(n, width)
        return torch.cat([rows[r, :s] for r, s in enumerate(sizes) if s]).view(block_shape)

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
    """Partial(sum | avg) -> ragged: one reduce-scatter of pieces padded to the largest.

    The reduction is always a SUM (avg divides afterwards): gloo has silently summed for AVG in some
    torch versions (pytorch issue #162338).
    """
    if reduce_op not in ("sum", "avg"):
        raise ValueError(
            f"Partial({reduce_op!r}) -> RaggedShard is not supported; only sum and avg are"
        )
    sizes = _sizes(bounds)
    width, n = max(sizes), len(sizes)
    flat = full.reshape(-1)
    if all(s == width for s in sizes):
        buf = flat.contiguous()
    else:
        buf = flat.new_zeros(n * width)
        rows = buf.view(n, width)
        for r, s in enumerate(sizes):
            if s:
                rows[r, :s].copy_(flat[bounds[r] : bounds[r + 1]])
    out = flat.new_empty(width)
    work = dist.reduce_scatter_tensor(out, buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
    mine = sizes[rank]

    def finish() -> torch.Tensor:
        result = out[:mine] if mine != width else out
        return result.div_(n) if reduce_op == "avg" else result

    return Pending(work, finish)
