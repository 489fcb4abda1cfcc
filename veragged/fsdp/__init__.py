"""`veragged.fully_shard`: FSDP2's API with RaggedShard parameters in planned DBuffers."""

from veragged.fsdp.api import FSDPModule, UnshardHandle, fully_shard

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]
