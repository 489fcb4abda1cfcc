"""Parameters placed as FSDP over tensor parallelism, and their gradients, for the optimizer tests
on (dp, tp) and (replicate, dp, tp) meshes (test_muon_tp.py, test_adamw8bit_tp.py).

Placements are those `veragged.fully_shard` gives TP parameters: TP Shard(0) (colwise, experts)
-> (StridedRaggedShard(dims, units, tp), Shard(0)); TP Shard(1) (rowwise) -> (RaggedShard((0,),
units), Shard(1)); TP Replicate -> (RaggedShard(dims, units), Replicate()); HSDP prefixes a
Replicate() mesh dim; uneven TP (tp does not divide the dim) has one-hot local_units.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import veragged
from veragged import StridedRaggedShard
from tests.harness.device import rank_device_type

MESHES = {"2d": ((2, 2), ("dp", "tp")), "3d": ((2, 2, 2), ("rep", "dp", "tp"))}
WORLD = {kind: math.prod(shape) for kind, (shape, _) in MESHES.items()}


def mesh_of(kind: str):
    shape, names = MESHES[kind]
    return init_device_mesh(rank_device_type(), shape, mesh_dim_names=names)


def srs(dims, units, tp=2):
    return StridedRaggedShard(dims, units, tp)


def place(full: torch.Tensor, mesh, placements: Sequence) -> nn.Parameter:
    """`full` as a parameter with `placements` (after a Replicate() per extra leading mesh dim)."""
    placements = (Replicate(),) * (mesh.ndim - len(placements)) + tuple(placements)
    return nn.Parameter(veragged.distribute_tensor(full.clone(), mesh, placements,
                                                   src_data_rank=None))


def piece_key(p: torch.Tensor) -> tuple:
    """This rank's coordinates on the mesh dims that shard `p` (replicas share them)."""
    if not isinstance(p, DTensor):
        return ()
    coord = p.device_mesh.get_coordinate()
    return tuple(coord[j] for j, pl in enumerate(p.placements) if not isinstance(pl, Replicate))


def all_keys(p: torch.Tensor) -> list[tuple]:
    if not isinstance(p, DTensor):
        return [()]
    sizes = [p.device_mesh.size(j) for j, pl in enumerate(p.placements)
             if not isinstance(pl, Replicate)]
    return list(itertools.product(*(range(s) for s in sizes)))


def set_grads(params: Sequence[torch.Tensor], step: int,
              present: Callable[[int, int, tuple], bool]) -> list[torch.Tensor | None]:
    """Give each parameter its piece of a seeded full gradient, or grad=None where
    `present(step, index, piece_key)` is False; return what one process sees: the full gradient
    with the absent pieces zeroed (assembled by full_tensor(), a collective on every rank), or
    None where no piece has one."""
    gen = torch.Generator().manual_seed(1000 + step)
    refs = []
    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if not isinstance(p, DTensor):
            p.grad = full if present(step, i, ()) else None
            refs.append(p.grad)
            continue
        mesh, placements = p.device_mesh, p.placements
        loc = veragged.distribute_tensor(full, mesh, placements, src_data_rank=None)._local_tensor
        have = present(step, i, piece_key(p))

        def wrap(t):
            return veragged.from_local(t, mesh, placements, shape=p.shape, stride=p.stride())

        p.grad = wrap(loc.clone()) if have else None
        if not any(present(step, i, k) for k in all_keys(p)):
            refs.append(None)
            continue
        refs.append(wrap(loc if have else torch.zeros_like(loc)).full_tensor())
    return refs


def pattern(name: str) -> Callable[[int, int, tuple], bool]:
    """"all": every piece has a gradient; "cycle": pieces drop theirs in a rotating pattern and
    at step 2 nobody has one for param 0."""

    def present(step, i, key):
        if name == "all":
            return True
        if step == 2 and i == 0:
            return False
        return (step + i + sum((k + 1) * (j + 2) for j, k in enumerate(key))) % 3 != 0

    return present


def full_tensors(params):
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


def raises(fn, exc, *texts):
    """True if `fn()` raises `exc` with every one of `texts` in its message; else the message,
    or "no <exc>" (a truthy value the assertion prints)."""
    try:
        fn()
    except exc as e:
        return all(t in str(e) for t in texts) or str(e)
    return f"no {exc.__name__}"
