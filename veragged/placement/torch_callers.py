"""torch's functions that cannot take a RaggedShard, caught where they touch one.

[Note: torch's entry points without the routing]
Without `veragged.route_torch_entry_points()` ([Note: routing torch's entry points],
veragged/checkpoint/torch_entry_points.py), torch's `distribute_tensor` and its
full-state-dict loaders (`set_model_state_dict`, `set_optimizer_state_dict`, `set_state_dict`
with `full_state_dict=True`) meet RaggedShard values and fail in ways that do not say what to
do, or, on a meta model, slice nothing and hand the whole tensor on. None of them asks the
placement or the DTensor a question it could answer, so, as [Note: torch's redistribute to
RaggedShard] (ragged_shard.py), the two places where torch's code does touch our objects check
whether their caller is torch's function, by code object, and raise there on every rank (each
rank runs the same keys in the same order, and no collective comes between):

- `distribute_tensor` formats an unknown placement into its "unsupported placements" error:
  `RaggedShard.__str__`, called from that function, raises ours instead (`__str__` is called
  nowhere else in it);
- the broadcast loader's slicing (`_distribute_tensors`) copies its slice into
  `value.to_local()`: `RaggedDTensor.to_local`, called from there, raises before the copy;
- on a meta model that loader makes a plain torch DTensor of the whole tensor under the
  RaggedShard spec (torch's `DTensor.from_local` asks the placement nothing), which reaches
  `load_state_dict(assign=True)`: fully_shard's load pre-hook checks each such value's local
  tensor before torch assigns it, and its post-hook every assigned value before the first load
  collective (`DBuffer.check_loadable`, veragged/dbuffer/buffer.py).

Each error names the state-dict key where the caller's frame has it, and both ways out: the
routing, and veragged's own functions. Checked by tests/checkpoint/test_unrouted_errors.py on
torch 2.11 and 2.15; a torch whose functions changed shape gets torch's own errors back.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType

import torch.distributed._state_dict_utils as _sdu
import torch.distributed.tensor._api as _dtensor_api
from torch.distributed.tensor.placement_types import Placement

__all__ = ["WAYS_OUT", "refuse_torch_caller"]


def _code(module, name: str) -> CodeType | None:
    fn = getattr(module, name, None)
    return getattr(fn, "__code__", None)


_DISTRIBUTE_TENSOR = _code(_dtensor_api, "distribute_tensor")
_DISTRIBUTE_STATE_DICT = _code(_sdu, "_distribute_state_dict")
_DISTRIBUTE_TENSORS = _code(_sdu, "_distribute_tensors")

WAYS_OUT = (
    "Call veragged.route_torch_entry_points() once before torch's loaders (it routes them to "
    "veragged for RaggedShard values only), or call veragged.checkpoint.set_model_state_dict / "
    "set_optimizer_state_dict / set_state_dict (torch's arguments) or veragged.distribute_tensor"
)


def refuse_torch_caller(value) -> None:
    """Raise, naming the way out, if the caller of the function that calls this is torch's
    `distribute_tensor` or its broadcast loader's slicing; `value` is the RaggedShard placement
    or DTensor that function was asked about. Identity checks only: this runs on every
    `to_local()` and `str()` of a placement."""
    frame = sys._getframe(2)
    code = frame.f_code
    if code is _DISTRIBUTE_TENSOR:
        what = "torch.distributed.tensor.distribute_tensor"
    elif code is _DISTRIBUTE_TENSORS:
        what = "torch's broadcast_from_rank0 full-state-dict loader"
    else:
        return
    met = (f"the RaggedShard placement {value!r}" if isinstance(value, Placement)
           else f"a DTensor with placements {tuple(value.placements)!r}")
    key = _key(frame)
    where = f" (state dict key {key!r})" if key else ""
    raise RuntimeError(
        f"{what} cannot take {met}{where}: torch's "
        f"distribute_tensor and full-state-dict loaders know only torch's placements. "
        f"{WAYS_OUT}"
    )


def _key(frame: FrameType | None) -> str | None:
    """The state-dict key torch's loader was at, looking from `frame` up one frame."""
    while frame is not None:
        if frame.f_code in (_DISTRIBUTE_TENSORS, _DISTRIBUTE_STATE_DICT):
            key = frame.f_locals.get("key")
            return key if isinstance(key, str) else None
        frame = frame.f_back if frame.f_code is _DISTRIBUTE_TENSOR else None
    return None
