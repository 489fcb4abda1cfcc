"""Test helpers for veragged: run distributed test code on several CPU ranks (no compiled code)."""

from veragged.testing.multiprocess import MultiRankError, get_mesh, run_on_ranks

__all__ = ["MultiRankError", "get_mesh", "run_on_ranks"]
