"""ReplicatedDBuffer: a parameter group that every rank holds whole (torch's DDP mode).

[Note: replicated DBuffers]
`fully_shard(mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(replicate=...))` naming no shard
dim is torch 2.15's DDP mode (its `DDPMeshInfo`): nothing is sharded, every rank keeps every
parameter (its tensor-parallel block), and backward all-reduces the gradients over the
data-parallel dims, averaged over them (`ReduceOp.AVG`, or SUM with `set_gradient_divide_factor`).
Here that is a DBuffer with no shard dim (`shard_dim=None`, `mesh` the data-parallel mesh, one
dim: several replicate dims are flattened into one, as torch does): its shard is the whole group
(a world of one rank), so
- the all-gather is the copy of the shard into the unsharded buffer a DBuffer on a one-rank mesh
  makes (`unshard`), and `fully_shard` keeps it after forward (torch's DDP mode has no
  post-forward reshard);
- the reduce-scatter is skipped and the HSDP all-reduce over the buffer's mesh (grads.py) is the
  whole reduction: gradients land scaled by 1/replicas when that is a power of two (the bits of
  torch's AVG, a SUM divided after), the verdict flags of [Note: unreached parameters] travel in
  that all-reduce, and no-sync and all-reduce-less micro-batches work as for HSDP.
The sharded parameters are what torch's DDP mode makes them: plain DTensors with the
parameter's own spec (`specs`: for a parameter given on the full SPMD mesh, that mesh, Replicate
on the data-parallel dims and its tensor-parallel placements), whose local tensors are views of
the shard in the local block's shape; their gradients are DTensors of the same spec over the
shard gradient. So optimizers, clipping, state dicts and DCP see the DTensors torch's would.
(tests/fsdp/test_dp_mesh_dims.py: against torch's DDP mode, 1-D and with TP.)
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement

from veragged.dbuffer.buffer import DBuffer
from veragged.dbuffer.entries import Entry as _Entry
from veragged.placement.tensor import make_spec

__all__ = ["ReplicatedDBuffer"]


class ReplicatedDBuffer(DBuffer):
    """A DBuffer every rank of `mesh` holds whole; see [Note: replicated DBuffers].

    Args: as `DBuffer` (no `shard_dim`, no `block_sizes`: nothing is cut), with `specs`: per
    tensor, the spec its sharded DTensor takes (its mesh, placements and global shape; the
    dtype follows the buffer), or None for Replicate on `mesh` (and a tensor-parallel
    parameter's placements on the combined mesh, [Note: FSDP over TP]).
    """

    def __init__(self, tensors, mesh: DeviceMesh, *,
                 specs: Sequence[DTensorSpec | None] | None = None, **kwargs):
        for name in ("shard_dim", "block_sizes"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"ReplicatedDBuffer: {name}={kwargs[name]!r}: a replicated buffer has no "
                    "shard dim and no rank boundaries"
                )
        kwargs.pop("shard_dim", None)
        specs = list(specs) if specs is not None else [None] * len(tensors)
        if len(specs) != len(tensors):
            raise ValueError(f"ReplicatedDBuffer: {len(tensors)} tensors but {len(specs)} specs")
        for (name, t), spec in zip(tensors, specs):
            if spec is not None and tuple(spec.shape) != tuple(t.shape):
                raise ValueError(
                    f"ReplicatedDBuffer: {name!r} has shape {list(t.shape)} but its spec "
                    f"describes {list(spec.shape)}"
                )
        self._specs = {name: spec for (name, _), spec in zip(tensors, specs)}
        super().__init__(tensors, mesh, shard_dim=None, **kwargs)

    def placements(self, e: _Entry) -> tuple[Placement, ...]:
        spec = self._specs[e.name]
        return super().placements(e) if spec is None else tuple(spec.placements)

    def spec_mesh(self, e: _Entry) -> DeviceMesh:
        spec = self._specs[e.name]
        return super().spec_mesh(e) if spec is None else spec.mesh

    def sharded_view(self, e: _Entry, buf: torch.Tensor, local=None) -> DTensor:
        """Tensor `e`'s DTensor over `buf`: its local block (elements `local`, default its
        own) in the block's shape, under its spec."""
        a, b = e.local if local is None else local
        spec = self._specs[e.name]
        stride = None if spec is None else spec.stride
        dt_spec = make_spec(self.spec_mesh(e), self.placements(e), e.shape, buf.dtype, stride)
        return DTensor(buf[a:b].view(e.view_shape), dt_spec, requires_grad=False)
