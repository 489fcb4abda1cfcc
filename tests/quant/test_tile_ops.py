"""The tile ops (csrc/quant/tiles.cpp) against the one-process reference quantiser
(veragged/quant/reference.py), single process: every format, dtype and awkward shape."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from veragged.quant import Packing
from veragged.quant.reference import fake_quantize, quantize
from tests.quant.quant_cases import FORMATS, expected_packed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = [(300, 200), (3, 130, 70), (1000,), (128, 256), (1, 1), (129, 33), (7, 1, 40)]


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 4 * 3
    flat = x.view(-1)
    flat[: max(1, flat.numel() // 50)] = 0.0  # zero runs: whole zero tiles in small shapes
    if flat.numel() > 100:
        flat[-1] = 3.0e4  # beyond E4M3's range before scaling
        flat[-2] = 1.0e-30  # underflows to zero
    return x


class _OneTensor:
    """A stand-in for a one-tensor QuantDBuffer at world 1 (what expected_packed reads)."""

    def __init__(self, shape, fmt, dtype):
        n = torch.Size(shape).numel()
        self.entries = [SimpleNamespace(name="w", start=0, stop=n, shape=torch.Size(shape))]
        self._formats = [fmt]
        self.shard_size = n
        self.packing = Packing(self.entries, self._formats, n, 1, 0, dtype, 256)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src,param", [(torch.float32, torch.float32),
                                       (torch.float32, torch.bfloat16),
                                       (torch.bfloat16, torch.bfloat16),
                                       (torch.float16, torch.float16)])
def test_quantize_and_dequantize_equal_the_reference(fmt, shape, src, param):
    f = FORMATS[fmt]
    w = _values(shape, hash((fmt, shape)) % 1000).to(src)
    buf = _OneTensor(shape, f, param)
    p = buf.packing
    packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
    torch.ops.veragged.quantize_tiles_(packed, w.reshape(-1), p.quantize, p.quantize_tiles, param)
    assert torch.equal(packed, expected_packed(buf, {"w": w}, param))
    out = torch.empty(w.numel(), dtype=param)
    torch.ops.veragged.dequantize_tiles_(out, packed, p.dequantize, p.dequantize_tiles)
    assert torch.equal(out.view(shape), fake_quantize(w.to(param), f))


def test_rules_on_chosen_values():
    """Hand-checked values of [Note: block-scaled rules]."""
    w = torch.tensor([[448.0, -1.0, 0.5, 0.0]])
    data, scale = quantize(w, FORMATS["row128"])  # amax 448: scale_inv 1
    assert scale.tolist() == [[1.0]]
    assert data.view(torch.float8_e4m3fn).float().tolist() == [[448.0, -1.0, 0.5, 0.0]]
    _, e = quantize(torch.tensor([[3.0, 1.0]]), FORMATS["ue8m0"])
    assert e.tolist() == [[127 - 7]]  # 3/448 in (2^-8, 2^-7]: 2^-7
    _, e = quantize(torch.tensor([[3.0] + [0.0] * 31]), FORMATS["mx_floor"])
    assert e.tolist() == [[127 + 1 - 8]]  # floor(log2 3) = 1, minus 8
    _, e = quantize(torch.tensor([[0.0] * 32]), FORMATS["mx_floor"])
    assert e.tolist() == [[0]]
    _, s = quantize(torch.zeros(2, 2), FORMATS["block128"])  # amax clamped to 1e-12
    assert s.item() == (torch.tensor(1.0) / (torch.tensor(448.0) / 1e-12)).item()


def test_bad_tables_raise_naming_the_row():
    buf = _OneTensor((300, 200), FORMATS["block128"], torch.float32)
    p = buf.packing
    packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
    bad = p.quantize.clone()
    bad[0, 1] = 10**9
    with pytest.raises(ValueError, match="row 0 covers elements"):
        torch.ops.veragged.quantize_tiles_(packed, torch.zeros(60000), bad, p.quantize_tiles,
                                           torch.float32)
    with pytest.raises(ValueError, match="tiles, not"):
        torch.ops.veragged.quantize_tiles_(packed, torch.zeros(60000), p.quantize, 1,
                                           torch.float32)
    with pytest.raises(ValueError, match="param_dtype"):
        torch.ops.veragged.quantize_tiles_(packed, torch.zeros(60000), p.quantize,
                                           p.quantize_tiles, torch.float64)
    with pytest.raises(ValueError, match="not whole tile-rows"):
        torch.ops.veragged.quant_layout([0, 60000, 300, 200, 1, 128, 128, 0], 30000, 2, 256)


# The E4M3 conversion of the kernels (csrc/quant/cpu_rows_impl.h on the CPU) against torch's
# own: values quantised with a multiplier of exactly 1, so the data bytes are
# E4M3(clamp(x, -448, 448)) and torch's `.to(torch.float8_e4m3fn)` says what they must be.

def _scale_one_bytes(x: torch.Tensor, param: torch.dtype) -> torch.Tensor:
    """quantize_tiles_'s bytes for `x` (1-D, |x| < 512 after rounding to `param`) in MXFP8
    (FLOOR) tiles of 1x32 whose first element is 448: each tile's amax is in [256, 512), so its
    E8M0 scale is 2^0 and the multiplier exactly 1."""
    per = 31
    n = -(-x.numel() // per)
    tiles = torch.zeros(n, per, dtype=x.dtype)
    tiles.view(-1)[: x.numel()] = x
    w = torch.cat([torch.full((n, 1), 448.0, dtype=x.dtype), tiles], dim=1)
    buf = _OneTensor((n, 32), FORMATS["mx_floor"], param)
    p = buf.packing
    packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
    torch.ops.veragged.quantize_tiles_(packed, w.reshape(-1), p.quantize, p.quantize_tiles, param)
    _, _, rows, cols, _, _, d, s, _ = p.quantize[0].tolist()
    assert torch.equal(packed[s : s + n], torch.full((n,), 127, dtype=torch.uint8))  # 2^0
    data = packed[d : d + rows * cols].view(n, 32)
    assert torch.equal(data[:, 0], torch.full((n,), 0x7E, dtype=torch.uint8))  # 448
    return data[:, 1:].reshape(-1)[: x.numel()]


def _expected_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _fp32_boundary_values() -> torch.Tensor:
    """fp32 values at and around every E4M3 rounding boundary: each E4M3 value and each
    midpoint between neighbours (the ties) with the fp32 values 1-3 ulps either side, the
    subnormal steps k * 2^-9 and their midpoints, 2^-10 (the tie with zero), the smallest
    normal 2^-6, fp32 subnormals, 448 and the clamp region up to 512; both signs; plus 2^20
    random fp32 bit patterns below 512 in magnitude."""
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[:-1] + e4m3[1:]) / 2  # exact in fp32: E4M3 has 3 mantissa bits
    extra = torch.tensor([2.0**-10, 2.0**-6, 2.0**-9, 2.0**-126, 2.0**-149, 1e-45, 1e-40, 448.0,
                          452.0, 456.0, 464.0, 472.0, 480.0, 500.0, 511.0, 511.9999])
    centres = torch.cat([e4m3, mids, extra])
    bits = centres.view(torch.int32)
    around = torch.cat([bits + k for k in range(-3, 4)])
    g = torch.Generator().manual_seed(7)
    rand = torch.randint(0, 0x44000000, (1 << 20,), generator=g, dtype=torch.int32,
                         device="cpu").to(bits.device)  # < 512
    out = torch.cat([around, rand]).clamp(min=0).view(torch.float32)
    out = out[out < 512.0]
    return torch.cat([out, -out])


def _finite_16_bit(dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype (both zeros included)."""
    b = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    return b[torch.isfinite(b)]


def _check_e4m3_conversion():
    """The data bytes of every sweep equal torch's conversion (also run once per CPU ISA level
    by test_e4m3_conversion_on_every_isa)."""
    x = _fp32_boundary_values()
    assert torch.equal(_scale_one_bytes(x, torch.float32), _expected_bytes(x))
    # the same values rounded to bf16 and to fp16 first (param_dtype), read from fp32
    for param in (torch.bfloat16, torch.float16):
        r = x.to(param)
        r = r[r.float().abs() < 512]
        assert torch.equal(_scale_one_bytes(r.float(), param), _expected_bytes(r))
    for dtype in (torch.bfloat16, torch.float16):  # every 16-bit value below 512, as itself
        b = _finite_16_bit(dtype)
        b = b[b.float().abs() < 512]
        assert torch.equal(_scale_one_bytes(b, dtype), _expected_bytes(b))


def test_e4m3_conversion_at_every_rounding_boundary():
    _check_e4m3_conversion()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bits,src,param", [(torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32, torch.bfloat16),
                                            (torch.float16, torch.float16, torch.float16),
                                            (torch.float16, torch.float32, torch.float16)])
def test_every_finite_16_bit_value_equals_the_reference(fmt, bits, src, param):
    """All finite bf16 (65280) or fp16 (63488) values, shuffled into 256 x 256 (so tiles mix
    magnitudes: bf16 from 2^-133 to 3e38), quantised and dequantised as the reference does."""
    b = _finite_16_bit(bits)
    g = torch.Generator().manual_seed(3)
    w = torch.zeros(256 * 256, dtype=bits)
    w[: b.numel()] = b[torch.randperm(b.numel(), generator=g, device="cpu").to(b.device)]
    w = w.view(256, 256).to(src)
    buf = _OneTensor((256, 256), FORMATS[fmt], param)
    p = buf.packing
    packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
    torch.ops.veragged.quantize_tiles_(packed, w.reshape(-1), p.quantize, p.quantize_tiles, param)
    assert torch.equal(packed, expected_packed(buf, {"w": w}, param))
    out = torch.empty(w.numel(), dtype=param)
    torch.ops.veragged.dequantize_tiles_(out, packed, p.dequantize, p.dequantize_tiles)
    assert torch.equal(out.view(256, 256), fake_quantize(w.to(param), FORMATS[fmt]))


@pytest.mark.parametrize("param", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_every_byte(param):
    """Every E4M3 byte times a few scales (fp32 scale_inv, 128x128 tiles): fp32(q) * scale_inv
    rounded to the param dtype, NaN bytes to NaN."""
    scales = torch.tensor([1.0, 2.0**-20, 3.7e-3, 1.0 / 3.0, 2.0**60, 7.1e-39])
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(64)  # 128 x 128 a tile
    n = scales.numel()
    buf = _OneTensor((128, 128 * n), FORMATS["block128"], param)
    p = buf.packing
    _, _, _, _, _, _, d, s, _ = p.dequantize[0].tolist()
    packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
    data = q.view(128, 128).repeat(1, n)
    packed[d : d + data.numel()] = data.reshape(-1)
    packed[s : s + 4 * n] = scales.view(torch.uint8)
    out = torch.empty(data.numel(), dtype=param)
    torch.ops.veragged.dequantize_tiles_(out, packed, p.dequantize, p.dequantize_tiles)
    expect = (data.view(torch.float8_e4m3fn).float()
              * scales.repeat_interleave(128)[None, :]).to(param)
    out = out.view(128, -1)
    nan = expect.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], expect[~nan])
    if out.device.type == "cpu":
        # The CPU kernels' NaNs are c10's scalar conversions' (torch's vectorised .to() makes
        # other NaN bits): E4M3's NaN 0x7FF00000 (sign kept) times a finite scale, then bf16's
        # 0x7FC0 or fp16's 0x7E00 with the sign.
        neg = (data.view(128, -1) & 0x80) != 0
        if param == torch.float32:
            bits, want = out.view(torch.int32), torch.where(neg, -0x00100000, 0x7FF00000)
        elif param == torch.bfloat16:
            bits, want = out.view(torch.int16), torch.full_like(neg, 0x7FC0, dtype=torch.int32)
        else:
            bits, want = out.view(torch.int16), torch.where(neg, -0x0200, 0x7E00)
        assert torch.equal(bits[nan].int(), want[nan].int())


def test_nan_and_inf_tiles():
    """[Note: block-scaled rules]: a NaN makes its tile's amax and scale NaN, so every byte of
    the tile is a NaN byte; an inf makes the fp32 multiplier 0 (inf * 0: NaN bytes at the infs,
    zeros elsewhere)."""
    w = torch.linspace(-3, 3, 256 * 2).view(2, 256)
    w[0, 5] = float("nan")
    w[1, 200] = float("inf")
    buf = _OneTensor((2, 256), FORMATS["row128"], torch.float32)
    p = buf.packing
    packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
    torch.ops.veragged.quantize_tiles_(packed, w.reshape(-1), p.quantize, p.quantize_tiles,
                                       torch.float32)
    _, _, _, _, _, _, d, s, _ = p.quantize[0].tolist()
    data = packed[d : d + 512].view(2, 256)
    assert torch.equal(data[0, :128] & 0x7F, torch.full((128,), 0x7F, dtype=torch.uint8))
    assert (data[0, 128:] & 0x7F != 0x7F).all()
    assert data[1, 200] & 0x7F == 0x7F
    assert torch.equal(data[1, 128:200] & 0x7F, torch.zeros(72, dtype=torch.uint8))
    assert packed[s : s + 16].view(torch.float32)[0].isnan()


@pytest.mark.cpu_only("the CPU kernels' thread split")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bytes_do_not_depend_on_the_thread_count(fmt):
    w = _values((3, 700, 300), 11)
    buf = _OneTensor((3, 700, 300), FORMATS[fmt], torch.bfloat16)
    p = buf.packing
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            packed = torch.zeros(p.slot_bytes, dtype=torch.uint8)
            torch.ops.veragged.quantize_tiles_(packed, w.reshape(-1), p.quantize,
                                               p.quantize_tiles, torch.bfloat16)
            out = torch.empty(w.numel(), dtype=torch.bfloat16)
            torch.ops.veragged.dequantize_tiles_(out, packed, p.dequantize, p.dequantize_tiles)
            results.append((packed, out))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], expected_packed(buf, {"w": w}, torch.bfloat16))
    for packed, out in results[1:]:
        assert torch.equal(packed, results[0][0]) and torch.equal(out, results[0][1])


@pytest.mark.cpu_only("VERAGGED_CPU_ISA picks the CPU kernels' vector ISA (csrc/quant/cpu_rows.h)")
@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_e4m3_conversion_on_every_isa(isa):
    """The CPU kernels are built once per x86 ISA level; a process runs the level its CPU has,
    so each level's sweep runs in a process of its own."""
    env = dict(os.environ, VERAGGED_CPU_ISA=isa,
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    code = ("import tests.quant.test_tile_ops as t; import veragged; "
            "t._check_e4m3_conversion(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    if "this CPU lacks it" in r.stderr or "not an x86-64 build" in r.stderr:
        pytest.skip(f"{isa}: not on this CPU")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
