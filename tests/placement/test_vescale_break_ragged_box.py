"""Port of veScale's `test/dtensor/cpu_only/test_break_ragged_box.py` (volcengine/veScale) to
veragged: a hyperrectangle of the "ragged view" of a tensor (the contiguous `ragged_dims`
flattened into one axis) is broken into boxes of the tensor itself; filling the boxes in order
with consecutive integers must cover the rectangle exactly (every value 0..n-1 once) and touch
nothing outside it. veScale also asserts the largest number of boxes met: 2**nd - 1 (1 for 1-D
shapes, 3 for 2-D ones).

Mapping: veScale's `_break_ragged_box(box_shape, box_offset, ragged_dims, shape, shape, zeros)`
(vescale/dtensor/vescale_utils/checkpoint.py) is veragged's box decomposition
`torch.ops.veragged.flat_range_boxes(shape, begin, end)` (csrc/placement/boxes.h,
[Note: flat range boxes]; used by veragged/placement/boxes.py), which cuts a row-major flat range
of the ragged dims into boxes; `_break_ragged_box` below applies it to the rectangle's range on
the ragged axis and keeps the rectangle's range on every other dim, which is what veScale's
function computes for a box of the ragged view. veScale's brute-force/random generators (shapes
from (3, 16, 32, 53), every contiguous `ragged_dims`, all or `unique_random_hyperrectangles`
rectangles with `random.seed(9999)`) are kept.

Trimmed for the CPU CI budget (veScale runs tens of millions of rectangles on a process pool):
- test_1d_case: exhaustive, as veScale.
- test_2d_case: exhaustive for every (shape, ragged_dims) with at most EXHAUSTIVE_MAX rectangles
  (11 of the 48, 17640 rectangles), else EXHAUSTIVE_SAMPLE rectangles drawn with veScale's random
  generator (veScale: all of them, up to 4 million per shape, about 20 million in all).
- test_3d_case / test_4d_case: RANDOM_K random rectangles per (shape, ragged_dims) instead of
  veScale's 20000 (264 and 640 pairs); veScale checks no box count there, neither do we.
The check of each rectangle is vectorised (sorted values == arange instead of a Python set),
which is the same condition. Runs in the test process (no ranks).
"""

import itertools
import math
import random

import torch

import veragged  # noqa: F401  (registers torch.ops.veragged.*)
from tests.harness.cases import assert_cases, error

EXHAUSTIVE_MAX = 5000  # 2-D: all rectangles when there are at most this many
EXHAUSTIVE_SAMPLE = 400  # 2-D: else this many random ones (veScale: all)
RANDOM_K = {3: 60, 4: 25}  # veScale: 20000 per (shape, ragged_dims)


def product_limited(lst, repeat, max_count):
    """Tuples of `repeat` entries of lst, each value used at most max_count times (veScale's)."""
    for t in itertools.product(lst, repeat=repeat):
        if all(t.count(x) <= max_count for x in t):
            yield t


def produce_test_tensor_shape(nd=(1, 2, 3, 4, 5), threshold=128 * 128):
    """veScale's shapes: every combination of (3, 16, 32, 53) with fewer than threshold elements."""
    shape_1d = (3, 16, 32, 53)
    gens = {
        1: ((x,) for x in shape_1d),
        2: itertools.product(shape_1d, repeat=2),
        3: itertools.product(shape_1d, repeat=3),
        4: product_limited(shape_1d, repeat=4, max_count=3),
        5: product_limited(shape_1d, repeat=5, max_count=3),
    }
    chain = itertools.chain(*(gens[i] for i in sorted(gens) if i in nd))
    return [s for s in chain if math.prod(s) < threshold]


def contiguous_sequences(n: int):
    return [tuple(range(i, j)) for i in range(n) for j in range(i + 1, n + 1)]


def get_ragged_shape(shape, ragged_dims):
    """The shape with `ragged_dims` flattened into one axis."""
    r0, r1 = ragged_dims[0], ragged_dims[-1] + 1
    return [*shape[:r0], math.prod(shape[r0:r1]), *shape[r1:]]


def all_hyperrectangles(shape):
    for starts in itertools.product(*(range(n) for n in shape)):
        for ends in itertools.product(*(range(s, n + 1) for s, n in zip(starts, shape))):
            yield tuple(zip(starts, ends))


def _count_hyperrectangles(shape):
    return math.prod(n * (n + 1) // 2 + n for n in shape)


def unique_random_hyperrectangles(shape, k=20000, min_size=1):
    """veScale's generator: up to k distinct random rectangles, stopping after k/10 repeats."""
    rects = set()
    failed = 0
    while len(rects) < k:
        rect = []
        for s in shape:
            start = random.randint(0, s - min_size)
            end = random.randint(start, s)
            rect.append((start, end))
        rect = tuple(rect)
        before = len(rects)
        rects.add(rect)
        if before == len(rects):
            failed += 1
        if failed >= k * 0.1:
            break
    return list(rects)


def _break_ragged_box(box_shape, box_offset, ragged_dims, shape):
    """veScale's `_break_ragged_box` (global offset 0) on veragged's flat_range_boxes: the boxes
    (sizes_list, offsets_list), in the tensor's own dims, of a box of the ragged view."""
    r0, r1 = ragged_dims[0], ragged_dims[-1] + 1
    sub = list(shape[r0:r1])
    k = len(sub)
    begin = box_offset[r0]
    flat = torch.ops.veragged.flat_range_boxes(sub, begin, begin + box_shape[r0])
    sizes_list, offsets_list = [], []
    for b in range(0, len(flat), 2 * k):
        offs, sizes = list(flat[b : b + k]), list(flat[b + k : b + 2 * k])
        sizes_list.append((*box_shape[:r0], *sizes, *box_shape[r0 + 1 :]))
        offsets_list.append((*box_offset[:r0], *offs, *box_offset[r0 + 1 :]))
    return sizes_list, offsets_list


def _check_rect(shape, ragged_dims, rect):
    """veScale's per-rectangle check; returns the number of boxes, raises AssertionError."""
    tensor = torch.full(shape, -1, dtype=torch.int64)
    ragged_tensor = tensor.view(get_ragged_shape(shape, ragged_dims))
    rect_slice = tuple(slice(s, e) for s, e in rect)
    box_shape = tuple(e - s for s, e in rect)
    box_offset = tuple(s for s, _ in rect)
    sizes_list, offsets_list = _break_ragged_box(box_shape, box_offset, ragged_dims, shape)
    counter = 0
    for sizes, offsets in zip(sizes_list, offsets_list):  # veScale's fill_tensor
        rect_t = tensor[tuple(slice(o, o + s) for s, o in zip(sizes, offsets))]
        end = counter + rect_t.numel()
        rect_t.copy_(torch.arange(counter, end).view(rect_t.shape))
        counter = end
    t = ragged_tensor[rect_slice]
    detail = (f"shape={shape} ragged_dims={ragged_dims} rect={rect} "
              f"sizes_list={sizes_list} offsets_list={offsets_list}")
    # no overlap and an exact cover: the values are 0..numel-1, each once
    if not torch.equal(t.flatten().sort().values, torch.arange(t.numel())):
        raise AssertionError(f"not equal: {detail}")
    # nothing written outside the rectangle
    t.fill_(-1)
    if not torch.all(tensor == -1):
        raise AssertionError(f"not all -1: {detail}")
    return len(sizes_list)


def _run_nd(nd, rects_of):
    """One case per (shape, ragged_dims): every rectangle checked; the largest box count."""
    random.seed(9999)
    results, max_boxes, total = [], 0, 0
    for shape in produce_test_tensor_shape(nd=nd):
        for ragged_dims in contiguous_sequences(len(shape)):
            rects = rects_of(get_ragged_shape(shape, ragged_dims))
            total += len(rects)
            err = None
            for rect in rects:
                try:
                    max_boxes = max(max_boxes, _check_rect(shape, ragged_dims, rect))
                except Exception as exc:  # noqa: BLE001 - the first failing rectangle
                    err = error(exc)
                    break
            results.append((f"shape {shape} ragged_dims {ragged_dims} ({len(rects)} rects)",
                            err))
    return results, max_boxes, total


def _max_boxes_case(results, max_boxes, nd):
    want = 2 ** max(nd) - 1
    err = None if max_boxes == want else f"largest number of boxes {max_boxes}, veScale: {want}"
    return results + [(f"max number of boxes == 2**{max(nd)} - 1", err)]


def _exhaustive_or_sample(ragged_shape):
    if _count_hyperrectangles(ragged_shape) <= EXHAUSTIVE_MAX:
        return list(all_hyperrectangles(ragged_shape))
    return unique_random_hyperrectangles(ragged_shape, k=EXHAUSTIVE_SAMPLE)


# veScale: TestBreakRaggedBox.test_1d_case (brute force)
def test_1d_case():
    results, max_boxes, _ = _run_nd((1,), lambda s: list(all_hyperrectangles(s)))
    assert_cases("break ragged box 1-D", [_max_boxes_case(results, max_boxes, (1,))])


# veScale: TestBreakRaggedBox.test_2d_case (brute force; sampled above EXHAUSTIVE_MAX)
def test_2d_case():
    results, max_boxes, _ = _run_nd((2,), _exhaustive_or_sample)
    assert_cases("break ragged box 2-D", [_max_boxes_case(results, max_boxes, (2,))])


# veScale: TestBreakRaggedBox.test_3d_case (random; no box-count check, as veScale)
def test_3d_case():
    results, _, _ = _run_nd((3,), lambda s: unique_random_hyperrectangles(s, k=RANDOM_K[3]))
    assert_cases("break ragged box 3-D", [results])


# veScale: TestBreakRaggedBox.test_4d_case (random; no box-count check, as veScale)
def test_4d_case():
    results, _, _ = _run_nd((4,), lambda s: unique_random_hyperrectangles(s, k=RANDOM_K[4]))
    assert_cases("break ragged box 4-D", [results])
