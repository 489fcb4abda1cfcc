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
Packing has no Python loop over ranks: split sizes and the piece orders of a micro-group come
from numpy over the (matrix x rank) size table once per micro-group (cached), and each buffer is
one `torch.cat` of views (`split` pieces picked in the precomputed order). Every element is sent
once: send buffers hold this rank's pieces (gather) or its owned updates (scatter), never
`world` copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Sequence

import numpy as np
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


def _pick(seq: Sequence, order: Sequence[int]) -> list:
    """`[seq[k] for k in order]`, gathered in C (operator.itemgetter)."""
    if len(order) == 1:
        return [seq[order[0]]]
    return list(itemgetter(*order)(seq)) if order else []


@dataclass(frozen=True)
class _Moves:
    """What one micro-group's gather and scatter send and receive on this rank; every list is
    computed once per micro-group from the plan with numpy ([Note: Muon matrix exchange])."""

    mine: tuple[int, ...]  # the items this rank owns, in item order
    by_owner: tuple[int, ...]  # the items, stably sorted by owner
    piece_splits: list[int]  # this rank's piece of each item in by_owner order
    numels: list[int]  # full numel of each of `mine`
    # gather: per rank, what this rank sends (its pieces, by owner) and receives (its matrices'
    # pieces, by source); the receive buffer cut into pieces (source-major) and the order that
    # makes it matrix-major
    gather_send: list[int]
    gather_recv: list[int]
    gather_pieces: list[int]
    gather_order: list[int]
    # scatter: per rank, the update slices this rank sends and the pieces it receives; each of
    # its updates cut at the ranks' bounds (matrix-major) and the order that makes them
    # destination-major
    scatter_cuts: list[list[int]]
    scatter_order: list[int]


class Exchange:
    """Gathers and scatters for the micro-groups of one shard process group.

    Args:
        layouts: per matrix (plan index), its MatrixLayout on this group.
        owners: per matrix, the owner's index on this group.
    """

    _CACHE_LIMIT = 1024  # distinct micro-groups kept (grad=None patterns can vary per step)

    def __init__(self, group, layouts: Sequence[MatrixLayout], owners: Sequence[int]):
        self.group = group
        self.layouts = layouts
        self.owners = owners
        self.rank = layouts[0].rank
        self.world = layouts[0].world
        self._owner = np.asarray(owners, dtype=np.int64)
        # sizes[i, r]: elements of matrix i on rank r
        self._sizes = np.diff(np.asarray([lay.bounds for lay in layouts], dtype=np.int64), axis=1)
        self._moves: dict[tuple[int, ...], _Moves] = {}

    def _plan(self, items: Sequence[int]) -> _Moves:
        key = tuple(items)
        moves = self._moves.get(key)
        if moves is not None:
            return moves
        world, rank = self.world, self.rank
        idx = np.asarray(key, dtype=np.int64)
        own = self._owner[idx]
        sizes = self._sizes[idx]  # (items, world)
        mine = idx[own == rank]
        mine_sizes = self._sizes[mine]  # (mine, world)
        by_owner = idx[np.argsort(own, kind="stable")]
        mine_count = len(mine)
        # gather: pieces arrive source-major (for s: for i in mine); matrix-major is i * 1 + s *
        # mine_count read in (i, s) order
        to_matrix_major = (np.arange(world)[None, :] * mine_count
                           + np.arange(mine_count)[:, None]).reshape(-1)
        # scatter: cuts are matrix-major (for i in mine: for d); destination-major reads them
        # in (d, i) order
        to_dest_major = (np.arange(mine_count)[None, :] * world
                         + np.arange(world)[:, None]).reshape(-1)
        moves = _Moves(
            mine=tuple(mine.tolist()),
            by_owner=tuple(by_owner.tolist()),
            piece_splits=self._sizes[by_owner, rank].tolist(),
            numels=mine_sizes.sum(axis=1).tolist(),
            gather_send=np.bincount(own, weights=sizes[:, rank], minlength=world)
            .astype(np.int64).tolist(),
            gather_recv=mine_sizes.sum(axis=0).tolist() if mine_count else [0] * world,
            gather_pieces=mine_sizes.T.reshape(-1).tolist(),
            gather_order=to_matrix_major.tolist(),
            scatter_cuts=mine_sizes.tolist(),
            scatter_order=to_dest_major.tolist(),
        )
        if len(self._moves) >= self._CACHE_LIMIT:
            self._moves.clear()
        self._moves[key] = moves
        return moves

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
        mv = self._plan(items)
        parts = [pieces[i].reshape(-1) for i in mv.by_owner]
        send = torch.cat(parts) if len(parts) != 1 else parts[0].contiguous()

        def assemble(recv: torch.Tensor) -> dict[int, torch.Tensor]:
            if len(mv.mine) <= 1:  # pieces arrive in rank order, which is flat order
                return dict(zip(mv.mine, (recv,)))
            full = torch.cat(_pick(recv.split(mv.gather_pieces), mv.gather_order))
            return dict(zip(mv.mine, full.split(mv.numels)))

        return self._launch(send, mv.gather_send, mv.gather_recv, assemble)

    def scatter(
        self, items: Sequence[int], updates: dict[int, torch.Tensor], like: torch.Tensor
    ) -> _Inflight:
        """Return each rank its interval of every update this rank owns (`updates[i]`, flat and
        contiguous, of `like`'s dtype and device on every rank); the result (on `wait()`) maps
        every matrix in `items` to this rank's piece."""
        mv = self._plan(items)
        cuts = [c for i, sizes in zip(mv.mine, mv.scatter_cuts) for c in updates[i].split(sizes)]
        send = torch.cat(_pick(cuts, mv.scatter_order)) if cuts else like.new_empty(0)
        send_splits = mv.gather_recv  # per destination d: the sizes of my matrices there
        recv_splits = mv.gather_send  # per owner o: my pieces of the matrices it owns

        def split(recv: torch.Tensor) -> dict[int, torch.Tensor]:
            return dict(zip(mv.by_owner, recv.split(mv.piece_splits)))

        return self._launch(send, send_splits, recv_splits, split)
