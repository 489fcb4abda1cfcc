"""Full state dicts into veragged-sharded models and optimizers: torch's three setters, extended.

Why torch's own entry points cannot take RaggedShard: with `full_state_dict=True`,
`torch.distributed.checkpoint.state_dict.set_model_state_dict`, `set_optimizer_state_dict` and
`set_state_dict` shard every full tensor like the value it replaces themselves, with no extension
point for other placements:

- without `broadcast_from_rank0`, `torch.distributed._state_dict_utils._distribute_state_dict`
  calls torch's `torch.distributed.tensor.distribute_tensor`, which raises for a placement it does
  not define ("Trying to distribute tensor with unsupported placements RS()");
- with `broadcast_from_rank0=True`, `_broadcast_state_dict` -> `_broadcast_tensors` ->
  `_distribute_tensors` slices each broadcast tensor at
  `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`, which knows only
  torch's `Shard` placements and takes RaggedShard for a replica (the copy into the flat local
  shard then fails on its shape; a model on the meta device fails in `load_state_dict`).

`veragged.route_torch_entry_points()` makes torch's own setters (and `distribute_tensor`) take
RaggedShard, for callers that cannot be changed ([Note: routing torch's entry points],
torch_entry_points.py). Or call these instead, with the same arguments; they return what torch's
return. With
`full_state_dict=True` on a model or optimizer holding RaggedShard DTensors:

- every rank has the full state dict (no `broadcast_from_rank0`): each full tensor whose current
  value is a RaggedShard DTensor is distributed with `veragged.distribute_tensor` (rank 0's data,
  as torch's `distribute_tensor` would), after which torch's `distribute_tensor` returns it as is
  (same mesh and placements), and torch's function loads the state dict, its own logic intact
  (strict, non-ragged keys, scalars, meta models through `assign`);
- `broadcast_from_rank0=True`: rank 0's state dict reaches every rank one tensor at a time, each
  reduced to what the rank keeps (a DTensor's local piece, a plain tensor whole) before the next
  (`veragged.checkpoint.full_values.receive_from_rank0`), and torch's every-rank load above runs
  on it. Every rank thereby loads what rank 0 holds. `strict=True` keeps torch's broadcast
  meaning: a key the model has and rank 0's state dict lacks raises (after loading the others,
  as `nn.Module.load_state_dict`), and rank 0 reports keys the model lacks.

Anything else (`full_state_dict=False`, models without RaggedShard values) is torch's function
unchanged. On the RaggedShard path the given state dicts are left as they were (torch's puts
the loaded DTensors into them). Module-keyed model state dicts (torch's deprecated form) are not
accepted: key them by fully qualified name.

The getters need nothing of veragged: `get_model_state_dict` and `get_optimizer_state_dict` with
`full_state_dict=True` (with or without `cpu_offload`) call `full_tensor()`, which RaggedDTensor
implements, and return what they return for torch's `fully_shard`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from veragged.checkpoint.full_values import (
    distribute_ragged,
    first_ragged,
    like_index,
    receive_from_rank0,
)
from veragged.runtime.streams import mesh_device

__all__ = ["set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """`torch.distributed.checkpoint.state_dict.set_model_state_dict` that also loads full state
    dicts into RaggedShard parameters and buffers (see the module docstring).

    Returns:
        `missing_keys` and `unexpected_keys`, as torch's.

    Raises:
        TypeError: if `model_state_dict` is keyed by modules (torch's deprecated form) and
            `model` holds RaggedShard values.
        ValueError: with `broadcast_from_rank0=True`, on every rank, if rank 0's state dict holds
            a DTensor or a tensor whose shape differs from the RaggedShard value it replaces.
        RuntimeError: as torch's (`strict=True` with missing or unexpected keys, and so on).
    """
    return _set_model(model, model_state_dict, options, skip_if_empty=False)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """`torch.distributed.checkpoint.state_dict.set_optimizer_state_dict` that also loads full
    optimizer states into RaggedShard states, such as AdamW's `exp_avg` of
    veragged-sharded parameters (see the module docstring). As torch's, call it before
    `backward()` or after `step()`: an optimizer without state takes one step with zero
    gradients and learning rate first.

    Raises:
        ValueError: with `broadcast_from_rank0=True`, on every rank, if rank 0's state dict holds
            a DTensor or a tensor whose shape differs from the RaggedShard value it replaces.
        RuntimeError: as torch's (for example an empty `optim_state_dict` without
            `broadcast_from_rank0`).
    """
    optimizers = _as_tuple(optimizers)
    opts = options or StateDictOptions()
    if not opts.full_state_dict:
        return dsd.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    # Sharded, not offloaded: the optimizers' own state tensors (torch's load reads them too).
    current = dsd.get_optimizer_state_dict(
        model, optimizers, options=StateDictOptions(full_state_dict=False, cpu_offload=False)
    )
    ragged = first_ragged(current)
    if ragged is None:
        return dsd.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    like = like_index(current)
    if not opts.broadcast_from_rank0:
        osd = distribute_ragged(optim_state_dict, like)
    else:
        osd = receive_from_rank0(optim_state_dict, like, mesh_device(ragged.device_mesh))
        if not osd:  # torch's broadcast load then loads each optimizer's own state back
            return None
    return dsd.set_optimizer_state_dict(model, optimizers, osd, options=_every_rank(opts))


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """`torch.distributed.checkpoint.state_dict.set_state_dict` for veragged-sharded models: the
    optimizers' state, then the model's, each as `set_optimizer_state_dict` and
    `set_model_state_dict` load it. An empty `model_state_dict` loads the optimizers only, as
    torch's; with `broadcast_from_rank0` rank 0's decides for every rank (torch's skips the model
    on the ranks given an empty one, usually all but rank 0, while rank 0 broadcasts it, so
    their collectives go out of step).

    Returns:
        The model's `missing_keys` and `unexpected_keys`, as torch's.
    """
    optimizers = _as_tuple(optimizers)
    opts = options or StateDictOptions()
    if not opts.full_state_dict or first_ragged(dsd.get_model_state_dict(model)) is None:
        return dsd.set_state_dict(
            model, optimizers, model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict, options=options,
        )
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return _set_model(model, model_state_dict, options, skip_if_empty=True)


def _set_model(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    options: StateDictOptions | None,
    skip_if_empty: bool,
) -> _IncompatibleKeys:
    """`set_model_state_dict`; `skip_if_empty`: an empty state dict (rank 0's, when broadcast)
    loads nothing, as in torch's `set_state_dict`."""
    opts = options or StateDictOptions()
    if not opts.full_state_dict:
        return dsd.set_model_state_dict(model, model_state_dict, options=options)
    current = dsd.get_model_state_dict(model)  # sharded: the parameters and buffers themselves
    ragged = first_ragged(current)
    if ragged is None:
        return dsd.set_model_state_dict(model, model_state_dict, options=options)
    if model_state_dict and isinstance(next(iter(model_state_dict)), nn.Module):
        raise TypeError(
            "model_state_dict keyed by nn.Module (torch's deprecated form) is not supported for "
            f"models with RaggedShard values; key it by fully qualified name, got key "
            f"{type(next(iter(model_state_dict))).__name__}"
        )
    like = like_index(current)
    if not opts.broadcast_from_rank0:
        if skip_if_empty and not model_state_dict:
            return _IncompatibleKeys([], [])
        return dsd.set_model_state_dict(
            model, distribute_ragged(model_state_dict, like), options=options
        )
    received = receive_from_rank0(model_state_dict, like, mesh_device(ragged.device_mesh))
    if skip_if_empty and not received:
        return _IncompatibleKeys([], [])
    missing = [k for k in current if k not in received]
    unexpected = [k for k in received if k not in current]
    if dist.get_rank() != 0:  # in torch's broadcast, other ranks never see rank 0's extra keys
        for k in unexpected:
            del received[k]
        unexpected = []
    fails_strict = opts.strict and bool(missing or unexpected)
    result = dsd.set_model_state_dict(
        model, received, options=_every_rank(opts, strict=opts.strict and not fails_strict)
    )
    if fails_strict:
        raise RuntimeError(_strict_error(model, missing, unexpected))
    return result


def _every_rank(opts: StateDictOptions, **changes: Any) -> StateDictOptions:
    """`opts` for torch's load of a full state dict that every rank holds."""
    return dataclasses.replace(opts, broadcast_from_rank0=False, **changes)


def _as_tuple(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _strict_error(model: nn.Module, missing: list[str], unexpected: list[str]) -> str:
    """`nn.Module.load_state_dict`'s message for a strict load with these keys."""
    msgs = []
    if missing:
        msgs.append("Missing key(s) in state_dict: {}. ".format(_quoted(missing)))
    if unexpected:
        msgs.append("Unexpected key(s) in state_dict: {}. ".format(_quoted(unexpected)))
    return "Error(s) in loading state_dict for {}:\n\t{}".format(
        type(model).__name__, "\n\t".join(msgs)
    )


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{k}"' for k in keys)
