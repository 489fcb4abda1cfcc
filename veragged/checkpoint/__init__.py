"""Distributed checkpoint support.

RaggedShard DTensors save and load through torch.distributed.checkpoint. Full state dicts
(`full_state_dict=True`, optionally `broadcast_from_rank0=True`) load into veragged-sharded models
and optimizers through `set_model_state_dict`, `set_optimizer_state_dict` and `set_state_dict`
here, which take the arguments of torch's (veragged/checkpoint/state_dict.py says why torch's
cannot).
"""

from veragged.checkpoint.ragged import local_boxes
from veragged.checkpoint.state_dict import (
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = ["local_boxes", "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]
