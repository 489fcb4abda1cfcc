"""DBuffer group ops (CPU kernels here; CUDA on the GPU machine): results, fake kernels, errors."""

import math

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
def test_zero_ranges(dtype):
    x = _randn(5000, dtype, 3)
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


def test_fake_kernels_pass_opcheck():
    dst, src = torch.randn(64), torch.randn(64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.veragged.cast_scale_.default, (dst, src, 0.5))
    torch.library.opcheck(torch.ops.veragged.accumulate_.default, (dst, src, 2.0))
    torch.library.opcheck(torch.ops.veragged.zero_ranges_.default, (dst, [1, 5, 9, 20]))


# --- dtypes beyond the fused kernels ("Dtypes" in [Note: DBuffer group ops]) -------------------

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
COMPLEX = [torch.complex64, torch.complex128]
# Every dtype a parameter can have: copied bitwise by cast_scale_(same dtype, alpha=1).
ALL = FLOATS + FLOAT8 + COMPLEX + [
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
    torch.complex32, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
]


def _bytes(n, dtype, seed):
    """n elements of `dtype` with random bits (bool: 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    item = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g).view(dtype)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_cast_scale_copies_every_dtype_bitwise(dtype):
    src, dst = _bytes(1000, dtype, 1), _bytes(1000, dtype, 2)
    ops.cast_scale_(dst, src, 1.0)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("f8", FLOAT8, ids=str)
@pytest.mark.parametrize("other", FLOATS, ids=str)
def test_float8_takes_the_kernels_math(f8, other):
    """float8 to/from the fused dtypes: the same math as the kernels (cast, multiply in acc_t)."""
    for dst_dtype, src_dtype in ((other, f8), (f8, other)):
        src = _randn(999, src_dtype, 3)
        acc = _acc(dst_dtype)
        out = torch.empty(999, dtype=dst_dtype)
        ops.cast_scale_(out, src, 1.0)
        assert torch.equal(out.float(), src.to(dst_dtype).float())
        ops.cast_scale_(out, src, 0.37)
        want = (src.to(acc) * torch.tensor(0.37, dtype=acc)).to(dst_dtype)
        assert torch.equal(out.float(), want.float())
        dst = _randn(999, dst_dtype, 4)
        want = (dst.to(acc) + src.to(dst_dtype).to(acc) * torch.tensor(-1.5, dtype=acc)).to(dst_dtype)
        ops.accumulate_(dst, src, -1.5)
        assert torch.equal(dst.float(), want.float())


@pytest.mark.parametrize("dst_dtype", COMPLEX + [torch.complex32], ids=str)
@pytest.mark.parametrize("src_dtype", COMPLEX + [torch.complex32], ids=str)
def test_complex_runs_componentwise(dst_dtype, src_dtype):
    """Complex tensors scale and add their (re, im) components like real ones (no complex
    multiply, so inf * alpha stays inf)."""
    def real(t):
        return torch.view_as_real(t).reshape(-1)

    real_dst = torch.view_as_real(torch.empty(0, dtype=dst_dtype)).dtype
    src = torch.view_as_complex(_randn(2000, torch.view_as_real(
        torch.empty(0, dtype=src_dtype)).dtype, 6).view(1000, 2))
    src[0] = complex(math.inf, 1.0)
    acc = _acc(real_dst)
    out = torch.empty(1000, dtype=dst_dtype)
    ops.cast_scale_(out, src, 0.5)
    assert torch.equal(real(out), (real(src).to(acc) * torch.tensor(0.5, dtype=acc)).to(real_dst))
    dst = torch.view_as_complex(_randn(2000, real_dst, 7).view(1000, 2))
    want = (real(dst).to(acc) + real(src).to(real_dst).to(acc) * torch.tensor(3.0, dtype=acc))
    ops.accumulate_(dst, src, 3.0)
    assert torch.equal(real(dst), want.to(real_dst))


BAD = [  # (op, args, message): the CPU kernels and the fake kernels raise the same ValueError
    ("cast_scale_", (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 0.5),
     "cannot cast"),
    ("cast_scale_", (torch.zeros(4), torch.zeros(4, dtype=torch.int64), 1.0), "cannot cast"),
    ("cast_scale_", (torch.zeros(4), torch.zeros(4, dtype=torch.complex64), 1.0), "cannot cast"),
    ("accumulate_", (torch.zeros(4, dtype=torch.int16), torch.zeros(4, dtype=torch.int16), 1.0),
     "floating or both complex"),
    ("accumulate_", (torch.zeros(4, dtype=torch.complex64), torch.zeros(4), 1.0),
     "floating or both complex"),
]


@pytest.mark.parametrize("op, args, message", BAD, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD)])
def test_unsupported_dtypes_raise_in_the_kernels_and_the_fake_kernels(op, args, message):
    fn = getattr(torch.ops.veragged, op)
    with pytest.raises(ValueError, match=message):
        fn(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(ValueError, match=message):
            fn(*fake)


def test_fake_kernels_pass_opcheck_for_other_dtypes():
    ints = torch.arange(64, dtype=torch.int16)
    torch.library.opcheck(torch.ops.veragged.cast_scale_.default, (ints.clone(), ints, 1.0))
    # (float8 is left out: opcheck compares float8 tensors with allclose, which has no kernel.)
    z = torch.randn(64, dtype=torch.complex64)
    torch.library.opcheck(torch.ops.veragged.accumulate_.default, (z.clone(), z, 2.0))


def _land_reference(dst, srcs, pieces, alpha):
    """torch's ops, piece by piece: what the landing did before land_ ([Note: gradient
    landing]): `torch.add(+0.0, g, alpha=, out=view)` first, `view.add_(g, alpha=)` after."""
    zero = torch.zeros((), dtype=dst.dtype)
    for k in range(0, len(pieces), 5):
        i, s, d, n, add = pieces[k : k + 5]
        view, g = dst[d : d + n], srcs[i][s : s + n]
        if add:
            view.add_(g, alpha=alpha)
        else:
            torch.add(zero, g, alpha=alpha, out=view)


def _land_case(dst_dtype, src_dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 7, 1000, 40_003, 3]
    srcs = [torch.randn(n, generator=g).to(src_dtypes[j % len(src_dtypes)])
            for j, n in enumerate(sizes)]
    srcs[0].fill_(-0.0)  # +0.0 + (-0.0) is +0.0: a landed zero is never -0.0
    # pieces at odd offsets, one source split in two, some adding to what is there
    pieces = [0, 0, 5, 1, 0,  1, 0, 11, 7, 1,  2, 0, 20, 1000, 0,  3, 0, 1100, 20_000, 0,
              3, 20_000, 30_001, 20_003, 1,  4, 1, 60_010, 2, 0]
    dst = torch.randn(60_100, generator=g).to(dst_dtype)
    return dst, srcs, pieces


@pytest.mark.parametrize("dst_dtype", FLOATS)
@pytest.mark.parametrize("src_dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float64,),
                                        (torch.float16, torch.float32)])
@pytest.mark.parametrize("alpha", [1.0, 0.25])
def test_land_matches_torchs_adds_bit_for_bit(dst_dtype, src_dtypes, alpha):
    dst, srcs, pieces = _land_case(dst_dtype, src_dtypes)
    want = dst.clone()
    _land_reference(want, srcs, pieces, alpha)
    ops.land_(dst, srcs, pieces, alpha)
    assert torch.equal(dst, want)
    assert not torch.signbit(dst[5]) and dst[5] == 0  # the landed -0.0


def test_land_bad_input_raises_value_error():
    dst, src = torch.zeros(10), torch.zeros(4)
    with pytest.raises(ValueError, match=r"pieces must hold .* got 4 values"):
        ops.land_(dst, [src], [0, 0, 0, 4])
    with pytest.raises(ValueError, match=r"piece 0 names srcs\[1\] of 1"):
        ops.land_(dst, [src], [1, 0, 0, 4, 0])
    with pytest.raises(ValueError, match=r"piece 1 = \(src 0, at 2, dst at 0, 4 elements\) is "
                                         r"outside srcs\[0\] \(4 elements\) or dst \(10\)"):
        ops.land_(dst, [src], [0, 0, 0, 4, 0, 0, 2, 0, 4, 0])
    with pytest.raises(ValueError, match=r"srcs\[0\] must be contiguous"):
        ops.land_(dst, [torch.zeros(4, 2).t()], [0, 0, 0, 4, 0])
    with pytest.raises(ValueError, match="must be float, double, half or bfloat16"):
        ops.land_(dst, [torch.zeros(4, dtype=torch.int32)], [0, 0, 0, 4, 0])
    torch.library.opcheck(torch.ops.veragged.land_.default,
                          (torch.zeros(10), [torch.randn(4)], [0, 0, 3, 4, 0], 0.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU check)")
@pytest.mark.parametrize("dst_dtype", FLOATS)
def test_land_cuda_equals_its_cpu_twin(dst_dtype):
    dst, srcs, pieces = _land_case(dst_dtype, (torch.bfloat16, torch.float32), seed=3)
    cuda = dst.cuda()
    ops.land_(cuda, [s.cuda() for s in srcs], pieces, 0.5)
    ops.land_(dst, srcs, pieces, 0.5)
    assert torch.equal(cuda.cpu(), dst)
