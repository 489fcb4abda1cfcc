"""`clip_grad_norm_` over parameters on several meshes (FSDP x TP/EP models).

torch's `clip_grad_norm_` stacks the per-parameter norms into one DTensor op, which refuses
operands on different meshes: a model whose TP (or EP) parameters live on the (dp, tp) mesh and
whose other parameters live on the dp mesh alone (embeddings, norms, the dense part of an MoE)
cannot be clipped with it, under torch's `fully_shard` as under ours. This takes the total norm
per mesh (one reduction per mesh dim there), combines the per-mesh totals into plain tensors
(the same value on every rank) and scales the gradients of each mesh by torch's own `clip_grads_with_norm_`.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters on any mix of meshes (and plain tensors).

    Returns the total norm as a plain tensor. Collectives run per mesh, in the order the
    parameters first name the meshes, so every rank must hold gradients for parameters on the
    same meshes. fully_shard's gradients are: after backward a parameter has a gradient on every
    rank of its mesh or on none, also when each rank's data reached different parameters and for
    ranks holding no element of it ([Note: unreached parameters]).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    groups: dict[object, list[torch.Tensor]] = {}  # parameters by their gradient's mesh
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for group in groups.values():
        grads = [p.grad for p in group]
        n = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    for group in groups.values():  # one multi-tensor op may not mix meshes either
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total
