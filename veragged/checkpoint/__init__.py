"""Distributed checkpoint support.

RaggedShard DTensors save and load through torch.distributed.checkpoint. Full state dicts
(`full_state_dict=True`, optionally `broadcast_from_rank0=True`) load into veragged-sharded models
and optimizers through `set_model_state_dict`, `set_optimizer_state_dict` and `set_state_dict`
here, which take the arguments of torch's (veragged/checkpoint/state_dict.py says why torch's
cannot), or through torch's own setters and `distribute_tensor` once
`route_torch_entry_points()` is called ([Note: routing torch's entry points]).
"""

from veragged.checkpoint.state_dict import (
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from veragged.checkpoint.torch_entry_points import (
    TorchEntryPointRouting,
    route_torch_entry_points,
    torch_entry_points_routed,
    unroute_torch_entry_points,
)
from veragged.placement.boxes import local_boxes

__all__ = [
    "TorchEntryPointRouting",
    "local_boxes",
    "route_torch_entry_points",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "torch_entry_points_routed",
    "unroute_torch_entry_points",
]
