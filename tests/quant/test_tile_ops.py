"""The tile ops (csrc/quant/tiles.cpp) against the one-process reference quantiser
(veragged/quant/reference.py), single process: every format, dtype and awkward shape."""

import pytest
import torch
from types import SimpleNamespace

from veragged.quant import Packing
from veragged.quant.reference import fake_quantize, quantize
from tests.quant.quant_cases import FORMATS, expected_packed

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
