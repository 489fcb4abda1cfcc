"""Where a DBuffer's memory comes from: aligned (optionally pinned) allocations, storages freed
and regrown in place, and the device a mesh computes on."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from veragged.runtime.streams import alloc_storage, free_storage  # re-exported

__all__ = ["ALIGN_BYTES", "aligned_empty", "mesh_device", "free_storage", "alloc_storage"]

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


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives run on (this rank's current CUDA device for CUDA)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
