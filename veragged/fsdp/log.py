"""What fully_shard decided, on `logging.getLogger("veragged.fsdp")`: silent unless the user turns
logging on (the package logger has a NullHandler; nothing here is a warning).

- INFO, once per root at its first forward (lazy init): the tree's groups, sharded bytes per
  rank, the planner's padding and the 8-bit formats.
- DEBUG, at each `fully_shard` call: every group's plan (its kind, world, shard size, padding,
  tensor order, frozen parameters, formats) and every fallback from the structure-aware layout
  (torch's chunked layout, all-gather extensions, DDP mode).
"""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger("veragged.fsdp")

__all__ = ["log_groups", "log_root", "module_name"]

# Why a group is not planned by the structure-aware planner (the DBuffer class it got).
_FALLBACKS = {
    "ChunkedDBuffer": "torch's chunked layout: shard_placement_fn cuts along a dim > 0",
    "ExtensionDBuffer": "all-gather extension hooks decide what travels (planned whole)",
    "ReplicatedDBuffer": "DDP mode: the dp_mesh_dims name no shard dim, nothing is cut",
}


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _padding(buffers) -> tuple[int, int]:
    """(padding elements, planned elements) of the buffers the planner laid out."""
    pad = total = 0
    for b in buffers:
        layout = getattr(b, "layout", None)
        if layout is not None:
            pad += layout.padding
            total += layout.world_size * layout.shard_size
    return pad, total


def _formats(buffers) -> Counter:
    seen: Counter = Counter()
    for b in buffers:
        stats = getattr(b, "stats", None)
        for f in (stats.formats.values() if stats is not None else ()):
            if f != "raw":
                seen[f] += 1
    return seen


def module_name(module) -> str:
    """The class name the user wrote (fully_shard swaps in an `FSDP<Name>` subclass)."""
    return next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def log_groups(module_names: str, groups) -> None:
    """DEBUG: the plan of each group one `fully_shard` call made, and its fallbacks."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    for i, g in enumerate(groups):
        b = g.buffer
        kind = type(b).__name__
        layout = getattr(b, "layout", None)
        frozen = [f for f, p in zip(g.fqns, g.sharded) if not p.requires_grad]
        plan = (f"shard {b.shard_size} elements x {b.world} ranks, padding "
                f"{layout.padding} ({100 * layout.padding / max(1, b.world * b.shard_size):.2f}%),"
                f" order {layout.order}" if layout is not None else f"shard {b.shard_size} "
                f"elements x {b.world} ranks")
        formats = dict(_formats([b]))
        logger.debug(
            "fully_shard(%s) group %d: %s, %d parameters %s, %s, dtype %s, param dtype %s%s%s",
            module_names, i, kind, len(g.fqns), list(g.fqns), plan, b.dtype, b.param_dtype,
            f", frozen {frozen}" if frozen else "",
            f", 8-bit formats {formats}" if formats else "")
        if kind in _FALLBACKS:
            logger.debug("fully_shard(%s) group %d falls back: %s", module_names, i,
                         _FALLBACKS[kind])
        if frozen and len(frozen) == len(g.fqns):
            logger.debug("fully_shard(%s) group %d is frozen: its backward prepares no "
                         "gradient buffer while no parameter requires grad", module_names, i)


def log_root(root_name: str, states) -> None:
    """INFO: one line for a root's tree at its lazy init."""
    if not logger.isEnabledFor(logging.INFO):
        return
    buffers = [g.buffer for st in states for g in st.groups]
    sharded = sum(b.shard_size * b.dtype.itemsize for b in buffers if not b.is_meta)
    pad, total = _padding(buffers)
    kinds = Counter(type(b).__name__ for b in buffers)
    formats = dict(_formats(buffers))
    world = max((b.world for b in buffers), default=1)
    logger.info(
        "fully_shard root %s: %d modules, %d groups %s over %d ranks, %s sharded per rank, "
        "planner padding %.2f%%%s", root_name, len(states), len(buffers), dict(kinds), world,
        _mb(sharded), 100 * pad / total if total else 0.0,
        f", 8-bit formats {formats}" if formats else "")
