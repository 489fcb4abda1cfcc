"""`veragged.fully_shard`: FSDP2's API with RaggedShard parameters in planned DBuffers."""

from veragged.fsdp.api import FSDPModule, UnshardHandle, fully_shard
from veragged.fsdp.clip import clip_grad_norm_

__all__ = ["FSDPModule", "UnshardHandle", "clip_grad_norm_", "fully_shard"]
