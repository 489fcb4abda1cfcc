"""The device the test harness runs ranks on: `VERAGGED_TEST_DEVICE=cpu` (default) or `cuda`.

On `cpu` every rank is a CPU process in a gloo group (what CI runs). On `cuda` rank r drives GPU
r (`torch.cuda.set_device(r)`), its process group is `cpu:gloo,cuda:nccl` (NCCL for the device
mesh, gloo for the CPU tensors tests exchange), its meshes are CUDA meshes and new tensors land
on its GPU (`torch.set_default_device`), so a test written for the CPU runs its model, its
collectives and our kernels on the GPU. NCCL needs one GPU per rank: a job of more ranks than
visible GPUs is skipped with the reason (`unittest.SkipTest`, which pytest reports as a skip),
as is every test when no GPU is visible. Tests that only make sense on the CPU carry
`@pytest.mark.cpu_only("why")` (tests/conftest.py skips them on `cuda`).

    from tests.harness.device import rank_device_type
    mesh = init_device_mesh(rank_device_type(), (2,))   # "cpu", or "cuda" under the GPU harness
"""

from __future__ import annotations

import os
import unittest

__all__ = ["ENV", "backend_for", "check_devices", "rank_device_type", "test_device"]

ENV = "VERAGGED_TEST_DEVICE"
_DEVICES = ("cpu", "cuda")
# The device of this rank's pool (set in a rank by the pool or run_on_ranks; None elsewhere).
_RANK_DEVICE: str | None = None


def test_device() -> str:
    """The harness's device from `VERAGGED_TEST_DEVICE` ("cpu" when unset)."""
    device = os.environ.get(ENV, "cpu").strip().lower() or "cpu"
    if device not in _DEVICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(_DEVICES)}")
    return device


def rank_device_type() -> str:
    """The device type for meshes a test builds: its rank's device inside a harness rank, the
    harness's device elsewhere."""
    return _RANK_DEVICE or test_device()


def backend_for(device: str) -> str:
    """The process-group backend of ranks on `device`."""
    if device not in _DEVICES:
        raise ValueError(f"device {device!r}: choose one of {', '.join(_DEVICES)}")
    return "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"


def check_devices(device: str, world_size: int) -> None:
    """Skip (raise `unittest.SkipTest`) where `world_size` ranks cannot run on `device`."""
    if device == "cpu":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world_size:
        raise unittest.SkipTest(f"{ENV}=cuda: {world_size} rank(s) need as many GPUs for "
                                f"NCCL, {have} visible")


def enter_rank(device: str, rank: int) -> None:
    """Set a harness rank up on `device` (before its process group is made)."""
    global _RANK_DEVICE
    _RANK_DEVICE = device
    if device == "cuda":
        import torch

        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
