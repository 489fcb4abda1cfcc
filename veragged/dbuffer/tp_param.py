"""Tensor- and expert-parallel parameters in a DBuffer (FSDP over TP/EP).

[Note: FSDP over TP]
A parameter that is already a DTensor on a model-parallel mesh (`parallelize_module` on a TP mesh,
or fused experts `[E, ...]` as `Shard(0)` on an EP mesh) is sharded by FSDP as torch's FSDP2
shards it: the DBuffer holds its *local* TP block, gathered and reduced over the dp group only.
- The sharded parameter is a RaggedDTensor on `concat(dp mesh, tp mesh)` (HSDP: replicate,
  shard, tp) with placements `(RaggedShard, *tp placements)`, normalised by the paper's rules
  (`normalize_placements`): after a TP `Shard(0)` it is a `StridedRaggedShard` with
  `split_factor` = the TP pieces of dim 0; next to a TP `Shard(d)`, d > 0, its rows never cut
  dim d (the LCM rule below).
- The unsharded parameter is a DTensor with the TP spec (mesh, placements, global shape) around
  a view of the all-gather output, so the parallelised module runs as it did before FSDP. Its
  gradient is a DTensor too; a placement other than the TP one (the `Partial` gradient of a
  replicated norm under sequence parallelism) is redistributed to it first (a TP collective in
  backward, as torch's FSDP2 does), then its local tensor lands ([Note: gradient landing]).
- Every TP rank plans the same shapes: the largest TP block (torch.chunk's first), so every
  rank of the mesh computes the same layout and the same placements. When TP cuts a dim
  unevenly (9 rows over 2 ranks: 5 and 4), the smaller blocks fill the start of the planned
  range and the rest is padding (zero, never read as a gradient); such a block is planned as
  one unit, so it lives whole on one dp rank (local_units with one nonzero entry), the one
  description that holds for every block size.
- Granularity (`granularity_fn` gives g elements of the *global* tensor, and `Shard(0)` from
  `shard_placement_fn` gives rows of the TP block): with a TP `Shard(d)`, d > 0, let
  R = prod(shape[d:]) be a global row of dims >= d and r = prod(block[d:]) its TP part. A block
  of g elements either lies inside one TP part (g divides r) or spans whole global rows
  (R divides g); the DBuffer then keeps lcm(g, R) / R whole TP rows together (r elements, or
  g / R rows of r), i.e. granularity lcm(g, R) of the global tensor, the paper's LCM rule. Any
  other g is cut by TP in pieces no dp split can keep together: ValueError. With a TP
  `Shard(0)` only, g must divide the TP block (a block never spans two TP ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from veragged.placement.layout import normalize_placements
from veragged.placement.tensor import make_spec
from veragged.runtime import caches

__all__ = ["TPParam", "tp_block_size", "tp_param"]

# (id(dp mesh), id(tp mesh)) -> (combined mesh, dp mesh, tp mesh): one combined mesh per pair,
# so sharded parameters share it (specs are cached by mesh identity).
_MESHES: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh, DeviceMesh]] = caches.register(
    "dbuffer.tp_param combined meshes", {})


@dataclass(frozen=True)
class TPParam:
    """How a model-parallel DTensor parameter sits in a DBuffer; see [Note: FSDP over TP]."""

    spec: DTensorSpec  # the model-parallel DTensor's spec (its mesh, placements, global shape)
    mesh: DeviceMesh  # concat(dp mesh, model-parallel mesh): the sharded parameter's mesh
    plan_shape: tuple[int, ...]  # the TP block every rank plans (torch.chunk's first)
    local_shape: tuple[int, ...]  # this rank's TP block
    even: bool  # every TP rank's block has plan_shape

    @property
    def shape(self) -> torch.Size:
        return self.spec.shape

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """The unsharded parameter around `local` (a view of the all-gather output)."""
        spec = make_spec(self.spec.mesh, self.spec.placements, self.spec.shape, local.dtype,
                         self.spec.stride)
        return DTensor(local, spec, requires_grad=False)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of `grad` in the TP placements (a Partial one is reduced first)."""
        if not isinstance(grad, DTensor):
            return grad
        placements = self.spec.placements
        if tuple(grad.placements) != tuple(placements):
            grad = grad.redistribute(self.spec.mesh, placements)
        return grad._local_tensor

    def placements(self, dp_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """The sharded parameter's placements: the dp ones (one RaggedShard) then the TP ones,
        normalised ([Note: ragged layout on an N-D mesh])."""
        return normalize_placements(
            self.spec.shape, self.mesh, (*dp_placements, *self.spec.placements)
        )


def _concat(fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    key = (id(dp_mesh), id(tp_mesh))
    found = _MESHES.get(key)
    if found is not None and found[1] is dp_mesh and found[2] is tp_mesh:
        return found[0]
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on {tp_mesh}: fully_shard over tensor/expert "
            f"parallelism needs both meshes named (slices of one init_device_mesh with "
            f"mesh_dim_names), got dp mesh {dp_mesh}"
        )
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, AssertionError) as err:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on {tp_mesh}, which does not combine with the "
            f"fully_shard mesh {dp_mesh} into one mesh ({err}); pass mesh= a slice of the "
            "same init_device_mesh, over the other dims"
        ) from None
    _MESHES[key] = (mesh, dp_mesh, tp_mesh)
    return mesh


def tp_param(fqn: str, p: DTensor, dp_mesh: DeviceMesh) -> TPParam:
    """Check a model-parallel DTensor parameter and describe its place in a DBuffer."""
    spec = p._spec
    tp_mesh = spec.mesh
    for j, pl in enumerate(spec.placements):
        if type(pl) is not Shard and not isinstance(pl, Replicate):
            raise ValueError(
                f"parameter {fqn!r} has placements {tuple(spec.placements)} on {tp_mesh}: "
                f"fully_shard takes tensor/expert-parallel parameters placed with Shard(d) or "
                f"Replicate(), not {pl!r} (mesh dim {j})"
            )
    if dp_mesh.device_type != tp_mesh.device_type:
        raise ValueError(
            f"parameter {fqn!r} lives on a {tp_mesh.device_type} mesh, fully_shard's mesh is "
            f"{dp_mesh.device_type}"
        )
    mesh = _concat(fqn, dp_mesh, tp_mesh)
    plan = list(spec.shape)
    even = True
    for j, pl in enumerate(spec.placements):
        if isinstance(pl, Shard):
            n = tp_mesh.size(j)
            even = even and plan[pl.dim] % n == 0
            plan[pl.dim] = -(-plan[pl.dim] // n)
    local = tuple(p._local_tensor.shape)
    return TPParam(spec, mesh, tuple(plan), local, even)


def tp_block_size(fqn: str, info: TPParam, g: int | None, rows: bool) -> int:
    """Elements of the TP block no dp boundary may cut (the LCM rule of [Note: FSDP over TP]).

    `g`: granularity_fn's block, in elements of the global tensor (None: 1); `rows`: keep rows
    of the block whole (`shard_placement_fn` returned Shard(0)).
    """
    plan, shape = info.plan_shape, tuple(info.shape)
    numel = math.prod(plan)
    if not info.even:
        return max(numel, 1)  # one unit: see the Note
    block = 1
    if g is not None:
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise ValueError(f"granularity_fn({fqn!r}) = {g!r} must be a positive int")
        if math.prod(shape) % g:
            raise ValueError(
                f"granularity_fn({fqn!r}) = {g} must divide numel {math.prod(shape)}"
            )
        block = g
    dims = sorted({pl.dim for pl in info.spec.placements if isinstance(pl, Shard)})
    inner = [d for d in dims if d > 0]
    if inner:
        d = inner[0]
        R, r = math.prod(shape[d:]), math.prod(plan[d:])
        if g is not None and r % g and g % R:
            raise ValueError(
                f"granularity_fn({fqn!r}) = {g} elements is cut by tensor parallelism "
                f"{tuple(info.spec.placements)} of shape {list(shape)}: a block must lie inside "
                f"one TP part of a row of dims >= {d} ({r} elements) or span whole rows "
                f"({R} elements each)"
            )
        block = math.lcm(block, R) // R * r
    elif 0 in dims and numel % block:
        raise ValueError(
            f"granularity_fn({fqn!r}) = {g} elements does not divide the TP block "
            f"{list(plan)} of {list(shape)} ({numel} elements): a block would span two TP ranks"
        )
    if rows:
        block = math.lcm(block, math.prod(plan[1:]) if plan else 1)
    if numel % block:
        raise ValueError(
            f"{fqn!r}: block of {block} elements does not divide the TP block {list(plan)}"
        )
    return block
