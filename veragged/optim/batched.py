"""Same-shape products of an owner's matrices as one batched launch, where that changes no bit.

[Note: batched owner products]
An owner often holds many matrices of one shape (the experts of a stack, the layers of a
model), and Muon, Shampoo and SOAP run the same products on each: Newton-Schulz's iterations,
Shampoo's G G^T, G^T G and L^-1/4 M R^-1/4, SOAP's Q_L^T G Q_R and Q_L N Q_R^T. Run one by one
that is a launch per product and matrix; batched (bmm over a stack) a launch per product. A
batch is only used where it changes no bit of any result: BLAS libraries pick their kernels,
and with them the summation order, by shape, transposition, batch count and alignment (on this
CPU, MKL under torch 2.15, a batched 7 x 5 product differs from the unbatched one in the last
bits while 33 x 17 and larger agree). So every kind of batch is probed once per process on
random matrices, batched and one by one, and used only if every result is bitwise the same;
the kind is the chain's signature (each operand's shape, whether it is the transpose of a
contiguous matrix, and which operands are the same matrix, as in G G^T), the batch count, the
dtype, the device and the intra-op thread count. What the probe compares must be what runs:
- an operand is a matrix of its own or the transpose of one (a strided tile is copied out
  first) and starts at a 64-byte aligned address, as a fresh CPU allocation does and a CUDA
  one exceeds; anything else is computed one by one;
- batched operands are stacked into one buffer, each at a 256-byte aligned offset ([Note:
  aligned owner inputs]), and batched results are written the same way, so what follows a
  product (norms, elementwise updates, the next product) sees matrices where a fresh tensor
  would start.
The verdicts are kept per process (`verdicts()`, for tests and benchmarks to say where
batching happens and where it does not); `one_by_one()` turns batching off in a block (the
results are the same bits; what changes is the launch count and the time).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Sequence

import torch

from veragged.runtime import caches

__all__ = ["aligned_stack", "aligned_empty", "chains", "enabled", "one_by_one", "verdicts"]

STACK_ALIGN_BYTES = 256  # where each matrix of a stack starts ([Note: aligned owner inputs])
OPERAND_ALIGN_BYTES = 64  # the least alignment an operand needs to take part in a batch

_VERDICTS: dict = caches.register("optim.batched probe verdicts", {})
_OFF = [0]  # nesting depth of one_by_one()


@contextlib.contextmanager
def one_by_one() -> Iterator[None]:
    """Run every owner product one matrix at a time inside the block (Muon's Newton-Schulz
    included): the same results, one launch per product and matrix."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


def enabled() -> bool:
    """Whether same-shape products may batch here (outside `one_by_one()`)."""
    return _OFF[0] == 0


def aligned_empty(n: int, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (n, rows, cols) stack, each matrix at a 256-byte aligned offset of one
    buffer ([Note: batched owner products])."""
    align = max(1, STACK_ALIGN_BYTES // like.element_size())
    stride = -(-(rows * cols) // align) * align
    buf = like.new_empty(n * stride)
    return buf.as_strided((n, rows, cols), (stride, cols, 1))


def aligned_stack(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The same-shape 2-D `xs` stacked (n, r, c), each at a 256-byte aligned offset."""
    out = aligned_empty(len(xs), *xs[0].shape, like=xs[0])
    torch._foreach_copy_(list(out.unbind(0)), list(xs))  # one launch on a GPU
    return out


def verdicts() -> dict:
    """Every batch kind probed so far in this process -> whether it is batched."""
    return dict(_VERDICTS)


def _base(x: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(the contiguous matrix, transposed?) that `x` is, or None where it is neither a
    contiguous matrix nor the transpose of one, or starts off the operand alignment."""
    if x.ndim != 2 or x.numel() == 0 or x.data_ptr() % OPERAND_ALIGN_BYTES:
        return None
    if x.is_contiguous():
        return x, False
    if x.T.is_contiguous():
        return x.T, True
    return None


def _signature(chain: Sequence[torch.Tensor]):
    """Per operand (its base's shape, transposed?, the first operand with the same base), or
    None where the chain cannot take part in a batch."""
    sig, seen = [], []
    for x in chain:
        based = _base(x)
        if based is None or x.dtype != chain[0].dtype or x.device != chain[0].device:
            return None
        base, transposed = based
        same = next((j for j, b in enumerate(seen) if _same(b, base)), len(seen))
        seen.append(base)
        sig.append((tuple(base.shape), transposed, same))
    return tuple(sig)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _one(chain: Sequence[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.matmul, chain)


def _batched(chains_: Sequence[Sequence[torch.Tensor]], sig) -> list[torch.Tensor]:
    """Every chain of one signature, each product one bmm over the stacks."""
    stacks = []
    for k, (_, transposed, same) in enumerate(sig):
        if same < k:
            base = stacks[same][0]
        else:
            base = aligned_stack([c[k].T if transposed else c[k] for c in chains_])
        stacks.append((base, base.mT if transposed else base))
    x = stacks[0][1]
    for _, operand in stacks[1:]:
        out = aligned_empty(len(chains_), x.size(1), operand.size(2), like=x)
        x = torch.bmm(x, operand, out=out)
    return list(x.unbind(0))


def _batchable(sig, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    key = (sig, n, dtype, device, torch.get_num_threads())
    ok = _VERDICTS.get(key)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        probes = []
        for _ in range(n):
            bases: list[torch.Tensor] = []
            for shape, _, same in sig:
                bases.append(bases[same] if same < len(bases) else
                             torch.randn(shape, generator=g, dtype=dtype, device=device))
            probes.append([b.T if t else b for b, (_, t, _) in zip(bases, sig)])
        alone = [_one(c) for c in probes]
        ok = _VERDICTS[key] = all(
            torch.equal(u, v) for u, v in zip(alone, _batched(probes, sig)))
    return ok


def chains(products: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """`((x1 @ x2) @ x3) ...` of every chain of 2-D matrices in `products`, each bitwise the
    one-by-one product; chains of one signature run batched where a probe found that bitwise
    the same ([Note: batched owner products]), in order."""
    out: list = [None] * len(products)
    kinds: dict = {}
    for i, c in enumerate(products):
        if len(c) < 2:
            raise ValueError(f"chains: product {i} has {len(c)} operand(s); it needs 2 or more")
        sig = _signature(c)
        if sig is None:
            out[i] = _one(c)
        else:
            kinds.setdefault((sig, c[0].dtype, c[0].device), []).append(i)
    for (sig, dtype, device), idx in kinds.items():
        group = [products[i] for i in idx]
        if len(idx) > 1 and enabled() and _batchable(sig, len(idx), dtype, device):
            results = _batched(group, sig)
        else:
            results = [_one(c) for c in group]
        for i, r in zip(idx, results):
            out[i] = r
    return out
