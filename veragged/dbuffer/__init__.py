"""DBuffer: one planned flat allocation per parameter group, and its fused group ops."""

from veragged.dbuffer import ops

__all__ = ["ops"]
