"""A slow pure-Python planner with the C++ planner's search, for differential tests only
(tests/planner/test_planner.py).

It shares no code with csrc/planner: placement scans candidate starts one by one and checks
every rank boundary a tensor covers, instead of the closed form of
[Note: greedy is the DP with segments collapsed]. Same orders, lattices and search as
[Note: shard-size search], so on any input it must return the same layout as the C++ planner.
"""

from __future__ import annotations

from math import gcd

ORDERS = ("given", "block_size", "shape", "fill")
MAX_FILL_CLASSES = 64


def _blocks_whole(start: int, numel: int, block: int, shard: int) -> bool:
    b = (start // shard + 1) * shard
    while b < start + numel:
        if (b - start) % block:
            return False
        b += shard
    return True


def _earliest_start(pos: int, numel: int, block: int, shard: int) -> int | None:
    for start in range(pos, pos + 2 * shard):  # the rule is periodic in shard
        if _blocks_whole(start, numel, block, shard):
            return start
    return None


def _place_fixed(items, perm, shard, limit):
    """Returns {input index: start} placing `perm` in order, or None."""
    pos, starts = 0, {}
    for t in perm:
        numel, block = items[t]
        start = _earliest_start(pos, numel, block, shard)
        if start is None or start + numel > limit:
            return None
        starts[t] = start
        pos = start + numel
    return starts


def _place_fill(items, shard, limit):
    """The fill order: least padding next; larger block, then lower index, on ties."""
    pending = list(range(len(items)))
    pos, starts = 0, {}
    while pending:
        candidates = []
        seen = set()
        for t in pending:  # the first pending tensor of each (numel, block) class
            if items[t] in seen:
                continue
            seen.add(items[t])
            start = _earliest_start(pos, items[t][0], items[t][1], shard)
            if start is not None:
                candidates.append((start, -items[t][1], t))
        if not candidates:
            return None
        start, _, t = min(candidates)
        if start + items[t][0] > limit:
            return None
        starts[t] = start
        pos = start + items[t][0]
        pending.remove(t)
    return starts


def _smallest_multiple(feasible, unit, lower, best):
    lo = -(-lower // unit)
    k_best = -(-best // unit)
    if lo >= k_best:
        return best
    step, hi = 1, lo
    while not feasible(hi * unit):
        lo = hi + 1
        if hi + step >= k_best:
            return best
        hi += step
        step *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid * unit):
            hi = mid
        else:
            lo = mid + 1
    return hi * unit


def reference_plan(numels, block_sizes, world_size, align=1):
    """Returns (shard_size, starts, order name) as the C++ planner must."""
    items = list(zip(numels, block_sizes))
    n, total = len(items), sum(numels)
    if total == 0:
        return 0, [0] * n, "given"

    def round_up(v, u):
        return -(-v // u) * u

    max_block = max(b for e, b in items if e > 0)
    lower = round_up(max(-(-total // world_size), max_block), align)
    best = round_up(total, align)

    units, unit = [align], align
    for e, b in sorted(items, key=lambda it: (-it[0], -it[1])):
        nxt = unit * b // gcd(unit, b)
        if nxt >= best:
            break
        unit = nxt
        if unit != units[-1]:
            units.append(unit)

    def fixed(perm):
        return lambda s: _place_fixed(items, perm, s, world_size * s)

    perms = {  # Python's sort is stable, like the C++ std::stable_sort
        "given": list(range(n)),
        "block_size": sorted(range(n), key=lambda t: -block_sizes[t]),
        "shape": sorted(range(n), key=lambda t: (-block_sizes[t], -numels[t])),
    }
    placers = {name: fixed(perm) for name, perm in perms.items()}
    if len(set(items)) <= MAX_FILL_CLASSES:
        placers["fill"] = lambda s: _place_fill(items, s, world_size * s)

    best_order, tried = "given", []
    for name in ORDERS:
        if best == lower:
            break
        if name not in placers:
            continue
        if name in perms:
            if perms[name] in tried:
                continue
            tried.append(perms[name])
        place = placers[name]
        for unit in units:
            if unit >= best:
                break
            found = _smallest_multiple(lambda s: place(s) is not None, unit, lower, best)
            if found < best:
                best, best_order = found, name
    starts = placers[best_order](best)
    return best, [starts[t] for t in range(n)], best_order

