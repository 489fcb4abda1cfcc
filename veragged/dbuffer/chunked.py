"""ChunkedDBuffer: parameters sharded as torch's `Shard(d)` with d > 0, in one flat buffer.

[Note: chunked parameters]
`fully_shard(shard_placement_fn=...)` returning `Shard(d)` for d > 0 asks for torch's layout:
dim d cut into P equal chunks (torch requires `shape[d] % P == 0` there), rank r holding chunk r
as a contiguous tensor of shape `shape[:d] + (shape[d] / P,) + shape[d+1:]`. A chunk is not a
contiguous run of the full tensor, so no planned layout can make the unsharded parameter a view
of the all-gather output. These tensors get a DBuffer of their own, laid out as torch lays them:
- the shard (S elements) holds every tensor's chunk, one after another, at the same offset
  `off` on every rank; the sharded parameters are plain torch DTensors with `Shard(d)` (so
  torch's ops, optimizers, `distribute_tensor` and state-dict tooling take them as they are);
- the all-gather output is rank-major (rank r's shard at `[r * S, (r + 1) * S)`); one copy per
  tensor moves it into the unsharded buffer, where each tensor is contiguous in its full shape
  (`start = P * off`), as torch's FSDP2 copies out of its all-gather buffer for `Shard(d > 0)`;
- gradients land in the full layout and one copy per tensor rearranges them rank-major for the
  reduce-scatter, as FSDP2 does before its reduce-scatter.
Everything else (mixed precision, no-sync accumulation, unreached parameters, HSDP,
`reshard_after_forward=k`) is `DBuffer`'s, which reaches the layouts only through
`_gather_output`, `_finish_gather` and `rank_major`.
A tensor/expert-parallel parameter ([Note: FSDP over TP]; torchtitan shards experts `[E, ...]`
this way when there are fewer local experts than dp ranks) is chunked by its local TP block,
which TP must cut evenly; its sharded parameter is a torch DTensor on the combined mesh with
`(Shard(d), *tp placements)`: DTensor applies the dp chunking of dim d to the global tensor and
the TP split of another dim after it, which gives the same local chunk.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from veragged.dbuffer.buffer import DBuffer
from veragged.dbuffer.entries import Entry as _Entry
from veragged.placement.tensor import make_spec

__all__ = ["ChunkedDBuffer"]


class ChunkedDBuffer(DBuffer):
    """A DBuffer whose tensors are sharded in P equal chunks along `dims[i]` (torch's `Shard(d)`).

    Args: as `DBuffer`, with `dims` (one per tensor, `shape[d] % P == 0`) in place of
    `block_sizes`. See [Note: chunked parameters].
    """

    GRADS_RANK_MAJOR = False  # gradients land in the full layout; `rank_major` adds the flags

    def __init__(self, tensors, mesh, *, dims, **kwargs):
        self._dims = list(dims)
        if len(self._dims) != len(tensors):
            raise ValueError(f"ChunkedDBuffer: {len(tensors)} tensors but {len(self._dims)} dims")
        if kwargs.get("block_sizes") is not None:
            raise ValueError("ChunkedDBuffer: chunks are whole; block_sizes does not apply")
        super().__init__(tensors, mesh, **kwargs)
        self._gathered: torch.Tensor | None = None

    def _place(self, tensors, block_sizes, align: int) -> int:
        P = self.world
        self.layout = None
        self.entries = []
        self._chunks = []  # per tensor: (A, D / P, B), the 3-D view of one chunk
        off = 0
        for (name, t), d, info in zip(tensors, self._dims, self._tp):
            shape = tuple(t.shape) if info is None else info.local_shape
            if not 0 <= d < len(shape) or shape[d] % P or not (info is None or info.even):
                raise ValueError(
                    f"ChunkedDBuffer: {name!r} of {'TP block ' if info else ''}shape "
                    f"{list(shape)} cannot be cut into {P} equal chunks along dim {d}"
                    + ("" if info is None or info.even else " (TP cuts it unevenly)")
                )
            if info is not None and any(isinstance(pl, Shard) and pl.dim == d
                                        for pl in info.spec.placements):
                raise ValueError(
                    f"ChunkedDBuffer: {name!r}: dim {d} is already split by "
                    f"{tuple(info.spec.placements)}; chunk another dim"
                )
            n = math.prod(shape) // P
            self.entries.append(self._entry(name, t, P * off, P * (off + n), P * (off + n),
                                            (off, off + n), Shard(d), info))
            self._chunks.append((math.prod(shape[:d]), shape[d] // P, math.prod(shape[d + 1 :])))
            off += n
        self._used = off
        return max(align, -(-off // align) * align)

    def _local_part(self, e: _Entry, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.world, dim=e.placement.dim)[self.rank].reshape(-1)

    def sharded_view(self, e: _Entry, buf: torch.Tensor, local=None) -> DTensor:
        shape = list(e.view_shape)
        shape[e.placement.dim] //= self.world
        a, b = e.local if local is None else local  # always e.local: gradients stay in place
        local = buf[a:b].view(shape)
        spec = make_spec(self.spec_mesh(e), self.placements(e), e.shape, buf.dtype)
        return DTensor(local, spec, requires_grad=False)

    # --- the two layouts ---------------------------------------------------------------------

    def _slots(self, rank_major: torch.Tensor, e: _Entry, chunk) -> torch.Tensor:
        """Tensor `e`'s P chunks in a rank-major buffer, as a (P, A, D / P, B) view."""
        return rank_major.view(self.world, -1)[:, e.local[0] : e.local[1]].view(self.world, *chunk)

    def _full(self, full: torch.Tensor, e: _Entry, chunk) -> torch.Tensor:
        """Tensor `e` in a full-layout buffer, as an (A, P, D / P, B) view."""
        A, c, B = chunk
        return full[e.start : e.end].view(A, self.world, c, B)

    def _gather_output(self) -> torch.Tensor:
        self._gathered = torch.empty_like(self._unsharded)
        return self._gathered

    def _finish_gather(self) -> None:
        gathered, self._gathered = self._gathered, None
        self.rt.accesses("copy", reads=(self.key("gathered"),), writes=(self.key("unsharded"),))
        with torch.no_grad():
            for e, chunk in zip(self.entries, self._chunks):
                self._full(self._unsharded, e, chunk).copy_(
                    self._slots(gathered, e, chunk).permute(1, 0, 2, 3)
                )
        # made on the all-gather stream, read here on the current one: [Note: streams and events]
        self.rt.release(self.key("gathered"), gathered, self._unsharded_stream, "drop")
        super()._finish_gather()

    def rank_major(self, full: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        out = full.new_empty(self.world * (slot or self.shard_size))
        with torch.no_grad():
            out.view(self.world, -1)[:, self._used :].zero_()
            for e, chunk in zip(self.entries, self._chunks):
                self._slots(out, e, chunk).copy_(self._full(full, e, chunk).permute(1, 0, 2, 3))
        return out
