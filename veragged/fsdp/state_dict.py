"""`fully_shard`'s state-dict hooks.

[Note: fully_shard state dicts]
- `state_dict()` and `load_state_dict()` reshard first (pre-hooks), so the keys name the sharded
  parameters: RaggedShard DTensors whose local tensors are views into their group's DBuffer. A
  load without `assign` copies into them in place.
- `load_state_dict(assign=True)` registers the given tensors as the parameters. The post-hook
  copies each into its DBuffer (`DBuffer.load_`: a DTensor with other placements is
  redistributed, a plain tensor is the full value) and registers the DBuffer's parameters again,
  so parameter objects, their storage and optimizer state stay valid. A meta tensor carries no
  data and is not taken.
- A group whose DBuffer is on the meta device (`fully_shard` under `torch.device("meta")`) is
  materialised on the mesh's device once every one of its parameters was assigned a value.
  Until then (`strict=False` loads in pieces) its modules keep what was assigned, as torch's do,
  and the first forward raises for the groups still on meta.

[Note: submodule _apply]
`to_empty()`, `.to()` or a cast on a plain submodule of a sharded module (torchtune's LoRA init
calls `lora.to_empty(device)`, then initialises it) runs `nn.Module._apply` on that submodule,
which swaps new tensors into our sharded parameters (`torch.utils.swap_tensors`; the parameter
objects stay, their data is new and no longer a view of the DBuffer). As torch's FSDP2 resets its
sharded parameters from what the modules hold at lazy init, the first forward (and a load
post-hook) takes such a parameter's data into its DBuffer and makes the object a view again.
The sharded parameters carry no weak references, so the swap can happen (`_veragged_fsdp`:
`requires_grad_` installs no ragged accumulation hooks on them, since the DBuffer, not autograd,
writes their gradients). A dtype or device other than the group's raises naming the parameter:
one DBuffer holds one dtype on one device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from veragged.fsdp.group import ParamGroup

if TYPE_CHECKING:
    from veragged.fsdp.state import FSDPState

__all__ = ["post_load_state_dict", "pre_load_state_dict", "pre_state_dict", "take_assigned"]


def pre_state_dict(state: FSDPState, *args, **kwargs) -> None:
    """`state_dict()`'s pre-hook on each of `state`'s modules (`api._install` registers the
    three hooks): the sharded parameters registered."""
    _reshard(state)


def post_load_state_dict(state: FSDPState, *args, **kwargs) -> None:
    """`load_state_dict()`'s post-hook: what the load assigned taken into the buffers."""
    take_assigned(state)


def pre_load_state_dict(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str,
                        *args, **kwargs) -> None:
    """`load_state_dict()`'s pre-hook on `module` (one of `state`'s modules): check what the
    load brings for the sharded parameters of `module` and its submodules (a DTensor with their
    placements must be this rank's piece: [Note: torch's entry points without the routing])
    before torch takes any of it, then reshard."""
    names = {id(m): f"{n}." if n else "" for n, m in module.named_modules()}
    for g in state.groups:
        for i, places in enumerate(g.locations):
            for mod, name in places:
                where = names.get(id(mod))
                value = None if where is None else state_dict.get(f"{prefix}{where}{name}")
                if isinstance(value, DTensor) and value.placements == g.sharded[i].placements:
                    g.buffer.check_loadable(i, value)
    _reshard(state)


def _reshard(state: FSDPState) -> None:
    """Register the sharded parameters; a group on meta keeps what a partial load assigned."""
    for g in state.groups:
        if not g.buffer.is_meta:
            g.reshard()


def _assigned(g: ParamGroup, i: int) -> torch.Tensor | None:
    """What a load registered in place of parameter `i` of `g` (None: nothing with data), or
    the sharded parameter itself when a submodule's `_apply` swapped new data into it."""
    p = g.sharded[i]
    for mod, name in g.locations[i]:
        q = mod._parameters.get(name)
        if q is not None and q is not p and q is not g.unsharded[i] and not q.is_meta:
            return q
    if not g.buffer.is_meta and not p.is_meta and not g.buffer.holds(i):
        return p
    return None


def take_assigned(state: FSDPState) -> None:
    """Take the tensors registered in place of `state`'s sharded parameters (by
    `load_state_dict(assign=True)`, or set as module attributes) into the DBuffers and register the
    sharded parameters again; see [Note: fully_shard state dicts]."""
    taken = []
    for g in state.groups:
        values = [_assigned(g, i) for i in range(len(g.sharded))]
        if g.buffer.is_meta and any(v is None for v in values):
            continue  # loaded in pieces: the rest comes with a later load
        for i, v in enumerate(values):
            if v is not None and v is not g.sharded[i]:
                g.buffer.check_loadable(i, v)  # every value, before a load's collective
        taken.append((g, values))
    for g, values in taken:
        for i, v in enumerate(values):
            if v is not None:
                g.reset_sharded_param(i, v)
        g.reshard()
