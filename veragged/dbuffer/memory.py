"""Where a DBuffer's memory comes from: aligned (optionally pinned) allocations and storages
freed and regrown in place."""

from __future__ import annotations

import torch
from veragged.runtime.streams import alloc_storage, free_storage  # re-exported

__all__ = ["ALIGN_BYTES", "aligned_empty", "free_storage", "alloc_storage"]

ALIGN_BYTES = 256


def aligned_empty(numel: int, dtype: torch.dtype, device: torch.device,
                  pin_memory: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` elements whose first element is 256-byte aligned (in pinned host
    memory if `pin_memory`: the host side of CPU offload)."""
    item = torch.empty((), dtype=dtype).element_size()
    extra = ALIGN_BYTES // item
    raw = torch.empty(numel + extra, dtype=dtype, device=device, pin_memory=pin_memory)
    skip = (-raw.data_ptr() % ALIGN_BYTES) // item
    return raw[skip : skip + numel]
