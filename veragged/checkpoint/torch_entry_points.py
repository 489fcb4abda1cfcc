"""An explicit opt-in that lets torch's generic entry points take RaggedShard placements.

[Note: routing torch's entry points]
torch's `torch.distributed.tensor.distribute_tensor` dispatches on `isinstance(p, Shard |
_StridedShard)`, `Replicate` and `Partial` and raises "unsupported placements" for any other
placement; torch's full-state-dict loaders (`set_model_state_dict`, `set_optimizer_state_dict`,
`set_state_dict` with `full_state_dict=True`) shard each full tensor with it, or, with
`broadcast_from_rank0=True`, slice it at `compute_local_shape_and_global_offset`, which takes a
RaggedShard for a replica (the copy into the flat local shard then fails: "size of tensor a
(8192) must match b (64)"). None of them asks the placement anything it could answer, so unlike
[Note: torch's redistribute to RaggedShard] (where raising was enough) there is no narrow hook
that can *produce* a result: torch's functions themselves must be reached. (Making RaggedShard
a `Shard` subclass would send it down torch's Shard code paths, which read `.dim` and cut equal
chunks: wrong data.)

Two designs were weighed: (a) an explicit opt-in that routes torch's functions to veragged for
RaggedShard placements only, and (b) veragged's functions beside torch's, each client changed
by one line. (b) fails where users cannot change a line: accelerate calls torch's
`distribute_tensor` inside `prepare()` (`fsdp2_load_full_state_dict`, cpu_ram_efficient_loading)
and torch's `set_model_state_dict(..., broadcast_from_rank0=True)` inside `load_state`,
torchtune's `load_from_full_model_state_dict` / `load_from_full_optimizer_state_dict` call the
`distribute_tensor` they imported at module level, and torch's own FSDP2 tests distribute full
tensors with the sharded parameters' placements. So: (a), `route_torch_entry_points()`.

What it routes, and nothing else:
- `distribute_tensor`: every global binding of torch's function in an imported module outside
  veragged (`torch.distributed.tensor`, `torch.distributed.tensor._api`, the deprecated
  `torch.distributed._tensor` that torchtune 0.6.1 imports it from, `torch.distributed.
  _state_dict_utils`, and any client module that did `from ... import distribute_tensor`, under
  any name) is replaced by a wrapper; modules imported later, and accelerate, which imports it
  inside its functions, pick the wrapper up from `torch.distributed.tensor`. A call whose
  `placements` hold a RaggedShard goes to `veragged.distribute_tensor` (after torch's leaf
  check); every other call goes to torch's function with the same arguments, and its result is
  returned as is.
- the broadcast loader's slicing, `torch.distributed._state_dict_utils._distribute_tensors`
  (called by `_broadcast_tensors` after each broadcast): keys whose current value is a
  RaggedShard DTensor get their piece from veragged (each rank slices its rows of the broadcast
  tensor, no communication; copied into the current local tensor, or a new DTensor where the
  current one is on the meta device, as torch does for its placements); the other keys go to
  torch's function unchanged.
- the every-rank loader, `_distribute_state_dict` (bound in `torch.distributed._state_dict_utils`
  and `torch.distributed.checkpoint.state_dict`): first checks the shape of every full tensor that
  replaces a RaggedShard value, raising ValueError naming the key and both shapes on every rank
  before any collective, then runs torch's function, whose `distribute_tensor` is the wrapper.
The routing is reference-counted: each `route_torch_entry_points()` returns a handle, and torch's
functions are put back (every binding that holds a wrapper, including those of modules imported
meanwhile) when the last handle is undone, or at once by `unroute_torch_entry_points()`.
Bindings the scan cannot see (closures, `functools.partial`, copies in containers) keep torch's
function.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed._state_dict_utils as _sdu
import torch.distributed.tensor._api as _dtensor_api
from torch.distributed.tensor import DTensor

from veragged.checkpoint.full_values import shard_like
from veragged.placement import RaggedShard
from veragged.placement import distribute_tensor as _veragged_distribute_tensor

__all__ = [
    "TorchEntryPointRouting",
    "route_torch_entry_points",
    "torch_entry_points_routed",
    "unroute_torch_entry_points",
]


def _has_ragged(placements: Any) -> bool:
    # Only real sequences are looked into: torch itself needs len(placements).
    return isinstance(placements, Sequence) and any(isinstance(p, RaggedShard) for p in placements)


def _ragged_value(value: Any) -> bool:
    return isinstance(value, DTensor) and _has_ragged(value.placements)


# torch's functions, as torch.distributed defines them (None where this torch lacks one).
_TORCH_DISTRIBUTE_TENSOR = getattr(_dtensor_api, "distribute_tensor", None)
_TORCH_DISTRIBUTE_TENSORS = getattr(_sdu, "_distribute_tensors", None)
_TORCH_DISTRIBUTE_STATE_DICT = getattr(_sdu, "_distribute_state_dict", None)


def _distribute_ragged(
    tensor: torch.Tensor, device_mesh=None, placements=None, *, src_data_rank: int | None = 0
) -> DTensor:
    if not tensor.is_leaf:  # torch's check, with torch's message
        raise RuntimeError(
            "`distribute_tensor` should be used to distribute leaf tensors! but found non-leaf "
            "tensor!"
        )
    try:
        return _veragged_distribute_tensor(
            tensor, device_mesh, placements, src_data_rank=src_data_rank
        )
    except ValueError as e:  # raised on every rank alike, before any collective
        raise ValueError(
            f"distribute_tensor: a tensor of shape {list(tensor.shape)} cannot take placements "
            f"{tuple(placements)}: {e}"
        ) from e


def _wrap(original: Callable, body: Callable) -> Callable:
    """`body` dressed as `original` (name, docstring, signature through `__wrapped__`), its
    module left as this one's, so that help() and tracebacks show the routing."""
    wrapper = functools.wraps(original)(body)
    wrapper.__module__ = __name__
    return wrapper


def _routed_distribute_tensor(*args: Any, **kwargs: Any) -> DTensor:
    placements = args[2] if len(args) > 2 else kwargs.get("placements")
    if _has_ragged(placements):
        return _distribute_ragged(*args, **kwargs)
    return _TORCH_DISTRIBUTE_TENSOR(*args, **kwargs)


def _routed_distribute_tensors(local_state_dict: dict, keys: list, *args: Any, **kwargs: Any):
    # After a broadcast: a key's value is (current DTensor, full tensor) or a plain tensor.
    ragged = [
        k for k in keys
        if isinstance(v := local_state_dict.get(k), tuple) and len(v) == 2 and _ragged_value(v[0])
    ]
    if not ragged:
        return _TORCH_DISTRIBUTE_TENSORS(local_state_dict, keys, *args, **kwargs)
    for key in ragged:
        current, full = local_state_dict[key]
        local_state_dict[key] = _piece_into(key, current, full)
    rest = [k for k in keys if k not in ragged]
    if rest:
        _TORCH_DISTRIBUTE_TENSORS(local_state_dict, rest, *args, **kwargs)
    return None


def _piece_into(key: str, current: DTensor, full: torch.Tensor) -> DTensor:
    """This rank's piece of the broadcast `full`, as torch's `_distribute_tensors` places its own
    placements: copied into `current`'s local tensor, or a new DTensor if `current` is meta."""
    piece = shard_like(full.detach(), current, (key,), src_data_rank=None)
    if current.is_meta:
        return piece
    current.to_local().copy_(piece.to_local())
    return current


def _routed_distribute_state_dict(full_state_dict: dict, local_state_dict: dict, *args, **kwargs):
    for key, value in full_state_dict.items():
        current = local_state_dict.get(key)
        if torch.is_tensor(value) and value.dim() > 0 and _ragged_value(current):
            if value.shape != current.shape:
                raise ValueError(
                    f"state dict value {key!r} has shape {tuple(value.shape)}, but the value it "
                    f"loads into has shape {tuple(current.shape)} (placements "
                    f"{tuple(current.placements)})"
                )
    return _TORCH_DISTRIBUTE_STATE_DICT(full_state_dict, local_state_dict, *args, **kwargs)


def _routes() -> dict[int, tuple[Callable, Callable]]:
    """id(torch's function) -> (torch's function, its wrapper)."""
    missing = [
        name for name, fn in (
            ("torch.distributed.tensor._api.distribute_tensor", _TORCH_DISTRIBUTE_TENSOR),
            ("torch.distributed._state_dict_utils._distribute_tensors", _TORCH_DISTRIBUTE_TENSORS),
            ("torch.distributed._state_dict_utils._distribute_state_dict",
             _TORCH_DISTRIBUTE_STATE_DICT),
        ) if fn is None
    ]
    if missing:
        raise RuntimeError(
            f"route_torch_entry_points: this torch ({torch.__version__}) lacks {missing}, which "
            "the routing wraps; use veragged.distribute_tensor and veragged.checkpoint's setters"
        )
    return {id(original): (original, wrapper) for original, wrapper in _WRAPPERS}


_WRAPPERS: list[tuple[Callable, Callable]] = []
if None not in (_TORCH_DISTRIBUTE_TENSOR, _TORCH_DISTRIBUTE_TENSORS, _TORCH_DISTRIBUTE_STATE_DICT):
    _WRAPPERS = [
        (_TORCH_DISTRIBUTE_TENSOR, _wrap(_TORCH_DISTRIBUTE_TENSOR, _routed_distribute_tensor)),
        (_TORCH_DISTRIBUTE_TENSORS, _wrap(_TORCH_DISTRIBUTE_TENSORS, _routed_distribute_tensors)),
        (_TORCH_DISTRIBUTE_STATE_DICT,
         _wrap(_TORCH_DISTRIBUTE_STATE_DICT, _routed_distribute_state_dict)),
    ]


def _rebind(mapping: dict[int, tuple[Callable, Callable]]) -> None:
    """In every imported module outside veragged, rebind each global that is a key's function
    (by identity) to the mapped one."""
    for name, module in list(sys.modules.items()):
        if name == "veragged" or name.startswith("veragged."):
            continue  # veragged's own modules keep torch's function where they bound it
        try:  # sys.modules may hold objects that are not modules
            namespace = getattr(module, "__dict__", None)
        except Exception:
            continue
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if callable(value) and id(value) in mapping and mapping[id(value)][0] is value:
                namespace[attr] = mapping[id(value)][1]


_LOCK = threading.Lock()
_HOLDERS = 0  # holds not yet undone
_GENERATION = 0  # bumped by unroute_torch_entry_points: older holds then count for nothing


def _unroute() -> None:
    """With _LOCK held: torch's functions back in every binding that holds a wrapper."""
    global _HOLDERS, _GENERATION
    _HOLDERS = 0
    _GENERATION += 1
    _rebind({id(w): (w, o) for o, w in _WRAPPERS})


class TorchEntryPointRouting:
    """A hold on the routing ([Note: routing torch's entry points]); `undo()` (or leaving the
    `with` block) releases it, and torch's functions come back when no hold remains."""

    def __init__(self, generation: int) -> None:
        self._generation = generation
        self._held = True

    def undo(self) -> None:
        """Release this hold (again, or after `unroute_torch_entry_points()`: nothing)."""
        global _HOLDERS
        with _LOCK:
            if not self._held:
                return
            self._held = False
            if self._generation != _GENERATION:
                return
            _HOLDERS -= 1
            if _HOLDERS == 0:
                _unroute()

    def __enter__(self) -> "TorchEntryPointRouting":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def route_torch_entry_points() -> TorchEntryPointRouting:
    """Let torch's `distribute_tensor` and full-state-dict loaders take RaggedShard placements.

    After this call, `torch.distributed.tensor.distribute_tensor(full, mesh, param.placements)`
    (any `src_data_rank`) and `torch.distributed.checkpoint.state_dict.set_model_state_dict` /
    `set_optimizer_state_dict` / `set_state_dict` with `full_state_dict=True` (with or without
    `broadcast_from_rank0`) work on veragged-sharded models, also when called from inside
    accelerate, torchtune or torch's own code; calls whose placements hold no RaggedShard, and
    models without RaggedShard values, run torch's code unchanged. See [Note: routing torch's
    entry points] for exactly what is rebound.

    Idempotent: torch's functions are wrapped once however often this is called; each call
    returns a hold, and they come back when every hold is undone. Use it once at start-up, or as
    a context manager::

        veragged.route_torch_entry_points()          # for the rest of the program
        with veragged.route_torch_entry_points():    # for this block
            set_model_state_dict(model, full_sd, options=opts)

    Raises:
        RuntimeError: if this torch lacks one of the functions the routing wraps.
    """
    global _HOLDERS
    routes = _routes()
    with _LOCK:
        if _HOLDERS == 0:
            _rebind(routes)
        _HOLDERS += 1
        return TorchEntryPointRouting(_GENERATION)


def unroute_torch_entry_points() -> None:
    """Put torch's functions back now, whatever holds remain (they become no-ops)."""
    with _LOCK:
        if _HOLDERS:
            _unroute()


def torch_entry_points_routed() -> bool:
    """Whether the routing is in place."""
    return _HOLDERS > 0
