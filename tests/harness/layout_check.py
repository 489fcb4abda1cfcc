"""check_layout(): the rules of [Note: planner layout contract], checked from Python."""

from __future__ import annotations

from typing import Sequence

from veragged.planner.api import Layout

__all__ = ["check_layout"]


def check_layout(layout: Layout, numels: Sequence[int], align: int = 1) -> None:
    """Raises ValueError naming the first rule `layout` breaks for tensors of `numels`.

    The Python twin of csrc/planner's validate(), for tests (tests/planner) and benchmarks
    (benchmarks/planner.py) that hold a Layout.
    """
    s, m = layout.shard_size, layout.world_size
    if s % align:
        raise ValueError(f"shard_size {s} is not a multiple of align {align}")
    if layout.padding != m * s - sum(numels):
        raise ValueError(f"padding {layout.padding} != {m} * {s} - {sum(numels)}")
    prev_end = 0
    spans = sorted(zip(layout.ranges, numels, layout.block_sizes, range(len(numels))))
    for (start, end), numel, block, t in spans:
        if end - start != numel or start < prev_end or start < 0 or end > m * s:
            raise ValueError(f"tensor {t}: range [{start}, {end}) is misplaced")
        prev_end = max(prev_end, end)
        if s:
            for b in range((start // s + 1) * s, end, s):
                if (b - start) % block:
                    raise ValueError(f"tensor {t}: block cut by the rank boundary at {b}")
        if sum(layout.rank_units(t).values()) != numel // block:
            raise ValueError(f"tensor {t}: ranks hold the wrong number of blocks")
