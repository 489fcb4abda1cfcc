"""compute="fp8" ([Note: FP8 compute], veragged/quant/linear.py): the unsharded weight is a
`BlockScaledWeight` whose `F.linear` multiplies block-quantised activations by the gathered
8-bit weight. On CPU that is the exact dequantise-then-matmul reference, so a sharded run
equals a one-process model using `block_scaled_linear` on the fake-quantised weights, bitwise;
the FP8 operands the GEMM would read are the one-process quantiser's bytes, scales in the
GEMM's layout (K blocks padded to 4). Worlds are powers of two: rank 0's loss is scaled by
the world and the gradient divided by it, exact only then."""

import pytest
import torch
import torch.nn as nn

import veragged
from veragged.quant.linear import block_scaled_linear
from veragged.quant.reference import fake_quantize, quantize, scale_inv
from veragged.quant.tensor import BlockScaledWeight
from tests.harness import get_mesh, run_on_ranks

STEPS = 3
FP8 = {
    "block128": veragged.BlockFP8(compute="fp8"),
    "ue8m0": veragged.BlockFP8(scale="ue8m0", compute="fp8"),
    "row128": veragged.BlockFP8(tile=(1, 128), compute="fp8"),
    "mxfp8": veragged.MXFP8(rounding="rceil", compute="fp8"),
}


class Net(nn.Module):
    """Partial tiles both ways (300 x 200, 130 x 300), a bias-free layer, a weight used twice
    in one forward (its gradients add), a 1-D parameter left unquantised."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(200, 300)
        self.b = nn.Linear(300, 130, bias=False)
        self.c = nn.Linear(130, 130)
        self.norm = nn.Parameter(torch.rand(130) + 0.5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h)) * self.norm
        return self.c(torch.relu(self.c(h)))


def _reference_forward(net, x, fmt, used):
    def lin(layer, name, h):
        b = used.get(f"{name}.bias")
        return block_scaled_linear(h, used[f"{name}.weight"], b, fmt)

    h = torch.relu(lin(net.a, "a", x))
    h = torch.relu(lin(net.b, "b", h)) * used["norm"]
    return lin(net.c, "c", torch.relu(lin(net.c, "c", h)))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 200, generator=g), torch.randn(12, 130, generator=g))
            for _ in range(STEPS)]


def _train(fmt_name, reshard_after_forward):
    fmt = FP8[fmt_name]
    quant_fn = lambda n, p: fmt if p.ndim == 2 else None  # noqa: E731
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    net = Net()
    for layer in (net.a, net.b, net.c):
        veragged.fully_shard(layer, mesh=get_mesh(), quant_fn=quant_fn,
                             reshard_after_forward=reshard_after_forward)
    veragged.fully_shard(net, mesh=get_mesh(), quant_fn=quant_fn)
    kinds = []
    net.a.register_forward_pre_hook(
        lambda m, a: kinds.append((type(m.weight).__name__, isinstance(m.weight, nn.Parameter))))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _data():
        loss = nn.functional.mse_loss(net(x), y) * (world if rank == 0 else 0.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    got = {n: p.full_tensor() for n, p in net.named_parameters()}

    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _data():
        used = {n: (fake_quantize(p.detach(), fmt) if p.ndim == 2 else p.detach())
                .requires_grad_() for n, p in ref.named_parameters()}
        nn.functional.mse_loss(_reference_forward(ref, x, fmt, used), y).backward()
        for n, p in ref.named_parameters():
            p.grad = used[n].grad
        ref_opt.step()
        ref_opt.zero_grad()
    return {n: torch.equal(got[n], p.detach()) for n, p in ref.named_parameters()}, kinds


@pytest.mark.parametrize("world,fmt,raf", [(2, "block128", True), (4, "ue8m0", False),
                                           (2, "mxfp8", True), (1, "row128", True)])
def test_fp8_compute_training_equals_the_one_process_reference(world, fmt, raf):
    for same, kinds in run_on_ranks(_train, world, args=(fmt, raf), timeout=240):
        assert all(same.values()), same
        assert kinds == [("BlockScaledWeight", True)] * STEPS, kinds


def _operands(fmt_name):
    fmt = FP8[fmt_name]
    net = Net()
    full = {n: p.detach().clone() for n, p in net.named_parameters()}
    veragged.fully_shard(net, mesh=get_mesh(), quant_fn=lambda n, p: fmt if p.ndim == 2 else None)
    net.unshard()
    out = {}
    for name, layer in (("a", net.a), ("b", net.b), ("c", net.c)):
        w = layer.weight
        assert isinstance(w, BlockScaledWeight), type(w)
        data, scales = w.operands()
        q, s = quantize(full[f"{name}.weight"], fmt)
        ref = scale_inv(s, fmt)
        padded = torch.zeros(ref.shape[0], -(-ref.shape[1] // 4) * 4)
        padded[:, : ref.shape[1]] = ref
        out[name] = (torch.equal(data.view(torch.uint8), q), data.dtype == torch.float8_e4m3fn,
                     torch.equal(scales, padded),
                     torch.equal(w.dequantized, fake_quantize(full[f"{name}.weight"], fmt)))
    # Every other op sees the dequantised weight; the operands end with the reshard.
    held = net.a.weight
    total = held.sum()
    net.reshard()
    try:
        held.operands()
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    return out, float(total), raised


@pytest.mark.parametrize("world,fmt", [(2, "block128"), (3, "mxfp8"), (4, "ue8m0")])
def test_fp8_operands_are_the_one_process_quantisers_in_the_gemm_layout(world, fmt):
    for out, total, raised in run_on_ranks(_operands, world, args=(fmt,), timeout=120):
        assert all(all(v) for v in out.values()), out
        assert total == total  # finite: the dequantised weight, not garbage
        assert "used while its group was resharded" in raised, raised


def _bad_compute():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.Parameter(torch.randn(2, 8, 8))

    errors = []
    for fqn_shape in (Stack(), nn.LayerNorm(16)):
        try:
            veragged.fully_shard(fqn_shape, mesh=get_mesh(),
                                 quant_fn=lambda n, p: FP8["block128"])
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_fp8_compute_refuses_a_weight_that_is_not_2d():
    (errors,) = run_on_ranks(_bad_compute, 1, timeout=60)
    assert "'experts'" in errors[0] and "needs a 2-D" in errors[0], errors
    assert "'weight'" in errors[1] and "[16]" in errors[1], errors
