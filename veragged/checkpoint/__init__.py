"""Distributed checkpoint support.

RaggedShard DTensors save and load through torch.distributed.checkpoint.
"""

from veragged.checkpoint.ragged import local_boxes

__all__ = ["local_boxes"]
