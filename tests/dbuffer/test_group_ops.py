"""DBuffer group ops (CPU kernels here; CUDA on the GPU machine): results, fake kernels, errors."""

import pytest
import torch

from veragged.dbuffer import ops

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _randn(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize("dst_dtype", FLOATS)
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 1000, 70_001])
def test_cast_scale_and_accumulate_match_torch_bit_for_bit(dst_dtype, src_dtype, n):
    src = _randn(n, src_dtype, 1)
    acc = torch.float64 if dst_dtype == torch.float64 else torch.float32
    out = torch.empty(n, dtype=dst_dtype)
    ops.cast_scale_(out, src, 0.37)
    want = (src.to(acc) * torch.tensor(0.37, dtype=acc)).to(dst_dtype)
    assert torch.equal(out, want)
    dst = _randn(n, dst_dtype, 2)
    expected = (dst.to(acc) + src.to(dst_dtype).to(acc) * torch.tensor(-1.5, dtype=acc)).to(
        dst_dtype
    )
    ops.accumulate_(dst, src, -1.5)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", FLOATS)
def test_scale_and_zero_ranges(dtype):
    x = _randn(5000, dtype, 3)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    want = (x.to(acc) * torch.tensor(0.125, dtype=acc)).to(dtype)
    ops.scale_(x, 0.125)
    assert torch.equal(x, want)
    ranges = [(0, 3), (10, 10), (100, 4000), (4999, 5000)] + [
        (4100 + 2 * i, 4101 + 2 * i) for i in range(80)
    ]
    want = x.clone()
    for b, e in ranges:
        want[b:e] = 0
    ops.zero_ranges_(x, ranges)
    assert torch.equal(x, want)


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="dst has 3 elements but src has 4"):
        ops.cast_scale_(torch.empty(3), torch.empty(4))
    with pytest.raises(ValueError, match="must be contiguous"):
        ops.accumulate_(torch.empty(4, 2).t(), torch.empty(8))
    with pytest.raises(ValueError, match=r"range 1 = \[5, 12\) is not inside \[0, 10\)"):
        ops.zero_ranges_(torch.empty(10), [(0, 1), (5, 12)])
    with pytest.raises(ValueError, match="floating"):
        ops.scale_(torch.zeros(4, dtype=torch.int32), 2.0)


def test_fake_kernels_pass_opcheck():
    dst, src = torch.randn(64), torch.randn(64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.veragged.cast_scale_.default, (dst, src, 0.5))
    torch.library.opcheck(torch.ops.veragged.accumulate_.default, (dst, src, 2.0))
    torch.library.opcheck(torch.ops.veragged.scale_.default, (dst, 3.0))
    torch.library.opcheck(torch.ops.veragged.zero_ranges_.default, (dst, [1, 5, 9, 20]))
