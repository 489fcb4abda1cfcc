"""Where a DBuffer's memory comes from: aligned (optionally pinned) allocations and storages
freed and regrown in place."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from veragged.runtime.streams import alloc_storage, free_storage  # re-exported

__all__ = ["ALIGN_BYTES", "aligned_empty", "free_storage", "alloc_storage", "same_storage"]

ALIGN_BYTES = 256


def aligned_empty(numel: int, dtype: torch.dtype, device: torch.device,
                  pin_memory: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` elements whose first element is 256-byte aligned (in pinned host
    memory if `pin_memory`: the host side of CPU offload)."""
    item = torch.empty((), dtype=dtype).element_size()
    extra = ALIGN_BYTES // item
    raw = torch.empty(numel + extra, dtype=dtype, device=device, pin_memory=pin_memory)
    if raw.is_meta or is_fake(raw):  # no address to align (FakeTensorMode memory estimates)
        return raw[:numel]
    skip = (-raw.data_ptr() % ALIGN_BYTES) // item
    return raw[skip : skip + numel]


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` live in the same memory (their storages' data pointers agree). Fake
    tensors (FakeTensorMode memory estimates) have no data pointer: there, whether their
    storages are the same object."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if is_fake(a) or is_fake(b):
        return sa._cdata == sb._cdata
    return sa.data_ptr() == sb.data_ptr()
