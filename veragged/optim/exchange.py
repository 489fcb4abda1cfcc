"""Moving whole matrices to their owner ranks and updates back, one all-to-all per micro-group.

[Note: Muon matrix exchange]
Every matrix Muon orthogonalises is, on its domain group, a set of pieces, one per rank
([Note: optimizer pieces on N-D meshes]): flat element intervals under FSDP on one mesh dim
(rank r holds [b[r], b[r+1]) of the row-major matrix: RaggedShard on any granularity, torch's
Shard(0)), intervals in another order under FSDP over TP Shard(0) (StridedRaggedShard), strided
row runs under TP Shard(1), everything on one rank for a plain tensor. Under that view:
- gather: each rank packs, owner by owner, its pieces of the micro-group's matrices (in group
  order) into one send buffer; one `all_to_all_single` over the domain group delivers to each
  owner, source by source, the pieces of the matrices it owns, which it assembles: interval
  pieces of all its matrices by one `cat` in offset order (when an owner receives a single
  matrix whose intervals are in rank order the receive buffer already is the matrix: no copy),
  strided pieces written into their runs; every assembled matrix starts on an ALIGN_BYTES
  boundary, as a tensor of its own would ([Note: aligned owner inputs]);
- scatter: the owner cuts each destination's piece of every update it computed; one more
  `all_to_all_single` returns to each rank exactly its local pieces, which are applied in place.
Both are launched asynchronously, so the next micro-group's gather and the previous one's scatter
are on the wire while an owner runs Newton-Schulz. The issue order (gather 0, gather 1, scatter
0, gather 2, scatter 1, ...) depends only on the plan, which every rank of the domain computes
identically, and on the grad-presence verdicts, which are symmetric ([Note: symmetric grad
presence]). Packing has no Python loop over ranks for interval pieces: split sizes and the piece
orders of a micro-group come from numpy over the (matrix x rank) size table once per micro-group
(cached), and each buffer is one `torch.cat` of views; strided pieces (TP Shard(1)) are one copy
per piece. Every element is sent once: send buffers hold this rank's pieces (gather) or its
owned updates (scatter), never `world` copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from veragged.dbuffer.ops import ALIGN_BYTES
from veragged.optim.pieces import MatrixLayout, matrix_layout, pick

__all__ = ["MatrixLayout", "matrix_layout", "Exchange"]


class _Inflight:
    """A launched all-to-all and what to do with its receive buffer once it lands."""

    def __init__(self, work, finish: Callable[[], object]):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
        return self._finish()


@dataclass(frozen=True)
class _Moves:
    """What one micro-group's gather and scatter send and receive on this rank; every list is
    computed once per micro-group from the plan with numpy ([Note: Muon matrix exchange])."""

    mine: tuple[int, ...]  # the items this rank owns, in item order
    by_owner: tuple[int, ...]  # the items, stably sorted by owner
    piece_splits: list[int]  # this rank's piece of each item in by_owner order
    # gather: per rank, what this rank sends (its pieces, by owner) and receives (its matrices'
    # pieces, by source); the receive buffer cut into pieces (source-major)
    gather_send: list[int]
    gather_recv: list[int]
    gather_pieces: list[int]
    direct: bool  # one owned matrix whose pieces in source order are the matrix
    flat: tuple[int, ...]  # owned matrices with interval pieces, assembled by one cat:
    flat_order: list[int]  # their pieces in (matrix, offset) order,
    flat_numels: list[int]  # and their numels
    strided: tuple[tuple[int, list[int]], ...]  # the others: (item, its pieces by source)
    # scatter: the order that makes the owned updates' cuts (matrix-major, rank order)
    # destination-major
    scatter_order: list[int]


class Exchange:
    """Gathers and scatters for the micro-groups of one domain process group.

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
        self._sizes = np.asarray([lay.sizes for lay in layouts], dtype=np.int64)
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
        count = len(mine)
        layouts = [self.layouts[i] for i in mine.tolist()]
        # gather: pieces arrive source-major, piece (s, j) at s * count + j
        flat = [j for j, lay in enumerate(layouts) if lay.flat]
        flat_order = [s * count + j for j in flat for s in layouts[j]._sorted[0]]
        strided = tuple(
            (int(mine[j]), [s * count + j for s in range(world)])
            for j, lay in enumerate(layouts) if not lay.flat
        )
        # scatter: cuts are matrix-major (for i in mine: for d); destination-major reads them
        # in (d, i) order
        to_dest_major = (np.arange(count)[None, :] * world
                         + np.arange(world)[:, None]).reshape(-1)
        moves = _Moves(
            mine=tuple(mine.tolist()),
            by_owner=tuple(by_owner.tolist()),
            piece_splits=self._sizes[by_owner, rank].tolist(),
            gather_send=np.bincount(own, weights=sizes[:, rank], minlength=world)
            .astype(np.int64).tolist(),
            gather_recv=mine_sizes.sum(axis=0).tolist() if count else [0] * world,
            gather_pieces=mine_sizes.T.reshape(-1).tolist(),
            direct=count == 1 and layouts[0].in_rank_order,
            flat=tuple(int(mine[j]) for j in flat),
            flat_order=flat_order,
            flat_numels=[layouts[j].numel for j in flat],
            strided=strided,
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
            if not mv.mine:
                return {}
            if mv.direct:  # pieces arrive in rank order, which is flat order
                return {mv.mine[0]: recv}
            split = recv.split(mv.gather_pieces)
            out: dict[int, torch.Tensor] = {}
            if mv.flat:
                out.update(zip(mv.flat, _aligned_cat(pick(split, mv.flat_order),
                                                     mv.flat_numels, recv)))
            for i, order in mv.strided:
                out[i] = self.layouts[i].assemble(pick(split, order))
            return out

        return self._launch(send, mv.gather_send, mv.gather_recv, assemble)

    def scatter(
        self, items: Sequence[int], updates: dict[int, torch.Tensor], like: torch.Tensor
    ) -> _Inflight:
        """Return each rank its piece of every update this rank owns (`updates[i]`, flat and
        contiguous, of `like`'s dtype and device on every rank); the result (on `wait()`) maps
        every matrix in `items` to this rank's piece."""
        mv = self._plan(items)
        cuts = [c for i in mv.mine for c in self.layouts[i].cut(updates[i])]
        send = torch.cat(pick(cuts, mv.scatter_order)) if cuts else like.new_empty(0)
        send_splits = mv.gather_recv  # per destination d: the sizes of my matrices there
        recv_splits = mv.gather_send  # per owner o: my pieces of the matrices it owns

        def split(recv: torch.Tensor) -> dict[int, torch.Tensor]:
            return dict(zip(mv.by_owner, recv.split(mv.piece_splits)))

        return self._launch(send, send_splits, recv_splits, split)


# [Note: aligned owner inputs]
# BLAS and LAPACK results can depend on where a matrix starts in memory: MKL picks its kernels
# (and so its summation order) by alignment, unless conditional numerical reproducibility is
# forced, and cuBLAS picks by alignment too. A single process hands `_compute` a gradient or
# momentum buffer of its own allocation, so the owner must hand it matrices that start on an
# allocation-like boundary as well, or distributed results stop being bitwise the
# single-process ones (seen: a 7 x 5 Shampoo factor one ulp apart after a root refresh when the
# matrix sat 28 bytes into the receive buffer). The owners' matrices are therefore assembled
# into one buffer with each start rounded up to ALIGN_BYTES (64-byte CPU allocations and
# 512-byte CUDA ones are multiples or divisors of it: a multiple of 256 bytes into a buffer
# the allocator aligned to at least 64 is as aligned as a fresh tensor is).


def _aligned_cat(parts: list[torch.Tensor], numels: Sequence[int],
                 like: torch.Tensor) -> list[torch.Tensor]:
    """`torch.cat(parts).split(numels)`, except that every matrix starts on an ALIGN_BYTES
    boundary of the buffer ([Note: aligned owner inputs]); `parts` holds the same number of
    pieces for every matrix, matrix by matrix."""
    align = max(1, ALIGN_BYTES // like.element_size())
    per = len(parts) // len(numels)
    starts, seq, end = [], [], 0
    filler = like.new_empty(align)
    for j, n in enumerate(numels):
        pad = -end % align
        if pad:
            seq.append(filler[:pad])
        starts.append(end + pad)
        end += pad + n
        seq.extend(parts[j * per:(j + 1) * per])
    full = torch.cat(seq)
    return [full.narrow(0, s, n) for s, n in zip(starts, numels)]
