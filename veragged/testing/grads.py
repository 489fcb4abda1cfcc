"""Synthetic gradients for sharded parameters, with rank-asymmetric presence, and the matching
single-process reference gradients (used by the optimizer tests and the stress harness)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from veragged.placement.collectives import shard0_bounds
from veragged.placement.ragged_shard import RaggedShard

__all__ = ["rank_bounds", "set_grads"]


def rank_bounds(p: torch.Tensor) -> list[tuple[int, int]]:
    """Every rank's flat element interval of `p` on a 1-D mesh (plain tensors: the whole)."""
    if not isinstance(p, DTensor):
        return [(0, p.numel())]
    (pl,) = p.placements
    world = p.device_mesh.size()
    if isinstance(pl, RaggedShard):
        out = []
        for r in range(world):
            n, off = pl.local_numel_and_offset(p.shape, r)
            out.append((off, off + n))
        return out
    if isinstance(pl, Shard) and pl.dim == 0:
        b = shard0_bounds(p.shape[0], p.numel() // max(p.shape[0], 1), world)
        return [(b[r], b[r + 1]) for r in range(world)]
    return [(0, p.numel())] * world  # Replicate


def set_grads(
    params: Sequence[torch.Tensor],
    step: int,
    present: Callable[[int, int], bool] = lambda i, r: True,
    *,
    seed: int = 0,
) -> list[torch.Tensor | None]:
    """Give every parameter its shard of a seeded full gradient, or `grad=None` on the ranks
    where `present(param_index, rank)` is False.

    Returns the reference full gradients a single process would see: the full gradient with the
    absent ranks' intervals zeroed, or None where no rank has one ([Note: symmetric grad
    presence]). The full gradients depend only on `(seed, step)`, not on the world size.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    refs: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        bounds = rank_bounds(p)
        have = [present(i, r) for r in range(len(bounds))]
        if isinstance(p, DTensor):
            b, e = bounds[rank]
            if have[rank]:
                local = full.reshape(-1)[b:e].clone().view(p._local_tensor.shape)
                p.grad = type(p).from_local(  # DTensor or veragged's RaggedDTensor
                    local, p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride(),
                )
            else:
                p.grad = None
        else:
            p.grad = full.clone() if have[0] else None
        if not any(have):
            refs.append(None)
            continue
        ref = full.clone().reshape(-1)
        for r, (b, e) in enumerate(bounds):
            if not have[r]:
                ref[b:e] = 0
        refs.append(ref.view(p.shape))
    return refs
