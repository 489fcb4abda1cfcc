"""veragged.plan: the binding, its errors, and agreement with the pure-Python reference."""

import dataclasses
import random

import pytest

import veragged
from tests.harness import layout_check
from tests.harness.planner_reference import lower_bound as reference_lower_bound
from tests.harness.planner_reference import reference_plan
from veragged.planner import Layout, plan
from veragged.planner.api import ORDERS


def check_layout(layout: Layout, numels, blocks, world_size, align=1):
    assert layout.block_sizes == tuple(blocks) and layout.world_size == world_size
    layout_check.check_layout(layout, numels, align)
    assert all(len(units) == world_size for units in layout.units)
    assert [sum(units) for units in layout.units] == [
        e // g for e, g in zip(numels, blocks, strict=True)
    ]


def test_plan_example():
    layout = plan([6, 4, 12], [3, 2, 3], 4)
    assert layout.shard_size == 6
    assert layout.padding == 2
    assert layout.ranges == ((0, 6), (6, 10), (12, 24))
    assert layout.units == ((2, 0, 0, 0), (0, 2, 0, 0), (0, 0, 2, 2))
    assert layout.order == "given"
    assert layout.permutation == (0, 1, 2)
    assert veragged.plan is plan


def test_layout_is_frozen_and_cached():
    a = plan([10, 20], [1, 5], 3)
    assert plan([10, 20], [1, 5], 3) is a
    with pytest.raises(AttributeError):
        a.shard_size = 1


@pytest.mark.parametrize(
    "args, message",
    [
        (([10, 9], [5, 2], 2), r"block_sizes\[1\] = 2 does not divide numels\[1\] = 9"),
        (([10, -4], [5, 2], 2), r"numels\[1\] must be >= 0, got -4"),
        (([10], [0], 2), r"block_sizes\[0\] must be >= 1, got 0"),
        (([10], [-3], 2), r"block_sizes\[0\] must be >= 1, got -3"),
        (([10], [5], 0), r"world_size must be >= 1, got 0"),
        (([10], [5], 2, 0), r"align must be >= 1, got 0"),
        (([10], [5, 1], 2), r"same length, got 1 and 2"),
        (([2**63], [1], 2), r"numels\[0\] = 9223372036854775808 does not fit in int64"),
    ],
)
def test_errors_name_the_values(args, message):
    with pytest.raises(ValueError, match=message):
        plan(*args)


def test_check_layout_rejects_broken_layouts():
    good = plan([6, 4], [3, 2], 2)
    layout_check.check_layout(good, [6, 4])
    cut = dataclasses.replace(good, shard_size=5, padding=0, ranges=((1, 7), (7, 11)))
    with pytest.raises(ValueError, match="block cut by the rank boundary at 5"):
        layout_check.check_layout(cut, [6, 4])
    overlap = dataclasses.replace(good, ranges=((0, 6), (4, 8)))
    with pytest.raises(ValueError, match="tensor 1: range"):
        layout_check.check_layout(overlap, [6, 4])
    with pytest.raises(ValueError, match="not a multiple of align 4"):
        layout_check.check_layout(good, [6, 4], align=4)


def test_type_errors():
    with pytest.raises(TypeError, match=r"numels\[0\] must be an int"):
        plan([1.5], [1], 2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        plan([4], [1], True)


def test_edge_cases():
    check_layout(plan([], [], 4), [], [], 4)
    empty = plan([0, 0], [3, 1], 2)
    assert empty.shard_size == 0 and empty.units == ((0, 0), (0, 0))
    one = plan([5, 7], [5, 7], 1)
    assert one.shard_size == 12 and one.padding == 0
    # A tensor smaller than one shard, next to one spanning many ranks.
    numels, blocks = [3, 12 * 100], [3, 12]
    layout = plan(numels, blocks, 64)
    check_layout(layout, numels, blocks, 64)
    # Whole-tensor blocks land on one rank each.
    whole = plan([8, 8, 8], [8, 8, 8], 3)
    assert whole.shard_size == 8
    assert sorted(max(u) for u in whole.units) == [1, 1, 1]


def test_hundred_thousand_ranks():
    numels = [7168 * 2048, 2048 * 7168, 7168, 129280 * 7168]
    blocks = [7168, 2048, 1, 7168]
    layout = plan(numels, blocks, 100_000, align=64)
    assert layout.shard_size % 64 == 0
    for t, (start, end) in enumerate(layout.ranges):
        s = layout.shard_size
        for rank, count in layout.rank_units(t).items():
            assert count * blocks[t] == min(end, (rank + 1) * s) - max(start, rank * s)
    assert sum(sum(layout.rank_units(t).values()) for t in range(4)) == sum(
        e // g for e, g in zip(numels, blocks, strict=True)
    )


def random_group(rng: random.Random):
    n = rng.randint(1, 7)
    numels, blocks = [], []
    for _ in range(n):
        row = rng.choice([1, 2, 3, 5, 8])
        rows = rng.choice([0, rng.randint(1, 30)])
        kind = rng.randrange(3)
        block = 1 if kind == 0 else row if kind == 1 else max(row * rows, 1)
        numels.append(row * rows)
        blocks.append(block)
    return numels, blocks, rng.randint(1, 6), rng.choice([1, 1, 2, 4])


# The smallest group (found by search) on which each order is the one that wins.
WITNESSES = {
    "given": ([1, 1], [1, 1], 2),
    "block_size": ([1, 4, 1], [1, 4, 1], 2),
    "shape": ([5, 2, 8, 2], [5, 2, 2, 2], 4),
    "fill": ([2, 2, 2], [1, 2, 2], 2),
    "fill_large": ([1, 2, 6], [1, 1, 3], 2),
    "exact": ([10, 1, 2], [5, 1, 1], 2),
}


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_wins_somewhere(order):
    numels, blocks, m = WITNESSES[order]
    layout = plan(numels, blocks, m)
    check_layout(layout, numels, blocks, m)
    assert layout.order == order
    assert reference_plan(numels, blocks, m) == (
        layout.shard_size,
        [r[0] for r in layout.ranges],
        order,
    )


def many_shapes_group(rng: random.Random):
    """13-20 tensors of 6-9 shapes: mostly past the exact search's reach (over 4096 count
    vectors), so the heuristic orders decide."""
    shapes = []
    for _ in range(rng.randint(6, 9)):
        block = rng.choice([1, 2, 3, 5, 7])
        shapes.append((block * rng.randint(1, 9), block))
    n = rng.randint(13, 20)
    items = [rng.choice(shapes) for _ in range(n)]
    return [e for e, _ in items], [b for _, b in items], rng.randint(2, 8), rng.choice([1, 1, 2])


@pytest.mark.parametrize("make_group, count", [(random_group, 400), (many_shapes_group, 400)])
def test_agrees_with_reference_on_random_groups(make_group, count):
    rng = random.Random(5)
    for _ in range(count):
        numels, blocks, m, align = make_group(rng)
        layout = plan(numels, blocks, m, align)
        check_layout(layout, numels, blocks, m, align)
        shard, starts, order = reference_plan(numels, blocks, m, align)
        assert (layout.shard_size, [r[0] for r in layout.ranges], layout.order) == (
            shard,
            starts,
            order,
        ), (numels, blocks, m, align)
        assert layout.shard_size >= reference_lower_bound(numels, blocks, m, align)
