"""What both optimizers share: local views of (DTensor) parameters and the symmetric grad mask.

[Note: symmetric grad presence]
A sharded parameter can have a gradient on some ranks and `grad=None` on others (conditional
compute, or a user dropping a gradient). A distributed optimizer must still issue the same
collectives in the same order on every rank, or it hangs or pairs unrelated collectives. So at
the top of `step()` every rank contributes one byte per parameter ("I have a gradient") to a
single MAX all-reduce over the world group; then, on every rank:
- a parameter no rank has a gradient for is skipped (no state change, no collective);
- a parameter some rank has a gradient for is stepped everywhere, a rank without one using zeros
  for its shard (exactly what a single process would see after summing the ranks' gradients).
Parameters that are not DTensors (one process, or DDP-style replicas) need no agreement and take
their local presence as is.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["local", "grad_mask", "local_grads"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def grad_mask(params: Sequence[torch.Tensor]) -> list[bool]:
    """Per parameter, whether any rank has a gradient ([Note: symmetric grad presence]).

    One MAX all-reduce over the world when any parameter is a DTensor, none otherwise; every
    rank must call it with its parameters in the same order.
    """
    present = [p.grad is not None for p in params]
    if not any(isinstance(p, DTensor) for p in params) or not dist.is_initialized():
        return present
    if dist.get_world_size() == 1:
        return present
    device = next(local(p).device for p in params)
    if device.type == "cuda" and dist.get_backend() != "nccl":
        device = torch.device("cpu")
    mask = torch.tensor(present, dtype=torch.uint8, device=device)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX)
    return [bool(x) for x in mask.tolist()]


def local_grads(params: Sequence[torch.Tensor], mask: Sequence[bool]) -> list[torch.Tensor | None]:
    """Local gradients for the masked-in parameters: the stored shard, or zeros if this rank has
    none; None for parameters the mask leaves out."""
    out: list[torch.Tensor | None] = []
    for p, m in zip(params, mask):
        if not m:
            out.append(None)
        elif p.grad is None:
            out.append(torch.zeros_like(local(p)))
        else:
            out.append(local(p.grad))
    return out
