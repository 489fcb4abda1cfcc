"""Every CUDA kernel against its CPU twin, bit for bit: the DBuffer group ops ([Note: DBuffer
group ops]) and the 8-bit AdamW step ([Note: AdamW8bit kernel]) on random values, odd sizes and
unaligned offsets (views starting at odd elements). Needs a CUDA device: `scripts/gpu_check.sh`
runs it there (also under compute-sanitizer); here it is skipped."""

from __future__ import annotations

import pytest
import torch

from veragged.dbuffer import ops
from veragged.optim.kernels import adamw8bit_multi_step_, dynamic_map

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_check.sh)")

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SIZES = [1, 31, 4097, 70_001]


def _rand(n, dtype, seed, offset=0):
    """n values of `dtype`, as a view starting `offset` elements into a larger buffer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n + offset, generator=g).to(dtype)[offset:]


def _on_cuda(t: torch.Tensor) -> torch.Tensor:
    """A CUDA copy of `t` starting as many elements into its allocation as `t` does."""
    k = t.storage_offset()
    out = torch.empty(k + t.numel(), dtype=t.dtype, device="cuda")[k:].view(t.shape)
    return out.copy_(t)


def _twins(fn, *tensors):
    """fn on CPU tensors and on CUDA copies; returns (cpu results, cuda results)."""
    cpu = [t.clone() for t in tensors]
    cuda = [_on_cuda(t) for t in tensors]
    fn(*cpu)
    fn(*cuda)
    torch.cuda.synchronize()
    return cpu, [t.cpu() for t in cuda]


@pytest.mark.parametrize("dst_dtype", FLOATS)
@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("n", SIZES)
def test_cast_scale_and_accumulate(dst_dtype, src_dtype, n):
    for offset in (0, 3):
        dst, src = _rand(n, dst_dtype, 1, offset), _rand(n, src_dtype, 2, offset)
        for op in (ops.cast_scale_, ops.accumulate_):
            cpu, cuda = _twins(lambda d, s: op(d, s, 0.37), dst, src)
            assert torch.equal(cpu[0], cuda[0]), (op.__name__, offset)


@pytest.mark.parametrize("dtype", FLOATS)
def test_zero_ranges(dtype):
    x = _rand(70_001, dtype, 3, 5)
    ranges = [(0, 3), (7, 7), (11, 40_000)] + [(40_001 + 3 * i, 40_002 + 3 * i)
                                               for i in range(100)]
    cpu, cuda = _twins(lambda t: ops.zero_ranges_(t, ranges), x)
    assert torch.equal(cpu[0], cuda[0])


@pytest.mark.parametrize("dst_dtype", FLOATS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_land(dst_dtype, src_dtype):
    g = torch.Generator().manual_seed(4)
    sizes = [1, 17, 70_001, 5]
    srcs = [torch.randn(n + 1, generator=g).to(src_dtype)[1:] for n in sizes]  # unaligned
    pieces = [0, 0, 3, 1, 0, 1, 2, 9, 15, 1, 2, 0, 40, 40_000, 0, 2, 40_000, 50_001, 30_001, 1,
              3, 0, 80_010, 5, 0]
    dst = torch.randn(80_020, generator=g).to(dst_dtype)
    cpu_dst = dst.clone()
    ops.land_(cpu_dst, srcs, pieces, 0.5)
    cuda_dst = dst.cuda()
    ops.land_(cuda_dst, [_on_cuda(s) for s in srcs], pieces, 0.5)
    assert torch.equal(cpu_dst, cuda_dst.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 255, 256, 4097])
def test_adamw8bit_step(dtype, n):
    bs = 256
    blocks = -(-n // bs)
    g = torch.Generator().manual_seed(5)
    state = [
        torch.randn(n, generator=g).to(dtype),                       # param
        torch.randn(n, generator=g).to(dtype),                       # grad
        torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8),  # m codes
        torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8),  # v codes
        torch.rand(blocks, generator=g),                              # m absmax
        torch.rand(blocks, generator=g),                              # v absmax
    ]

    def step(p, gr, mc, vc, ma, va):
        q = (dynamic_map(True).to(p.device), dynamic_map(False).to(p.device))
        adamw8bit_multi_step_([p], [gr], [mc], [vc], [ma], [va], *q, lr=1e-2, beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=0.01, steps=[3], block_size=bs)

    cpu, cuda = _twins(step, *state)
    for a, b in zip(cpu, cuda):
        assert torch.equal(a, b)


def test_adamw8bit_multi_step():
    bs, g = 256, torch.Generator().manual_seed(6)
    sizes = [256, 1000, 4096]
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) for n in sizes]
    mcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    vcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    mas = [torch.rand(-(-n // bs), generator=g) for n in sizes]
    vas = [torch.rand(-(-n // bs), generator=g) for n in sizes]

    def run(device):
        ts = [[t.to(device) for t in group] for group in (params, grads, mcs, vcs, mas, vas)]
        q = (dynamic_map(True).to(device), dynamic_map(False).to(device))
        adamw8bit_multi_step_(*ts, *q, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01, steps=[1, 2, 7], block_size=bs)
        return [t.cpu() for group in ts for t in group]

    for a, b in zip(run("cpu"), run("cuda")):
        assert torch.equal(a, b)
