"""Which data-parallel mesh each parameter is sharded over: `mesh`, `dp_mesh_dims` and
`shard_placement_fn` returning torch's `ShardPlacementResult`.

[Note: data-parallel meshes]
torch 2.15's `fully_shard` takes the data-parallel mesh three ways, and so does ours:
- `mesh` alone: 1-D (shard) or 2-D `(replicate, shard)` (HSDP); parameters are plain tensors, or
  DTensors on a separate tensor/expert-parallel mesh ([Note: FSDP over TP]).
- `mesh` the full SPMD mesh with `dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)`:
  the named dims are data-parallel (several names are flattened into one, as torch's
  `_flatten`), every other dim is model-parallel. Parameters are DTensors on that full mesh
  with `Replicate()` on every data-parallel dim, or plain tensors with `spmd_types` annotations
  (torchtitan's default backend), which mean the same. Each is split here into its
  model-parallel part (a DTensor on the non-data-parallel dims, or a plain tensor when there
  are none), which the DBuffer shards over the data-parallel mesh as before, and a
  `FullMeshView` that presents the unsharded parameter as the caller built it (a DTensor on
  the full mesh, `Replicate()` on the data-parallel dims; a plain tensor with its spmd_types
  annotations restored) and turns its gradient back into the local block. As torch does, a
  gradient keeps its data-parallel placements (a `Partial` sum is what the reduce-scatter
  reduces) and only the model-parallel dims are redistributed before it lands.
- `shard_placement_fn` returning `ShardPlacementResult(placement, mesh_info)`: each parameter
  names its own mesh (torchtitan's MoE: routed experts over the expert-data-parallel mesh, the
  rest over the dense one, in one call). Parameters are grouped by the process groups of
  their mesh (one or more DBuffers each), and a mesh_info built with `dp_mesh_dims`
  (`_get_mesh_info(mesh, dims)`) is read as above.
- `dp_mesh_dims=DataParallelMeshDims(replicate=...)` naming no shard dim: torch's DDP mode. The
  data-parallel mesh is the (flattened) replicate dims; nothing is sharded: each group is a
  `ReplicatedDBuffer` whose sharded parameters keep the parameter's own spec on the full mesh
  ([Note: replicated DBuffers]).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from veragged.placement.tensor import make_spec
from veragged.runtime import caches

try:  # torch >= 2.15
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult,
    )
except ImportError:  # torch 2.11: no per-parameter meshes
    DDPMeshInfo = FSDPMeshInfo = HSDPMeshInfo = ShardPlacementResult = None

__all__ = ["DpMesh", "FullMeshView", "resolve_mesh", "resolve_placement", "split_param",
           "no_typecheck"]


def no_typecheck():
    """spmd_types' no-typecheck context (FSDP's own work in hooks), or a no-op without it."""
    fn = getattr(dist, "_spmd_no_typecheck", None)
    if fn is None:
        import contextlib
        return contextlib.nullcontext()
    return fn()


def _spmd():
    """The spmd_types module when torch can use it, else None."""
    available = getattr(dist, "_is_spmd_types_available", None)
    if available is None or not available():
        return None
    import spmd_types
    return spmd_types


@dataclass(eq=False)
class DpMesh:
    """The mesh a group of parameters is sharded over, and the full SPMD mesh around it."""

    mesh: DeviceMesh  # 1-D (shard, or replicate only) or 2-D (replicate, shard): the DBuffer's
    spmd_mesh: DeviceMesh | None = None  # the full mesh, with dp_mesh_dims
    shard_names: tuple[str, ...] = ()
    replicate_names: tuple[str, ...] = ()
    _subs: dict = field(default_factory=dict)

    @property
    def replicate_only(self) -> bool:
        """torch's DDP mode: data-parallel dims named, none of them sharded."""
        return self.spmd_mesh is not None and not self.shard_names

    @property
    def shard_world(self) -> int:
        return 1 if self.replicate_only else self.mesh.size(self.mesh.ndim - 1)

    @property
    def dp_dims(self) -> frozenset[int]:
        names = self.spmd_mesh.mesh_dim_names
        return frozenset(names.index(n) for n in (*self.shard_names, *self.replicate_names))

    def key(self) -> tuple:
        """Parameters whose meshes have the same process groups share groups (as torch)."""
        groups = tuple(self.mesh.get_group(d) for d in range(self.mesh.ndim))
        return ("replicate",) + groups if self.replicate_only else groups

    def submesh(self, dims: tuple[int, ...]) -> DeviceMesh:
        """The full mesh's non-data-parallel dims `dims`, made once (specs cache by mesh)."""
        sub = self._subs.get(dims)
        if sub is None:
            names = self.spmd_mesh.mesh_dim_names
            sub = self._subs[dims] = self.spmd_mesh[tuple(names[d] for d in dims)]
        return sub


def _names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _dp_submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


_FROM_DIMS: dict[tuple, DpMesh] = caches.register("fsdp.dp_mesh meshes by dims", {})


def _from_dims(mesh: DeviceMesh, dims) -> DpMesh:
    """`mesh` is the full SPMD mesh, `dims` a DataParallelMeshDims (torch's checks and words)."""
    shard, replicate = _names(dims.shard), _names(dims.replicate)
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*shard, *replicate):
        if name not in mesh.mesh_dim_names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}"
            )
    key = (id(mesh), shard, replicate)
    found = _FROM_DIMS.get(key)
    if found is not None and found.spmd_mesh is mesh:
        return found
    if not shard:  # torch's DDP mode: [Note: replicated DBuffers]
        dp = _dp_submesh(mesh, replicate)
    else:
        dp = _dp_submesh(mesh, shard)
        if replicate:
            dp = DeviceMesh._concatenate([_dp_submesh(mesh, replicate), dp])
    found = _FROM_DIMS[key] = DpMesh(dp, mesh, shard, replicate)
    return found


def resolve_mesh(mesh: DeviceMesh, dp_mesh_dims=None) -> DpMesh:
    """The mesh `fully_shard(mesh=..., dp_mesh_dims=...)` shards over, checked as torch checks."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh, got {mesh!r}")
    if dp_mesh_dims is not None:
        return _from_dims(mesh, dp_mesh_dims)
    if mesh.ndim not in (1, 2):  # torch's wording, as its tests and users match on it
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} (1-D: shard; 2-D: "
            f"(replicate, shard); an N-D SPMD mesh needs dp_mesh_dims=)"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError(  # torch raises AssertionError here too
            f"Please init the 2D mesh for HSDP with mesh_dim_names specified (got {mesh})"
        )
    return DpMesh(mesh)


_FROM_INFO: dict[int, tuple[Any, DpMesh]] = caches.register(
    "fsdp.dp_mesh meshes by mesh info", {})


def _from_info(info) -> DpMesh:
    """A torch `FSDPMeshInfo` (what `ShardPlacementResult.mesh_info` holds) as a `DpMesh`."""
    found = _FROM_INFO.get(id(info))
    if found is not None and found[0] is info:
        return found[1]
    if FSDPMeshInfo is None or not isinstance(info, FSDPMeshInfo):
        raise NotImplementedError(
            f"veragged.fully_shard: ShardPlacementResult.mesh_info must be an FSDPMeshInfo or "
            f"HSDPMeshInfo (a mesh to shard over), got {type(info).__name__}"
        )
    dims = getattr(info, "dp_mesh_dims", None)
    if dims is not None:
        dp = _from_dims(info.spmd_mesh, dims)
    else:
        dp = resolve_mesh(info.mesh)
    _FROM_INFO[id(info)] = (info, dp)
    return dp


def resolve_placement(fqn: str, result, default: DpMesh) -> tuple[Shard | None, DpMesh]:
    """What `shard_placement_fn` returned for `fqn`: (placement or None, its mesh)."""
    if result is None or isinstance(result, Shard):
        return result, default
    if ShardPlacementResult is not None and isinstance(result, ShardPlacementResult):
        if result.placement is not None and not isinstance(result.placement, Shard):
            raise ValueError(
                f"shard_placement_fn({fqn!r}) returned ShardPlacementResult with placement "
                f"{result.placement!r}: expected a Shard or None"
            )
        return result.placement, _from_info(result.mesh_info)
    raise ValueError(
        f"shard_placement_fn({fqn!r}) must return a Shard, a ShardPlacementResult or None, "
        f"got {result!r}"
    )


@dataclass(frozen=True, eq=False)
class FullMeshView:
    """How a parameter given on the full SPMD mesh is presented unsharded and how its gradient
    lands; see [Note: data-parallel meshes]."""

    spec: DTensorSpec  # the parameter's spec on the full mesh (Replicate on the dp dims)
    dp_dims: frozenset[int]
    spmd_types: bool = False  # a plain tensor with spmd_types annotations
    restore: Any = None  # spmd_types: (restore_type, partition_spec)
    grad_placements: tuple[Placement, ...] = ()  # spmd_types: the gradient's placements

    def unsharded(self, inner: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter around `inner` (the DBuffer's view: plain or TP DTensor)."""
        local = inner._local_tensor if isinstance(inner, DTensor) else inner
        if self.spmd_types:
            return local
        spec = make_spec(self.spec.mesh, self.spec.placements, self.spec.shape, local.dtype,
                         self.spec.stride)
        return DTensor(local, spec, requires_grad=False)

    def annotate(self, param: torch.Tensor) -> None:
        """spmd_types: restore the parameter's annotations on the unsharded tensor (as torch's
        FSDP does before each forward), when type checking is on."""
        spmd = _spmd() if self.spmd_types else None
        if spmd is None or not spmd.is_type_checking() or not self.restore[0]:
            return
        spmd.assert_type(param, self.restore[0], partition_spec=self.restore[1])

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient's local block, its model-parallel dims in the parameter's placements
        and its data-parallel dims as they came (the reduce-scatter reduces them)."""
        placements = self.spec.placements
        if self.spmd_types:
            if not any(p.is_partial() for i, p in enumerate(self.grad_placements)
                       if i not in self.dp_dims):
                return grad
            grad = DTensor.from_local(grad, self.spec.mesh, self.grad_placements,
                                      run_check=False)
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(g if i in self.dp_dims else p
                       for i, (g, p) in enumerate(zip(grad.placements, placements)))
        if target != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, target)
        return grad._local_tensor


def _check_replicated(fqn: str, placements, dp: DpMesh) -> None:
    names = dp.spmd_mesh.mesh_dim_names
    for i in sorted(dp.dp_dims):
        if not isinstance(placements[i], Replicate):
            kind = "shard" if names[i] in dp.shard_names else "replicate"
            raise ValueError(
                f"Expected Replicate() on DP {kind} dim '{names[i]}' (index {i}) but got "
                f"{placements[i]} (parameter {fqn!r})"
            )


def _inner(p_local: torch.Tensor, shape, stride, placements, dp: DpMesh) -> torch.Tensor:
    """The model-parallel part: a DTensor on the non-dp dims, or the plain local tensor."""
    rest = tuple(i for i in range(dp.spmd_mesh.ndim) if i not in dp.dp_dims)
    if not rest:
        return p_local
    return DTensor.from_local(p_local, dp.submesh(rest), [placements[i] for i in rest],
                              run_check=False, shape=shape, stride=stride)


def split_param(fqn: str, p: torch.Tensor, dp: DpMesh) -> tuple[torch.Tensor, FullMeshView | None]:
    """A parameter given on `dp`'s full SPMD mesh: (its model-parallel part, its view); any
    other parameter comes back as it is, with no view."""
    if dp.spmd_mesh is None:
        return p, None
    if isinstance(p, DTensor):
        spec = p._spec
        if spec.mesh is not dp.spmd_mesh:  # as torch: the same object, not an equal one
            raise ValueError(
                f"parameter {fqn!r} is a DTensor on {spec.mesh}: with dp_mesh_dims it must be "
                f"on the same mesh object passed to fully_shard ({dp.spmd_mesh}), not another "
                "mesh of the same ranks"
            )
        _check_replicated(fqn, spec.placements, dp)
        inner = _inner(p._local_tensor, spec.shape, spec.stride, spec.placements, dp)
        return inner, FullMeshView(spec, dp.dp_dims)
    spmd = _spmd()
    local_type = spmd.get_local_type(p) if spmd is not None else None
    if not local_type:
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh (e.g. via distribute_module) or carry spmd_types annotations. Got plain "
            f"tensor for parameter {fqn!r}."
        )
    return _split_spmd_types(fqn, p, dp, spmd, dict(local_type))


def _restore_mesh(fqn, spmd, local_type, axes) -> tuple:
    """The typechecking mesh the unsharded parameter's annotations are restored on (torch's
    rule): the annotated axes when they span the full mesh's ranks, else the current mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import _spans_same_mesh

    annotated = tuple(local_type)
    if _spans_same_mesh(annotated, tuple(a for _, a in axes)):
        return annotated
    current = spmd.current_mesh()
    if current is None:
        raise ValueError(
            f"parameter {fqn!r} has partial spmd_types annotations ({annotated}) that cannot be "
            "restored from the fully_shard mesh: annotate it on every mesh axis, or call "
            "fully_shard inside spmd.set_current_mesh(...)"
        )
    return tuple(current)


def _split_spmd_types(fqn, p, dp: DpMesh, spmd, local_type) -> tuple[torch.Tensor, FullMeshView]:
    """A plain parameter with spmd_types annotations, read as torch's FSDP reads it: R on the
    data-parallel axes (optional), an explicit type on every other axis of the full mesh."""
    from spmd_types.runtime import get_partition_spec
    from spmd_types.types import partition_spec_to_shard_types
    from spmd_types._mesh_axis import flatten_axes

    mesh = dp.spmd_mesh
    init_type = dict(local_type)
    spec = get_partition_spec(p)
    if spec is not None:
        local_type.update(partition_spec_to_shard_types(spec))
    axes = [(name, spmd.MeshAxis.of(mesh.get_group(name))) for name in mesh.mesh_dim_names]
    dp_names = set(itertools.chain(dp.shard_names, dp.replicate_names))
    fsdp_axis = flatten_axes(tuple(a for n, a in axes if n in dp_names))
    other = {a for n, a in axes if n not in dp_names}
    types = {a: spmd.R for n, a in axes if n in dp_names}
    for axis, t in local_type.items():
        if axis <= fsdp_axis:
            if t is not spmd.R:
                raise ValueError(
                    f"Expected spmd.R on FSDP DP axis {axis} for parameter {fqn!r} but got {t}: "
                    "FSDP reduces the data-parallel gradients itself"
                )
        elif axis in other:
            types[axis] = t
        else:
            raise ValueError(
                f"parameter {fqn!r} has an spmd_types annotation on axis {axis}, which is "
                f"neither a dim of the fully_shard mesh {mesh} nor inside its data-parallel dims"
            )
    missing = [n for n, a in axes if a not in types]
    if missing:
        raise ValueError(
            f"parameter {fqn!r} has incomplete spmd_types annotations: mesh dims {missing} of "
            f"{mesh.mesh_dim_names} carry no type (annotated: {tuple(local_type)})"
        )
    placements = tuple(spmd.spmd_type_to_dtensor_placement(types[a]) for _, a in axes)
    grads = tuple(spmd.spmd_type_to_dtensor_placement(types[a].backward_type())
                  for _, a in axes)
    restore = ({a: init_type.get(a, spmd.R) for a in _restore_mesh(fqn, spmd, local_type, axes)},
               spec)
    full = DTensor.from_local(p.data, mesh, placements, run_check=False)
    inner = _inner(p.data, full.shape, full.stride(), placements, dp)
    view = FullMeshView(full._spec, dp.dp_dims, spmd_types=True, restore=restore,
                        grad_placements=grads)
    return inner, view
