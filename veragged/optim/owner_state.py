"""Where a matrix's owner state lives: `OwnerResidence`.

[Note: owner-resident state]
Shampoo's Kronecker factors and inverse roots, SOAP's factors, eigenbases and rotated moments
exist only where the matrix's update is computed ([Note: matrix optimizer engine]). Each such
tensor is a DTensor on the matrix's domain whose placement puts it whole on the owner and
nowhere else: `RaggedShard((0,), local_units)` with `local_units` one-hot at the owner's index
on the domain (the other mesh dims, e.g. HSDP's replicate dim, Replicate: every replica group
has its own owner copy, computed identically). So
- its local tensor is the whole (flat) tensor on the owner and empty elsewhere: memory is spent
  once per domain, on the rank that does the work;
- DCP saves it with no communication (each rank writes its own box; empty boxes write nothing)
  and reloads it into whatever placement the loading optimizer has: on another world size or
  owner plan each factor is read by its new owner;
- a plain `load_state_dict` of state from another plan, or a plan rebuilt by `add_param_group`,
  moves each tensor to its new owner by one redistribute per tensor, in matrix order on every
  rank.
A domain of several mesh dims (FSDP over TP) uses one flattened mesh dim for the domain, named
after the dims it joins. Parameters whole on every rank (plain tensors, replicated DTensors)
keep plain tensors; `owners="replicated"` keeps Replicate DTensors (every rank computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from veragged.optim.pieces import check_placements
from veragged.placement.api import from_local
from veragged.placement.ragged_shard import RaggedShard
from veragged.placement.redistribute import redistribute

__all__ = ["OwnerResidence", "residence"]


@dataclass(frozen=True)
class OwnerResidence:
    """The mesh and placements of a matrix's owner state (mesh None: plain tensors)."""

    mesh: object
    placements: tuple[Placement, ...]
    here: bool  # this rank holds the whole tensors
    device: torch.device

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.mesh is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        if all(isinstance(p, Replicate) for p in self.placements):
            return DTensor.from_local(torch.zeros(shape, dtype=dtype, device=self.device),
                                      self.mesh, self.placements, run_check=False)
        mine = torch.zeros(math.prod(shape) if self.here else 0, dtype=dtype, device=self.device)
        return from_local(mine, self.mesh, self.placements, shape=shape)

    def adopt(self, value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
              name: str) -> torch.Tensor:
        """`value` (a loaded or earlier state tensor) placed where this residence says."""
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"owner state {name!r} must have shape {list(shape)}, got "
                             f"{list(value.shape)}")
        if self.mesh is None:
            if isinstance(value, DTensor):
                value = value.full_tensor()
            return value.to(device=self.device, dtype=dtype)
        if isinstance(value, DTensor):
            if value.device_mesh != self.mesh:
                raise ValueError(f"owner state {name!r} is on mesh {value.device_mesh}; this "
                                 f"optimizer keeps it on {self.mesh}")
            if tuple(value.placements) != self.placements:
                value = redistribute(value, self.mesh, self.placements)
            if value.dtype != dtype:
                value = value.to(dtype)
            return value
        # a whole tensor on every rank (e.g. a single-process state dict): keep our part
        full = value.to(device=self.device, dtype=dtype)
        if all(isinstance(p, Replicate) for p in self.placements):
            return DTensor.from_local(full, self.mesh, self.placements, run_check=False)
        mine = full.reshape(-1) if self.here else full.new_empty(0)
        return from_local(mine.clone(), self.mesh, self.placements, shape=shape)


def _device(p: torch.Tensor) -> torch.device:
    return p._local_tensor.device if isinstance(p, DTensor) else p.device


def residence(p: torch.Tensor, owner: int | None) -> OwnerResidence:
    """Where the owner state of matrix `p` lives: on domain rank `owner` (None: every rank
    computes it: plain tensors for parameters whole everywhere, Replicate DTensors otherwise)."""
    device = _device(p)
    dims = check_placements(p)
    if not dims:
        return OwnerResidence(None, (), True, device)
    mesh = p.device_mesh
    if owner is None:
        return OwnerResidence(mesh, (Replicate(),) * mesh.ndim, True, device)
    if len(dims) > 1:
        mesh, dims = _flattened(mesh, dims)
    j = dims[0]
    size = mesh.size(j)
    units = tuple(int(r == owner) for r in range(size))
    placements = tuple(RaggedShard((0,), units) if k == j else Replicate()
                       for k in range(mesh.ndim))
    return OwnerResidence(mesh, placements, mesh.get_local_rank(j) == owner, device)


def _flattened(mesh, dims: list[int]):
    """The domain dims of `mesh` joined into one mesh dim ([Note: owner-resident state])."""
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError(
            f"owner state of a matrix sharded on mesh dims {dims} of {mesh} needs named mesh "
            "dims (init_device_mesh(..., mesh_dim_names=...)) to flatten its domain")
    flat_name = "_".join(names[d] for d in dims)
    flat = mesh[tuple(names[d] for d in dims)]._flatten(flat_name)
    # the domain group orders its ranks by global rank ([Note: optimizer pieces on N-D
    # meshes]); the flattened mesh orders them row-major: they agree for meshes built by
    # init_device_mesh, and the owner index must mean the same rank in both
    ranks = flat.mesh.reshape(-1).tolist()
    if ranks != sorted(ranks):
        raise NotImplementedError(f"mesh {mesh}: the flattened domain {ranks} is not in rank "
                                  "order")
    others = [d for d in range(mesh.ndim) if d not in dims]
    if not others:
        return flat, [0]
    # e.g. HSDP's replicate dim beside the flattened (dp, tp) domain
    before = tuple(names[d] for d in others if d < dims[0])
    after = tuple(names[d] for d in others if d > dims[0])
    return mesh[(*before, flat_name, *after)], [len(before)]
