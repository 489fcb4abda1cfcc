"""The device a mesh's work runs on, from one place (dbuffer, fsdp, checkpoint and optim ask)."""

from __future__ import annotations

import torch

__all__ = ["mesh_device"]


def mesh_device(mesh) -> torch.device:
    """The device of this rank on `mesh`: its current CUDA device for a CUDA mesh, else the
    mesh's device type."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
