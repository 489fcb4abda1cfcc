"""A slow pure-Python planner with the C++ planner's search, for differential tests only
(tests/planner/test_planner.py).

It shares no code with csrc/planner: placement scans candidate starts one by one and checks
every rank boundary a tensor covers, instead of the closed form of
[Note: greedy is the DP with segments collapsed]; the fill orders rank tensors one by one instead
of by class. Same orders, lower bound, lattices and search as [Note: shard-size search],
[Note: fill rules], [Note: exact placement] and [Note: lower bound], so on any input it must
return the same layout as the C++ planner.
"""

from __future__ import annotations

from itertools import product
from math import gcd

ORDERS = ("given", "block_size", "shape", "fill", "fill_large", "exact")
MAX_FILL_CLASSES = 64  # classes with blocks > 1
MAX_LATTICE_UNITS = 32
MAX_EXACT_STATES = 4096


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


def _place_fill(items, shard, limit, large):
    """A fill order: least score next, score = 2 * padding (- block with `large`); on ties the
    larger block, then the lower index."""
    pending = list(range(len(items)))
    pos, starts = 0, {}
    while pending:
        candidates = []
        seen = set()
        for t in pending:  # the first pending tensor of each (numel, block) class
            if items[t] in seen:
                continue
            seen.add(items[t])
            numel, block = items[t]
            start = _earliest_start(pos, numel, block, shard)
            if start is not None:
                score = 2 * (start - pos) - (block if large else 0)
                candidates.append((score, -block, t, start))
        if not candidates:
            return None
        _, _, t, start = min(candidates)
        if start + items[t][0] > limit:
            return None
        starts[t] = start
        pos = start + items[t][0]
        pending.remove(t)
    return starts


def _exact_classes(items):
    """(kinds, members) in first-appearance order, or None past MAX_EXACT_STATES."""
    kinds, members = [], []
    for t, item in enumerate(items):
        if item not in kinds:
            kinds.append(item)
            members.append([])
        members[kinds.index(item)].append(t)
    states = 1
    for m in members:
        states *= len(m) + 1
    if states > MAX_EXACT_STATES or len(kinds) > 255:
        return None
    return kinds, members


def _place_exact(classes, shard, limit):
    """The earliest end over every order (a DP over count vectors), or None."""
    kinds, members = classes
    sizes = [len(m) for m in members]
    total = sum(numel * len(m) for (numel, _), m in zip(kinds, members, strict=True))
    end, last = {(0,) * len(kinds): 0}, {}
    # Mixed-radix order with the first class least significant, like the C++ state index.
    for rev in product(*(range(n + 1) for n in reversed(sizes))):
        counts = rev[::-1]
        pos = end.get(counts)
        placed = sum(numel * k for (numel, _), k in zip(kinds, counts, strict=True))
        if pos is None or pos > limit - (total - placed):
            continue
        for c, (numel, block) in enumerate(kinds):
            if counts[c] == sizes[c]:
                continue
            start = _earliest_start(pos, numel, block, shard)
            if start is None:
                continue
            nxt = counts[:c] + (counts[c] + 1,) + counts[c + 1 :]
            if nxt not in end or start + numel < end[nxt]:
                end[nxt] = start + numel
                last[nxt] = c
    full = tuple(sizes)
    if full not in end or end[full] > limit:
        return None
    sequence, counts = [], full
    while any(counts):
        c = last[counts]
        sequence.append(c)
        counts = counts[:c] + (counts[c] - 1,) + counts[c + 1 :]
    taken = [0] * len(kinds)
    pos, starts = 0, {}
    for c in reversed(sequence):
        t = members[c][taken[c]]
        taken[c] += 1
        start = _earliest_start(pos, *kinds[c], shard)
        starts[t] = start
        pos = start + kinds[c][0]
    return starts


def _smallest_multiple(feasible, unit, lower, best):
    lo = -(-lower // unit)
    top = -(-best // unit) - 1
    if lo > top or not feasible(top * unit):
        return best
    if lo == top or feasible(lo * unit):
        return lo * unit
    lo, hi = lo + 1, top
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid * unit):
            hi = mid
        else:
            lo = mid + 1
    return hi * unit


def _round_up(v, u):
    return -(-v // u) * u


def lower_bound(numels, block_sizes, world_size, align=1):
    """[Note: lower bound]: no layout has a smaller shard size."""
    total = sum(numels)
    if total == 0:
        return 0
    need = max(
        -(-total // world_size), max(b for e, b in zip(numels, block_sizes, strict=True) if e > 0)
    )
    by_size = sorted(zip(numels, block_sizes, strict=True), key=lambda it: (-it[0], -it[1]))
    by_size.append((0, 1))
    best, unit, shortest_long = None, align, None
    for numel, block in by_size:
        size = _round_up(max(need, -(-numel // 2)), unit)
        if shortest_long is None or 2 * size < shortest_long:
            best = size if best is None else min(best, size)
        if numel == 0:
            break
        unit = unit * block // gcd(unit, block)
        if unit >= best:
            break
        shortest_long = numel
    return best


def _lattice_units(items, align, lower, best):
    by_size = sorted(items, key=lambda it: (-it[0], -it[1]))
    blocks = sorted({b for e, b in by_size if e >= lower and align % b})
    units = [align]
    for block in blocks:
        units += [lcm for lcm in (u * block // gcd(u, block) for u in units) if lcm < best]
        units = sorted(set(units))[:MAX_LATTICE_UNITS]
    unit = align
    chain = [align]
    for _, block in by_size:  # the paper's divisor chain
        nxt = unit * block // gcd(unit, block)
        if nxt >= best:
            break
        unit = nxt
        chain.append(unit)
    return sorted(set(units + chain))


def reference_plan(numels, block_sizes, world_size, align=1):
    """Returns (shard_size, starts, order name) as the C++ planner must."""
    items = list(zip(numels, block_sizes, strict=True))
    n, total = len(items), sum(numels)
    if total == 0:
        return 0, [0] * n, "given"

    lower = lower_bound(numels, block_sizes, world_size, align)
    best = _round_up(total, align)
    units = _lattice_units(items, align, lower, best)

    def fixed(perm):
        return lambda s: _place_fixed(items, perm, s, world_size * s)

    perms = {  # Python's sort is stable, like the C++ std::stable_sort
        "given": list(range(n)),
        "block_size": sorted(range(n), key=lambda t: -block_sizes[t]),
        "shape": sorted(range(n), key=lambda t: (-block_sizes[t], -numels[t])),
    }
    placers = {name: fixed(perm) for name, perm in perms.items()}
    if len({item for item in items if item[1] > 1}) <= MAX_FILL_CLASSES:
        placers["fill"] = lambda s: _place_fill(items, s, world_size * s, large=False)
        placers["fill_large"] = lambda s: _place_fill(items, s, world_size * s, large=True)
    classes = _exact_classes(items)
    if classes is not None:
        placers["exact"] = lambda s: _place_exact(classes, s, world_size * s)

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
        for unit in reversed(units):  # coarse lattices first
            if unit >= best:
                continue
            found = _smallest_multiple(
                lambda s, place=place: place(s) is not None, unit, lower, best
            )
            if found < best:
                best, best_order = found, name
    starts = placers[best_order](best)
    return best, [starts[t] for t in range(n)], best_order
