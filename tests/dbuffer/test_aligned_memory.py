"""`veragged::aligned_empty` ([Note: aligned buffers]): a DBuffer's flat allocations start on 256
bytes and take exactly their bytes; the storage frees and regrows in place like any other; under
FakeTensorMode it is a fake tensor of the same size."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from veragged.dbuffer.ops import ALIGN_BYTES, aligned_empty
from veragged.runtime.streams import alloc_storage, free_storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
@pytest.mark.parametrize("numel", [1, 3, 64, 1000, 100_003])
def test_host_buffers_aligned_and_exact(dtype, numel):
    bufs = [aligned_empty(numel, dtype, "cpu") for _ in range(8)]  # not aligned by luck
    for t in bufs:
        assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN_BYTES == 0
        assert t.untyped_storage().nbytes() == numel * t.element_size()
        assert t.storage_offset() == 0


def test_storage_frees_and_regrows_in_place():
    t = aligned_empty(1000, torch.float32, "cpu")
    t.fill_(3.0)
    free_storage(t)
    assert t.untyped_storage().nbytes() == 0
    alloc_storage(t)
    assert t.untyped_storage().nbytes() == 4000 and t.data_ptr() % ALIGN_BYTES == 0
    t.fill_(2.0)
    assert float(t.sum()) == 2000.0
    # copies, clones and views behave as any tensor's
    assert torch.equal(t.clone(), t) and torch.equal(t[10:20].contiguous(), t[10:20])


def test_empty_meta_and_fake():
    e = aligned_empty(0, torch.float32, "cpu")
    assert e.shape == (0,) and e.untyped_storage().nbytes() == 0
    m = aligned_empty(7, torch.bfloat16, "meta")
    assert m.is_meta and m.shape == (7,)
    with FakeTensorMode():
        f = aligned_empty(1 << 40, torch.float32, "cpu")  # nothing is allocated
        assert is_fake(f) and f.shape == (1 << 40,)
        assert f.untyped_storage().nbytes() == 4 << 40


def test_bad_numel_names_it():
    with pytest.raises(ValueError, match="numel must be >= 0, got -1"):
        aligned_empty(-1, torch.float32, "cpu")
    with FakeTensorMode(), pytest.raises(ValueError, match="numel must be >= 0, got -5"):
        aligned_empty(-5, torch.float32, "cpu")
