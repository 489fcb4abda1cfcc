"""Block-scaled weights on CUDA ([Note: block-scaled weights], [Note: FP8 compute]): the tile
kernels (csrc/quant/cuda/tiles.cu) against their CPU twins bit for bit, and compute="fp8"'s
`F.scaled_mm` path against its dequantise-then-matmul reference. Needs a CUDA device:
`scripts/gpu_check.sh` runs it there; here it is skipped."""

from __future__ import annotations

import pytest
import torch

from tests.quant.quant_cases import FORMATS
from tests.quant.test_tile_ops import SHAPES, _OneTensor, _values
from veragged.quant.linear import block_scaled_linear, gemm_supported
from veragged.quant.reference import dequantize, fake_quantize, quantize, scale_inv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_check.sh)")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("param", [torch.float32, torch.bfloat16, torch.float16])
def test_tile_kernels_equal_their_cpu_twins(fmt, shape, param):
    f = FORMATS[fmt]
    w = _values(shape, hash((fmt, shape)) % 1000).to(param)
    p = _OneTensor(shape, f, param).packing
    packed = {}
    for dev in ("cpu", "cuda"):
        out = torch.zeros(p.slot_bytes, dtype=torch.uint8, device=dev)
        torch.ops.veragged.quantize_tiles_(out, w.reshape(-1).to(dev), p.quantize.to(dev),
                                           p.quantize_tiles, param)
        packed[dev] = out
    assert torch.equal(packed["cuda"].cpu(), packed["cpu"])
    back = torch.empty(w.numel(), dtype=param, device="cuda")
    torch.ops.veragged.dequantize_tiles_(back, packed["cuda"], p.dequantize.cuda(),
                                         p.dequantize_tiles)
    torch.cuda.synchronize()
    assert torch.equal(back.cpu().view(shape), fake_quantize(w, f))


def _operands(w, fmt):
    data, s = quantize(w, fmt)
    inv = scale_inv(s, fmt)
    scales = torch.zeros(inv.shape[0], -(-inv.shape[1] // 4) * 4, device=w.device)
    scales[:, : inv.shape[1]] = inv
    return data.view(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("M,N,K", [(256, 512, 1024), (77, 384, 640), (8, 4096, 512)])
@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_scaled_mm_path_matches_the_dequantised_reference(M, N, K, scale):
    """K/128 = 8, 5 (padded to 8) and 4 K blocks; M not a multiple of 4 (padded)."""
    import veragged

    fmt = veragged.BlockFP8(scale=scale, compute="fp8")
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * 0.05).to("cuda", torch.bfloat16)
    if not gemm_supported(x, w.shape, fmt):
        pytest.skip(f"no blockwise FP8 GEMM here ({torch.cuda.get_device_name()}, "
                    f"CUDA {torch.version.cuda}): the reference path runs instead")
    ops = _operands(w, fmt)
    w_dq = dequantize(*quantize(w, fmt), fmt, torch.bfloat16)
    got = block_scaled_linear(x, w_dq, None, fmt, lambda: ops)
    act = fmt.activation_format()
    x_dq = dequantize(*quantize(x, act), act, torch.float32)
    want = (x_dq @ w_dq.float().t()).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
