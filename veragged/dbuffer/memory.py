"""Where a DBuffer's memory comes from: aligned (optionally pinned) allocations and storages
freed and regrown in place."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

import veragged.dbuffer.ops  # noqa: F401  (the fake kernel of veragged::aligned_empty)
from veragged.runtime.streams import alloc_storage, free_storage  # re-exported

__all__ = ["ALIGN_BYTES", "aligned_empty", "free_storage", "alloc_storage", "same_storage"]

ALIGN_BYTES = 256


def aligned_empty(numel: int, dtype: torch.dtype, device: torch.device,
                  pin_memory: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` elements whose first element is 256-byte aligned (in pinned host
    memory if `pin_memory`: the host side of CPU offload), taking exactly their bytes.

    [Note: aligned buffers]
    A DBuffer's flat allocations (the shard, the sharded gradients) start on 256 bytes, so a
    tensor planned at an aligned offset starts aligned (the owner engine then uses it in place:
    `optim/engine.py aligned_input`), and hold exactly the planned bytes: no allocation pays
    for its own alignment, which torch's fully_shard would not either (memory.py measures both).
    `veragged::aligned_empty` (csrc/dbuffer/memory.cpp) takes host memory from a 256-byte
    aligned allocator and device or pinned memory from torch's caching allocators, whose blocks
    are aligned already; under FakeTensorMode (memory estimates) it is `numel` elements."""
    return torch.ops.veragged.aligned_empty(int(numel), dtype, torch.device(device),
                                            bool(pin_memory))


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` live in the same memory (their storages' data pointers agree). Fake
    tensors (FakeTensorMode memory estimates) have no data pointer: there, whether their
    storages are the same object."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if is_fake(a) or is_fake(b):
        return sa._cdata == sb._cdata
    return sa.data_ptr() == sb.data_ptr()
