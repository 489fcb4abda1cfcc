"""Moving whole matrices to their owner ranks and updates back, one all-to-all per micro-group.

[Note: Muon matrix exchange]
Every matrix Muon orthogonalises is, on its shard process group, a set of flat element intervals:
rank r holds elements [b[r], b[r+1]) of the row-major matrix (RaggedShard on any granularity,
torch's Shard(0), or everything on one rank for a plain tensor). Under that view:
- gather: each rank packs, owner by owner, its pieces of the micro-group's matrices (in group
  order) into one send buffer; one `all_to_all_single` delivers to each owner, source by source,
  the pieces of the matrices it owns, which it places at their offsets (when an owner receives
  a single matrix the receive buffer already is the matrix: no copy);
- scatter: the owner packs each destination's interval of every update it computed; one more
  `all_to_all_single` returns to each rank exactly its local pieces, which are applied in place.
Both are launched asynchronously, so the next micro-group's gather and the previous one's scatter
are on the wire while an owner runs Newton-Schulz. The issue order (gather 0, gather 1, scatter
0, gather 2, scatter 1, ...) depends only on the plan, which every rank computes identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from veragged.placement.collectives import shard0_bounds
from veragged.placement.layout import ragged_layout
from veragged.placement.ragged_shard import RaggedShard

__all__ = ["MatrixLayout", "matrix_layout", "Exchange"]


@dataclass(frozen=True)
class MatrixLayout:
    """Where a matrix's elements live: `group` (None: all on this rank), every rank's flat
    `bounds` on it (rank r holds [bounds[r], bounds[r + 1])) and this rank's index `rank`."""

    group: dist.ProcessGroup | None
    bounds: tuple[int, ...]
    rank: int

    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    def size(self, r: int) -> int:
        return self.bounds[r + 1] - self.bounds[r]


def matrix_layout(p: torch.Tensor) -> MatrixLayout:
    """The flat-interval layout of `p` (any shape: a plain tensor, or a DTensor sharded on one
    mesh dim by RaggedShard or Shard(0)); NotImplementedError naming the placements otherwise."""
    if not isinstance(p, DTensor):
        return MatrixLayout(None, (0, p.numel()), 0)
    placements, mesh = p.placements, p.device_mesh
    sharded = [i for i, pl in enumerate(placements) if not pl.is_replicate()]
    if not sharded:
        return MatrixLayout(None, (0, p.numel()), 0)
    pl = placements[sharded[0]]
    ok_shard0 = isinstance(pl, Shard) and not isinstance(pl, _StridedShard) and pl.dim == 0
    if len(sharded) > 1 or not (isinstance(pl, RaggedShard) or ok_shard0):
        raise NotImplementedError(
            f"Muon: a parameter of shape {list(p.shape)} has placements {tuple(placements)}; "
            "supported: Replicate, and RaggedShard or Shard(0) on one mesh dim"
        )
    i = sharded[0]
    if isinstance(pl, RaggedShard):
        bounds = ragged_layout(p.shape, mesh, placements).bounds
    else:
        bounds = shard0_bounds(p.shape[0], p.numel() // max(p.shape[0], 1), mesh.size(i))
    return MatrixLayout(mesh.get_group(i), tuple(bounds), mesh.get_coordinate()[i])


class _Inflight:
    """A launched all-to-all and what to do with its receive buffer once it lands."""

    def __init__(self, work, finish: Callable[[], object]):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
        return self._finish()


class Exchange:
    """Gathers and scatters for the micro-groups of one shard process group.

    Args:
        layouts: per matrix (plan index), its MatrixLayout on this group.
        owners: per matrix, the owner's index on this group.
    """

    def __init__(self, group, layouts: Sequence[MatrixLayout], owners: Sequence[int]):
        self.group = group
        self.layouts = layouts
        self.owners = owners
        self.rank = layouts[0].rank
        self.world = layouts[0].world

    def _launch(self, send: torch.Tensor, send_splits, recv_splits, finish) -> _Inflight:
        recv = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(
            recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
            group=self.group, async_op=True,
        )
        return _Inflight(work, lambda: finish(recv))

    def gather(self, items: Sequence[int], pieces: dict[int, torch.Tensor]) -> _Inflight:
        """Send this rank's flat `pieces[i]` of every matrix i in `items` to its owner; the
        result (on `wait()`) maps each matrix this rank owns to its full flat tensor."""
        parts, send_splits = [], [0] * self.world
        for o in range(self.world):
            for i in items:
                if self.owners[i] == o:
                    parts.append(pieces[i].reshape(-1))
                    send_splits[o] += parts[-1].numel()
        mine = [i for i in items if self.owners[i] == self.rank]
        recv_splits = [sum(self.layouts[i].size(s) for i in mine) for s in range(self.world)]
        send = torch.cat(parts) if len(parts) != 1 else parts[0].contiguous()

        def assemble(recv: torch.Tensor) -> dict[int, torch.Tensor]:
            if len(mine) == 1:  # pieces arrive in rank order, which is flat order
                return {mine[0]: recv}
            full = {i: recv.new_empty(self.layouts[i].bounds[-1]) for i in mine}
            pos = 0
            for s in range(self.world):
                for i in mine:
                    b, n = self.layouts[i].bounds[s], self.layouts[i].size(s)
                    full[i][b : b + n].copy_(recv[pos : pos + n])
                    pos += n
            return full

        return self._launch(send, send_splits, recv_splits, assemble)

    def scatter(
        self, items: Sequence[int], updates: dict[int, torch.Tensor], like: torch.Tensor
    ) -> _Inflight:
        """Return each rank its interval of every update this rank owns (`updates[i]`, flat and
        contiguous, of `like`'s dtype and device on every rank); the result (on `wait()`) maps
        every matrix in `items` to this rank's piece."""
        parts, send_splits = [], [0] * self.world
        mine = [i for i in items if self.owners[i] == self.rank]
        for d in range(self.world):
            for i in mine:
                b, e = self.layouts[i].bounds[d], self.layouts[i].bounds[d + 1]
                parts.append(updates[i][b:e])
                send_splits[d] += e - b
        recv_splits = [0] * self.world
        for i in items:
            recv_splits[self.owners[i]] += self.layouts[i].size(self.rank)
        send = torch.cat(parts) if parts else like.new_empty(0)
        return self._launch(send, send_splits, recv_splits, lambda recv: self._split(items, recv))

    def _split(self, items: Sequence[int], recv: torch.Tensor) -> dict[int, torch.Tensor]:
        out, pos = {}, 0
        for o in range(self.world):
            for i in items:
                if self.owners[i] == o:
                    n = self.layouts[i].size(self.rank)
                    out[i] = recv[pos : pos + n]
                    pos += n
        return out
