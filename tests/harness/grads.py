"""Synthetic gradients for sharded parameters, with rank-asymmetric presence, and the matching
single-process reference gradients (used by the optimizer tests and the stress harness)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from veragged.optim.exchange import matrix_layout

__all__ = ["rank_bounds", "set_grads"]


def rank_bounds(p: torch.Tensor) -> list[tuple[int, int]]:
    """Per index along `p`'s sharded mesh dim, its flat element interval of `p` (one interval,
    the whole tensor, for plain and replicated tensors). Replicas (HSDP) share the intervals."""
    return _intervals(matrix_layout(p).bounds)


def _intervals(b: Sequence[int]) -> list[tuple[int, int]]:
    return [(b[r], b[r + 1]) for r in range(len(b) - 1)]


def set_grads(
    params: Sequence[torch.Tensor],
    step: int,
    present: Callable[[int, int], bool] = lambda i, r: True,
    *,
    seed: int = 0,
) -> list[torch.Tensor | None]:
    """Give every parameter its shard of a seeded full gradient, or `grad=None` on the ranks
    where `present(param_index, rank)` is False.

    `rank` is the index along the parameter's sharded mesh dim (replicas get the same gradient).
    Returns the reference full gradients a single process would see: the full gradient with the
    absent ranks' intervals zeroed, or None where no rank has one ([Note: symmetric grad
    presence]). The full gradients depend only on `(seed, step)`, not on the world size.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    refs: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        layout = matrix_layout(p)
        bounds = _intervals(layout.bounds)
        have = [present(i, r) for r in range(len(bounds))]
        if isinstance(p, DTensor):
            b, e = bounds[layout.rank]
            if have[layout.rank]:
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
