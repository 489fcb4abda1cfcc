"""The test harness: distributed test code on several ranks in reused rank pools (CPU/gloo,
or CUDA/NCCL under `VERAGGED_TEST_DEVICE=cuda`). It lives under tests/, outside the wheel."""

from tests.harness.multiprocess import MultiRankError, get_mesh, run_on_ranks

__all__ = ["MultiRankError", "get_mesh", "run_on_ranks"]
