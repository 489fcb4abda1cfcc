"""RaggedShard / StridedRaggedShard placement objects: validation, equality, hashing, pickling."""

import pickle
import time

import pytest
import torch
from torch.distributed.tensor.placement_types import Placement, Replicate

from veragged import RaggedShard, StridedRaggedShard


def test_is_a_torch_placement_with_value_semantics():
    a = RaggedShard((0,), [1, 2, 0, 1])
    b = RaggedShard([0], (1, 2, 0, 1))
    assert isinstance(a, Placement)
    assert a == b and hash(a) == hash(b)
    assert a != RaggedShard((0,), (1, 2, 1, 0))
    assert a != RaggedShard((0, 1), (1, 2, 0, 1))
    assert a != Replicate() and Replicate() != a
    assert not a.is_shard() and not a.is_replicate() and not a.is_partial()
    assert a.local_units == (1, 2, 0, 1) and a.dims == (0,)
    assert {a: 1}[b] == 1
    with pytest.raises(AttributeError):
        a.dims = (0, 1)


def test_strided_is_distinct_and_carries_split_factor():
    s = StridedRaggedShard((0,), (1, 1), split_factor=2)
    assert s != RaggedShard((0,), (1, 1))
    assert s == StridedRaggedShard((0,), (1, 1), 2)
    assert s != StridedRaggedShard((0,), (1, 1), 4)
    assert isinstance(s, RaggedShard) and s.split_factor == 2
    assert "split_factor=2" in repr(s)


@pytest.mark.parametrize(
    "p",
    [
        RaggedShard((), (0, 1, 0)),
        RaggedShard((0, 1), (3, 0, 2)),
        StridedRaggedShard((0,), (1, 2), 3),
    ],
)
def test_pickles(p):
    q = pickle.loads(pickle.dumps(p))
    assert q == p and type(q) is type(p) and hash(q) == hash(p)


def test_equality_and_hash_do_not_scan_units_at_10k_ranks():
    units = [i % 7 for i in range(10_000)]
    a, b = RaggedShard((0,), units), RaggedShard((0,), list(units))
    assert a._units is b._units  # interned: equality compares one object, not 10,000 entries
    start = time.perf_counter()
    for _ in range(10_000):
        assert a == b
        hash(a)
    # Not a timing assertion on the machine: an O(P) compare would take ~10,000x longer than this
    # bound allows, while the O(1) compare needs ~10 ms.
    assert time.perf_counter() - start < 2.0
    assert "10000 entries" in repr(a)


def test_row_ranges_and_local_numel_and_offset():
    p = RaggedShard((0,), (1, 0, 2, 3))
    assert [p.row_range(12, r) for r in range(4)] == [(0, 2), (2, 2), (2, 6), (6, 12)]
    assert p.local_numel_and_offset((12, 5), 2) == (20, 10)
    root = RaggedShard((), (0, 0, 1))
    assert root.local_numel_and_offset((7, 13), 2) == (91, 0)
    assert root.local_numel_and_offset((7, 13), 0) == (0, 0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: RaggedShard((1,), (1, 1)), r"dims must be a prefix \(0, \.\.\., k-1\).*\(1,\)"),
        (lambda: RaggedShard((0, 2), (1, 1)), r"got \(0, 2\)"),
        (lambda: RaggedShard((0,), (1, -2)), r"local_units\[1\] must be >= 0, got -2"),
        (lambda: RaggedShard((0,), ()), "one entry per rank"),
        (lambda: RaggedShard((0,), (0, 0)), "must not all be zero"),
        (lambda: StridedRaggedShard((0,), (1,), 0), "split_factor must be an int >= 1, got 0"),
        (
            lambda: RaggedShard((0,), (1, 2)).local_numel_and_offset((7, 3), 0),
            r"sum\(local_units\) = 3 does not divide the 7 rows",
        ),
        (
            lambda: RaggedShard((0,), (1, 2)).local_numel_and_offset((6, 3), 2),
            r"rank must be in \[0, 2\), got 2",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_non_int_units_raise_type_error():
    with pytest.raises(TypeError, match=r"local_units\[0\] must be an integer, got 1.5"):
        RaggedShard((0,), (1.5, 1))
    with pytest.raises(TypeError, match=r"local_units\[1\] must be an integer, got True"):
        RaggedShard((0,), (1, True))
    with pytest.raises(TypeError, match=r"local_units\[0\] must be an integer, got tensor\(1.5"):
        RaggedShard((0,), (torch.tensor(1.5), 1))
    with pytest.raises(TypeError, match=r"split_factor must be an integer, got 2.0"):
        StridedRaggedShard((0,), (1, 1), 2.0)


def test_any_integral_units_are_stored_as_python_ints():
    """veScale's tests pass `np.random.multinomial` output; 0-dim integer tensors work too."""
    import numpy as np

    drawn = np.random.default_rng(0).multinomial(12, [0.25] * 4)
    for units in (drawn, tuple(drawn), torch.tensor(drawn.tolist()),
                  [torch.tensor(int(u), dtype=torch.int32) for u in drawn]):
        p = RaggedShard(np.arange(1), units)
        assert p == RaggedShard((0,), tuple(int(u) for u in drawn))
        assert all(type(u) is int for u in p.local_units) and type(p.dims[0]) is int
    s = StridedRaggedShard((0,), drawn, np.int64(2))
    assert type(s.split_factor) is int and s.split_factor == 2
