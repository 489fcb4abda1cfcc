"""Where a (DTensor) parameter's elements live on the ranks that shard it: `MatrixLayout`.

[Note: optimizer pieces on N-D meshes]
A DTensor parameter's *domain* is the set of its mesh dims whose placement is not Replicate:
FSDP's RaggedShard / StridedRaggedShard (or torch's Shard(0)), TP's Shard(d), EP's Shard(0). The
other mesh dims (HSDP's replicate dim, a TP dim the parameter is replicated on) hold copies. The
ranks of one domain (the mesh dim's group when the domain is one dim, else one process group
over the flattened domain dims, in global-rank order: `domain_group`) hold disjoint *pieces*
that together make the tensor; Muon's exchanges run within one domain group, so replicas repeat
the same work on their own copies (as HSDP's replica groups do on one mesh dim).
Under [Note: ragged layout on an N-D mesh] a piece is the block that the Shard placements cut
(torch.chunk of one tensor dim d, on every mesh dim that shards it, in mesh order), then a
ragged row range of that block. So every piece is `count` runs of `length` consecutive elements
of the row-major tensor, `stride` apart, starting at flat `offset`:
- no Shard, or d = 0: the block is contiguous, so the piece is one run (a flat interval);
- d > 0: the ragged rows stop before dim d (the LCM rule), so the piece is whole block rows, each
  one run of `prod(local_shape[d:])` elements, `prod(shape[d:])` apart.
A rank's local tensor is exactly its runs, in order, flattened. Assembling a tensor from pieces
writes each piece into its runs (one `cat` when every piece is an interval); cutting a tensor
into pieces reads them back (views for intervals). Placements this does not describe (torch's
_StridedShard, Partial, Shard on two tensor dims) raise NotImplementedError naming them, and the
piece of this rank is checked against its local tensor's size when the layout is built.
The layout depends only on shapes, placements and the mesh, so all ranks agree on it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from veragged.placement.collectives import alive
from veragged.placement.ragged_shard import RaggedShard

__all__ = ["MatrixLayout", "check_placements", "domain_group", "domain_groups", "matrix_layout",
           "shard_blocks", "slice_layout"]

# Sorted ranks -> the optimizers' process group over them, made once and reused by any later
# mesh (domain_group). Not a cache ([Note: module caches]): a group is kept, not re-made.
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def domain_groups() -> list[dist.ProcessGroup]:
    """The process groups the optimizers made so far (one per set of ranks)."""
    return list(_GROUPS.values())


def pick(seq: Sequence, order: Sequence[int]) -> list:
    """`[seq[k] for k in order]`, gathered in C (operator.itemgetter)."""
    if len(order) == 1:
        return [seq[order[0]]]
    return list(itemgetter(*order)(seq)) if order else []


@dataclass(frozen=True, eq=False)
class MatrixLayout:
    """The pieces of one tensor on its domain ([Note: optimizer pieces on N-D meshes]).

    Attributes:
        group: the domain's process group (None: the whole tensor is on this rank).
        rank: this rank's index in `group` (0 without a group).
        numel: elements of the (global) tensor.
        offsets, counts, lengths, strides: per domain rank, its piece: `counts[r]` runs of
            `lengths[r]` elements, `strides[r]` apart, from flat `offsets[r]` (0, 0, 0, 0 when
            empty; `counts[r] == 1` for an interval).
    """

    group: dist.ProcessGroup | None
    rank: int
    numel: int
    offsets: tuple[int, ...]
    counts: tuple[int, ...]
    lengths: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.offsets)

    def size(self, r: int) -> int:
        return self.counts[r] * self.lengths[r]

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(c * n for c, n in zip(self.counts, self.lengths))

    @functools.cached_property
    def flat(self) -> bool:
        """Every piece is one flat interval."""
        return all(c <= 1 for c in self.counts)

    @functools.cached_property
    def in_rank_order(self) -> bool:
        """Flat, and rank r's interval starts where rank r-1's ends: the pieces concatenated
        in rank order are the tensor (FSDP on one mesh dim)."""
        start = 0
        for off, n in zip(self.offsets, self.sizes):
            if n and off != start:
                return False
            start += n
        return self.flat

    @functools.cached_property
    def bounds(self) -> tuple[int, ...]:
        """Flat bounds (rank r holds [b[r], b[r+1])); only for layouts `in_rank_order`."""
        if not self.in_rank_order:
            raise ValueError(
                "MatrixLayout.bounds: the pieces are not flat intervals in rank order "
                f"(offsets {self.offsets}, counts {self.counts}, lengths {self.lengths})"
            )
        return (0, *np.cumsum(self.sizes, dtype=np.int64).tolist())

    @functools.cached_property
    def _sorted(self) -> tuple[list[int], list[int], list[int]]:
        """For a flat layout: ranks by offset, their sizes, and each rank's position."""
        order = np.argsort(np.asarray(self.offsets, dtype=np.int64), kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        sizes = np.asarray(self.sizes, dtype=np.int64)[order]
        return order.tolist(), sizes.tolist(), position.tolist()

    def _view(self, full: torch.Tensor, r: int) -> torch.Tensor:
        off, count, length, stride = (self.offsets[r], self.counts[r], self.lengths[r],
                                      self.strides[r])
        if count <= 1:
            return full.narrow(0, off, count * length)
        return full.as_strided((count, length), (stride, 1), full.storage_offset() + off)

    def cut(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Every domain rank's piece of the flat, contiguous `full`, in rank order (views for
        intervals, copies for strided pieces)."""
        if self.in_rank_order:
            return list(full.split(self.sizes))
        if self.flat:
            order, sizes, position = self._sorted
            return pick(full.split(sizes), position)
        return [self._view(full, r).reshape(-1) for r in range(self.world)]

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the flat, contiguous `full`."""
        return self._view(full, self.rank).reshape(-1)

    def assemble(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The flat tensor from every domain rank's flat piece (rank order)."""
        if self.world == 1:
            return pieces[0]
        if self.flat:
            return torch.cat(pick(pieces, self._sorted[0]))
        full = pieces[0].new_empty(self.numel)
        for r, piece in enumerate(pieces):
            if self.sizes[r]:
                view = self._view(full, r)
                view.copy_(piece.view(view.shape))
        return full


def domain_group(mesh, dims: Sequence[int]) -> tuple[dist.ProcessGroup, list[tuple[int, ...]]]:
    """The process group of the mesh dims `dims` through this rank, and per group rank its
    coordinates on `dims`. One dim: the mesh's own group (its rank is the coordinate). Several:
    one group over their ranks in global-rank order, made once per rank set with
    `new_group(use_local_synchronization=True)` (only its members take part, so meshes of other
    pipeline stages never wait on it)."""
    dims = tuple(dims)
    if len(dims) == 1:
        n = mesh.size(dims[0])
        return mesh.get_group(dims[0]), [(c,) for c in range(n)]
    coord = mesh.get_coordinate()
    index = tuple(slice(None) if j in dims else coord[j] for j in range(mesh.ndim))
    sub = mesh.mesh[index].numpy()
    ranks = sub.reshape(-1)
    coords = np.stack(np.unravel_index(np.arange(ranks.size), sub.shape), axis=1)
    order = np.argsort(ranks, kind="stable")
    key = tuple(ranks[order].tolist())
    group = _GROUPS.get(key)
    if group is None or not alive(group):
        group = dist.new_group(list(key), use_local_synchronization=True)
        _GROUPS[key] = group
    return group, [tuple(c) for c in coords[order].tolist()]


def shard_blocks(shape: Sequence[int], mesh, placements: Sequence[Placement],
                 coords: np.ndarray) -> tuple[int | None, np.ndarray, np.ndarray]:
    """The tensor dim d the plain Shard placements cut (None: none), and per row of `coords`
    (mesh coordinates, one column per mesh dim) the size and offset of the block along d: torch's
    Shard (torch.chunk) applied on each mesh dim in order. NotImplementedError for Shard
    placements on two tensor dims."""
    d = None
    n = len(coords)
    size = np.full(n, 0, dtype=np.int64)
    offset = np.zeros(n, dtype=np.int64)
    for j, pl in enumerate(placements):
        if type(pl) is not Shard:
            continue
        dim = pl.dim if pl.dim >= 0 else pl.dim + len(shape)
        if d is None:
            d = dim
            size[:] = shape[d]
        elif dim != d:
            raise NotImplementedError(
                f"placements {tuple(placements)} shard tensor dims {d} and {dim} of a tensor of "
                f"shape {list(shape)}; the optimizers support Shard on one tensor dim"
            )
        ranks = mesh.size(j)
        chunk = -(-size // ranks)
        start = chunk * coords[:, j]
        local = np.clip(np.minimum(size, start + chunk) - start, 0, None)
        offset += np.minimum(start, size)
        size = local
    return d, size, offset


def check_placements(p: torch.Tensor) -> list[int]:
    """The mesh dims that shard `p` (its domain), after checking that `matrix_layout` describes
    its placements (NotImplementedError naming them otherwise); no communication."""
    if not isinstance(p, DTensor):
        return []
    dims = []
    for j, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            continue
        if not (type(pl) is Shard or isinstance(pl, RaggedShard)):
            raise NotImplementedError(
                f"a parameter of shape {list(p.shape)} has placements {tuple(p.placements)}; "
                "supported: Replicate, Shard(d) (torch.chunk, on one tensor dim) and "
                "RaggedShard / StridedRaggedShard on one mesh dim"
            )
        dims.append(j)
    coords = np.asarray([p.device_mesh.get_coordinate()], dtype=np.int64)
    shard_blocks(tuple(p.shape), p.device_mesh, tuple(p.placements), coords)
    return dims


def matrix_layout(p: torch.Tensor) -> MatrixLayout:
    """The pieces of `p` on its domain ([Note: optimizer pieces on N-D meshes]): a plain tensor
    or a DTensor whose placements are Replicate, Shard(d) (one tensor dim) and at most one
    RaggedShard; NotImplementedError naming the placements otherwise."""
    n = p.numel()
    if not isinstance(p, DTensor):
        return MatrixLayout(None, 0, n, (0,), (1,), (n,), (n,))
    dims = check_placements(p)
    if not dims:
        return MatrixLayout(None, 0, n, (0,), (1,), (n,), (n,))
    mesh, placements, shape = p.device_mesh, tuple(p.placements), tuple(p.shape)
    group, domain = domain_group(mesh, dims)
    mine = tuple(mesh.get_coordinate()[j] for j in dims)
    rank = domain.index(mine)
    if dist.get_rank(group) != rank:
        raise NotImplementedError(
            f"mesh {mesh}: this rank is {dist.get_rank(group)} in the group of mesh dims {dims} "
            f"but has index {rank} among its ranks in global order"
        )
    coords = np.zeros((len(domain), mesh.ndim), dtype=np.int64)
    coords[:, dims] = np.asarray(domain, dtype=np.int64)
    offsets, counts, lengths, strides = _pieces(shape, mesh, placements, coords)
    layout = MatrixLayout(group, rank, n, offsets, counts, lengths, strides)
    local = p._local_tensor.numel()
    if layout.size(rank) != local:
        raise NotImplementedError(
            f"placements {placements} of a tensor of shape {list(shape)}: this rank's piece "
            f"should hold {layout.size(rank)} elements but its local tensor has {local}"
        )
    return layout


def _pieces(shape, mesh, placements, coords):
    """Per row of `coords`: (offset, count, length, stride) tuples of the pieces."""
    d, size, block_offset = shard_blocks(shape, mesh, placements, coords)
    block = np.tile(np.asarray(shape, dtype=np.int64), (len(coords), 1))
    if d is not None:
        block[:, d] = size
    ragged = [j for j, pl in enumerate(placements) if isinstance(pl, RaggedShard)]
    numel = block.prod(axis=1)
    begin, end = np.zeros_like(numel), numel.copy()
    if ragged:
        j = ragged[0]
        pl = placements[j]
        k = len(pl.dims)
        rows, row_numel = block[:, :k].prod(axis=1), block[:, k:].prod(axis=1)
        prefix = np.asarray(pl._units.prefix, dtype=np.int64)
        total = pl._units.total
        c = coords[:, j]
        begin = prefix[c] * rows // total * row_numel
        end = prefix[c + 1] * rows // total * row_numel
    inner = math.prod(shape[d + 1:]) if d is not None else 1
    if d is None or d == 0:  # one contiguous block: the piece is an interval
        start = block_offset * inner if d == 0 else np.zeros_like(numel)
        offsets, counts, lengths = start + begin, np.ones_like(numel), end - begin
        strides = lengths
    else:
        row = size * inner  # a block row: one run
        global_row = shape[d] * inner
        safe = np.maximum(row, 1)
        if ((begin % safe) != 0).any() or ((end % safe) != 0).any():
            raise NotImplementedError(
                f"placements {tuple(placements)} of a tensor of shape {list(shape)} cut rows "
                f"of the Shard({d}) block (the LCM rule keeps them whole)"
            )
        counts = (end - begin) // safe
        offsets = (begin // safe) * global_row + block_offset * inner
        lengths, strides = row, np.full_like(row, global_row)
        whole = (counts == 1) | (row == global_row)  # one run after all
        lengths = np.where(whole, counts * row, lengths)
        strides = np.where(whole, lengths, strides)
        counts = np.where(whole, 1, counts)
    empty = counts * lengths == 0
    out = []
    for a in (offsets, counts, lengths, strides):
        out.append(tuple(np.where(empty, 0, a).tolist()))
    return tuple(out)


# [Note: matrices of a stack]
# An expert stack [E, out, in] (or any tensor whose leading dims batch matrices) is optimised as
# E matrices. Matrix e is the flat range [e * M, (e + 1) * M) of the row-major tensor, M = out *
# in, so its pieces are the intersections of that range with every rank's runs: one interval
# where a rank's piece is an interval (FSDP, EP's Shard(0), TP on a stack dim, whose runs hold
# whole matrices) or where one run covers the matrix; whole runs, `stride` apart, where TP cuts
# a dim of the matrix (Shard on `in`: one run per row; on `out`: one run, an interval). Either
# way it is a MatrixLayout of its own, and on each rank the piece is a contiguous range of the
# local tensor (the rank's runs are stored in order), so a stack's matrices are views of the
# local shard, of its gradient and of its state.


def slice_layout(layout: MatrixLayout, start: int,
                 numel: int) -> tuple[MatrixLayout, tuple[int, int]]:
    """The layout of the flat range [start, start + numel) of `layout`'s tensor ([Note: matrices
    of a stack]), and this rank's piece of it as a range of its local (flat) tensor."""
    offsets, counts, lengths, strides, spans = [], [], [], [], []
    for r in range(layout.world):
        piece, span = _slice_piece(layout.offsets[r], layout.counts[r], layout.lengths[r],
                                   layout.strides[r], start, numel)
        for out, v in zip((offsets, counts, lengths, strides), piece):
            out.append(v)
        spans.append(span)
    sub = MatrixLayout(layout.group, layout.rank, numel, tuple(offsets), tuple(counts),
                       tuple(lengths), tuple(strides))
    return sub, spans[layout.rank]


def _slice_piece(off: int, count: int, length: int, stride: int, start: int, numel: int):
    """((offset, count, length, stride) relative to `start`, (local begin, local end)) of one
    rank's piece cut to [start, start + numel)."""
    end = start + numel
    if count * length == 0:
        return (0, 0, 0, 0), (0, 0)
    if count <= 1:
        lo, hi = max(off, start), min(off + length, end)
        if hi <= lo:
            return (0, 0, 0, 0), (0, 0)
        return (lo - start, 1, hi - lo, hi - lo), (lo - off, hi - off)
    first = max(0, (start - off - length) // stride)
    last = min(count, (end - off) // stride + 1)
    runs = []
    for k in range(first, last):
        lo, hi = max(off + k * stride, start), min(off + k * stride + length, end)
        if hi > lo:
            runs.append((k, lo, hi))
    if not runs:
        return (0, 0, 0, 0), (0, 0)
    if len(runs) == 1:
        k, lo, hi = runs[0]
        local = k * length + lo - (off + k * stride)
        return (lo - start, 1, hi - lo, hi - lo), (local, local + hi - lo)
    if any(hi - lo != length for _, lo, hi in runs):
        raise NotImplementedError(
            f"a matrix of {numel} elements at flat offset {start} cuts runs of {length} "
            f"elements ({stride} apart) of a rank's piece; the optimizers take stacks whose "
            "matrices hold whole runs or lie within one")
    k0, k1 = runs[0][0], runs[-1][0]
    return ((runs[0][1] - start, k1 - k0 + 1, length, stride),
            (k0 * length, (k1 + 1) * length))
