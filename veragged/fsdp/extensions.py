"""All-gather extension hooks found at lazy init on parameters of a flat DBuffer.

torch's FSDP2 takes the hooks from each sharded local tensor at its lazy init, so they may be set
on `param._local_tensor` after `fully_shard` (torch's own tests monkey-patch them there). Here
such a parameter moves out of its flat DBuffer into an `ExtensionDBuffer`
([Note: all-gather extensions]): its group is split in two, the parameter objects, and the very
local tensor object carrying the hooks, are kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from veragged.dbuffer.buffer import DBuffer
from veragged.dbuffer.extension import ExtensionDBuffer, has_extension
from veragged.fsdp.group import ParamGroup

if TYPE_CHECKING:
    from veragged.fsdp.state import FSDPState

__all__ = ["adopt_extensions"]

# What a group's user settings are (FSDPModule's setters), carried to the groups replacing it.
_SETTINGS = ("reshard_after_backward", "reduce_grads", "all_reduce_grads", "unshard_in_backward",
             "reduce_scatter_unused_params", "gradient_divide_factor", "all_reduce_hook")


def adopt_extensions(state: FSDPState) -> None:
    """Move the parameters of `state`'s flat groups whose local tensors define the hooks into
    extension groups (a collective over each such group's mesh: every rank finds the same)."""
    groups: list[ParamGroup] = []
    for g in state.groups:
        hooked = [] if g.buffer.MAKES_UNSHARDED else [
            i for i, (fqn, p) in enumerate(zip(g.fqns, g.sharded))
            if has_extension(p._local_tensor, fqn)
        ]
        groups.extend(_split(g, hooked, state.mp_policy) if hooked else [g])
    state.groups[:] = groups


def _split(g: ParamGroup, hooked: list[int], mp_policy) -> list[ParamGroup]:
    buf = g.buffer
    names = [g.fqns[i] for i in hooked]
    if type(buf) is not DBuffer or any(g.views[i] is not None or buf.entries[i].tp is not None
                                      for i in hooked):
        raise NotImplementedError(
            f"all-gather extensions set after fully_shard on {names} are supported on plain "
            "parameters sharded by dim 0 (not Shard(d > 0), tensor-parallel or dp_mesh_dims "
            "ones); give the tensors a type defining the hooks before fully_shard"
        )
    if buf.offload:
        raise NotImplementedError(
            f"all-gather extensions with CPUOffloadPolicy are not supported: {names}"
        )
    g.finish_reduce()
    g.reshard()
    values = _full_values(buf)
    rest = [i for i in range(len(g.fqns)) if i not in hooked]
    out = []
    if rest:
        fresh = DBuffer([(g.fqns[i], values[i]) for i in rest], buf.mesh, **buf.config(rest))
        out.append(_group(g, rest, fresh))
    cfg = buf.config(hooked)
    del cfg["block_sizes"]
    ext = ExtensionDBuffer([(g.fqns[i], values[i]) for i in hooked], buf.mesh,
                           modules=[g.locations[i][0][0] for i in hooked], mp_policy=mp_policy,
                           **cfg)
    olds = [g.sharded[i]._local_tensor for i in hooked]
    for k, local in enumerate(olds):  # the hooks stay on the object they were set on
        ext.take_local_(k, local)
    out.append(_group(g, hooked, ext))
    return out


def _full_values(buf: DBuffer) -> list[torch.Tensor]:
    """Every tensor of a flat DBuffer, whole and exact (one all-gather of the shards)."""
    full = torch.empty(buf.world * buf.shard_size, dtype=buf.dtype, device=buf.device)
    if buf.world == 1:
        full.copy_(buf.shard)
    else:
        dist.all_gather_into_tensor(full.view(torch.uint8), buf.shard.view(torch.uint8),
                                    group=buf.group)
    return [full[e.start : e.stop].view(e.shape) for e in buf.entries]


def _group(g: ParamGroup, indices: list[int], buffer: DBuffer) -> ParamGroup:
    """A group over `buffer` (tensors `indices` of `g`) whose sharded parameters are `g`'s
    objects, taking the new contents (`torch.utils.swap_tensors`), with `g`'s settings."""
    for k, i in enumerate(indices):
        old, fresh = g.sharded[i], buffer.params[k]
        with torch._C.DisableTorchFunctionSubclass():  # no ragged accumulation hooks
            fresh.requires_grad_(old.requires_grad)
        old.grad = None
        try:
            buffer.take_param_(k, old)
        except RuntimeError as exc:
            raise RuntimeError(
                f"parameter {g.fqns[i]!r} cannot move to its all-gather extension group "
                f"({exc}); set the hooks on its tensor type before fully_shard instead"
            ) from exc
    new = ParamGroup([g.fqns[i] for i in indices], [g.locations[i] for i in indices], buffer,
                     reshard_after_forward=g.reshard_after_forward,
                     post_forward_group=g.post_forward_group,
                     views=[g.views[i] for i in indices])
    for name in _SETTINGS:
        setattr(new, name, getattr(g, name))
    new.reshard()
    return new
