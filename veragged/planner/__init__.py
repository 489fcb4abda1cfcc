"""The structure-aware layout planner: where each tensor of a group lives in the shared buffer."""

from veragged.planner.api import Layout, plan

__all__ = ["Layout", "plan"]
