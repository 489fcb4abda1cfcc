"""`torch.amp.GradScaler` on RaggedShard gradients: the non-finite check and unscale.

[Note: GradScaler on RaggedShard]
`GradScaler.unscale_` (and `step`, which unscales if the user did not) calls
`torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)` once per device
and dtype with `found_inf` a one-element plain tensor. Under FSDP each rank sees only its shard of
every gradient, so a non-finite value lands in one rank's `found_inf` only; if the ranks then
disagree, some step and some skip, and the replicas drift apart for good. As torch's DTensor
does for `Shard`, the op runs on the local shards and `found_inf` is then all-reduced (max) over
every mesh dim on which some gradient in the list is not replicated, so every rank of those
groups skips or steps together. Groups are reduced in the order they first appear in the list:
the lists are the same on every rank (GradScaler builds them from the optimizer's parameters),
so the collectives are too. A list without any RaggedShard DTensor never reaches this handler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

__all__ = ["AMP_FUNCTIONS", "AMP_PACKETS"]

aten = torch.ops.aten


def _local(x):
    return x._local_tensor if isinstance(x, DTensor) else x


def _groups(tensors) -> list:
    """The process groups of every non-replicated mesh dim of the DTensors in `tensors`, each
    once, in order of first appearance."""
    seen, groups = set(), []
    for t in tensors:
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh
        for dim, placement in enumerate(t.placements):
            if isinstance(placement, Replicate) or mesh.size(dim) == 1:
                continue
            group = mesh.get_group(dim)
            if id(group) not in seen:
                seen.add(id(group))
                groups.append(group)
    return groups


def non_finite_check_and_unscale_(grads, found_inf, inv_scale):
    """`torch._amp_foreach_non_finite_check_and_unscale_` on sharded gradients: [Note: GradScaler
    on RaggedShard]."""
    if isinstance(found_inf, DTensor) or isinstance(inv_scale, DTensor):
        raise TypeError(
            "_amp_foreach_non_finite_check_and_unscale_: found_inf and inv_scale must be plain "
            f"tensors (GradScaler's), got {type(found_inf).__name__} and "
            f"{type(inv_scale).__name__}"
        )
    with torch._C.DisableTorchFunctionSubclass():
        torch._amp_foreach_non_finite_check_and_unscale_(
            [_local(g) for g in grads], found_inf, inv_scale)
    for group in _groups(grads):
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


AMP_FUNCTIONS = {torch._amp_foreach_non_finite_check_and_unscale_: non_finite_check_and_unscale_}
AMP_PACKETS = {aten._amp_foreach_non_finite_check_and_unscale_: non_finite_check_and_unscale_}
