"""torch.ops.veragged.flat_range_boxes and interval_overlaps: results and ValueError messages.

The brute-force checks live in tests/cpp/test_boxes.cpp; this checks the binding.
"""

import pytest
import torch

import veragged  # noqa: F401  (registers torch.ops.veragged.*)

ops = torch.ops.veragged


def boxes(shape, begin, end):
    """The op's flat output as [(offsets, sizes), ...]."""
    flat = ops.flat_range_boxes(shape, begin, end)
    k = len(shape)
    assert len(flat) % (2 * k) == 0
    return [
        (list(flat[i : i + k]), list(flat[i + k : i + 2 * k])) for i in range(0, len(flat), 2 * k)
    ]


def test_flat_range_boxes_examples():
    # [3, 4], elements 1..10: the rest of row 0, row 1, the start of row 2.
    assert boxes([3, 4], 1, 10) == [([0, 1], [1, 3]), ([1, 0], [1, 4]), ([2, 0], [1, 2])]
    assert boxes([3, 4], 4, 12) == [([1, 0], [2, 4])]
    assert boxes([10], 3, 7) == [([3], [4])]
    assert boxes([3, 4], 5, 5) == []
    assert boxes([2, 0, 3], 0, 0) == []
    # [2, 3, 4], elements 5..22: leading pieces inner first, the middle, trailing outer first.
    assert boxes([2, 3, 4], 5, 23) == [
        ([0, 1, 1], [1, 1, 3]),
        ([0, 2, 0], [1, 1, 4]),
        ([1, 0, 0], [1, 2, 4]),
        ([1, 2, 0], [1, 1, 3]),
    ]


def test_flat_range_boxes_cover_the_range():
    shape = [3, 2, 5]
    numel = 30
    for begin in range(numel + 1):
        for end in range(begin, numel + 1):
            covered = torch.zeros(shape, dtype=torch.int64)
            for offsets, sizes in boxes(shape, begin, end):
                covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
            expected = torch.zeros(numel, dtype=torch.int64)
            expected[begin:end] = 1
            assert torch.equal(covered.flatten(), expected), (begin, end)


@pytest.mark.parametrize(
    "args, message",
    [
        (([], 0, 0), r"flat_range_boxes: shape must have at least one dim, got \[\]"),
        (([3, -2], 0, 0), r"flat_range_boxes: shape\[1\] = -2 must be >= 0"),
        (([3, 4], -1, 2), r"flat_range_boxes: begin = -1 must be >= 0"),
        (([3, 4], 0, 13), r"flat_range_boxes: end = 13 exceeds numel 12 of shape \[3, 4\]"),
        (([3, 4], 5, 3), r"flat_range_boxes: begin = 5 exceeds end = 3"),
        (([2**32, 2**32], 0, 0), r"numel of shape \[4294967296, 4294967296\] overflows int64"),
    ],
)
def test_flat_range_boxes_errors(args, message):
    with pytest.raises(ValueError, match=message):
        ops.flat_range_boxes(*args)


def test_interval_overlaps_example():
    # 10 elements: 4, 4, 2 before; 3, 3, 4 after. Rank 1 holds [4, 8), then [3, 6).
    send, recv = ops.interval_overlaps([0, 4, 8, 10], [0, 3, 6, 10], 1)
    assert list(send) == [0, 2, 2]
    assert list(recv) == [1, 2, 0]


def test_interval_overlaps_is_a_transpose():
    src, dst = [0, 0, 5, 5, 9], [0, 3, 3, 8, 9]
    sends = [list(ops.interval_overlaps(src, dst, r)[0]) for r in range(4)]
    recvs = [list(ops.interval_overlaps(src, dst, r)[1]) for r in range(4)]
    assert sends == [[0, 0, 0, 0], [3, 0, 2, 0], [0, 0, 0, 0], [0, 0, 3, 1]]
    assert recvs == [list(column) for column in zip(*sends)]
    assert [sum(s) for s in sends] == [0, 5, 0, 4]
    assert [sum(r) for r in recvs] == [3, 0, 5, 1]


@pytest.mark.parametrize(
    "args, message",
    [
        (([0, 4], [0, 2, 4], 0), r"must have the same length, got 2 and 3"),
        (([0], [0], 0), r"the bounds need P \+ 1 >= 2 entries, got 1"),
        (([1, 4], [0, 4], 0), r"interval_overlaps: src_bounds\[0\] = 1 must be 0"),
        (([0, 5, 4], [0, 2, 4], 0), r"src_bounds\[2\] = 4 is less than src_bounds\[1\] = 5"),
        (([0, 2, 4], [0, 2, 6], 0), r"src_bounds ends at 4 but dst_bounds ends at 6"),
        (([0, 2, 4], [0, 2, 4], 2), r"interval_overlaps: rank = 2 must be in \[0, 2\)"),
    ],
)
def test_interval_overlaps_errors(args, message):
    with pytest.raises(ValueError, match=message):
        ops.interval_overlaps(*args)
