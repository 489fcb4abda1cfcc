"""veragged: structure-aware FSDP for PyTorch (RaggedShard, planner, DBuffer, optimizers)."""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from veragged import _C  # noqa: F401  (registers torch.ops.veragged.*)
from veragged.planner import Layout, plan

__all__ = ["Layout", "plan"]
__version__ = "0.1.0"
