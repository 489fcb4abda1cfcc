"""Training with block-scaled weights (compute="bf16") equals a one-process model whose forward
uses the same fake-quantised weights, bitwise, for AdamW and Muon: rank 0 carries the whole
batch scaled by the world size, the others a zero loss (slicing the batch would differ by fp32
round-off). Backward re-gathers (reshard_after_forward=True) reuse the forward's 8-bit slot."""

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import veragged
from veragged.optim import Muon
from veragged.quant.reference import fake_quantize
from tests.harness import get_mesh, run_on_ranks
from tests.quant.quant_cases import FORMATS

STEPS = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 200), nn.ReLU(), nn.Linear(200, 130), nn.ReLU(),
                         nn.Linear(130, 10))


def _optimizer(kind, params):
    if kind.startswith("adamw"):  # fused: no version bump ([Note: shard epochs])
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=kind == "adamw_fused")
    return Muon(params, lr=0.02, weight_decay=0.1)


def _data(world):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 96, generator=g), torch.randn(16, 10, generator=g))
            for _ in range(STEPS)]


def _train(kind, fmt_name):
    fmt = FORMATS[fmt_name]
    quant_fn = lambda n, p: fmt if p.ndim == 2 else None  # noqa: E731
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            veragged.fully_shard(layer, mesh=get_mesh(), quant_fn=quant_fn)
    veragged.fully_shard(model, mesh=get_mesh(), quant_fn=quant_fn)
    opt = _optimizer(kind, model.parameters())
    for x, y in _data(world):
        loss = nn.functional.mse_loss(model(x), y) * (world if rank == 0 else 0.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    stats = [(s.quantizations, s.all_gathers) for s in model.quant_stats()]

    # One process: the same master weights, the forward on their fake-quantised copies, the
    # gradient of each copy given to its master (what the sharded run reduces).
    ref = _model()
    ref_opt = _optimizer(kind, ref.parameters())
    for x, y in _data(world):
        used = {n: (fake_quantize(p.detach(), fmt) if quant_fn(n, p) else p.detach())
                .requires_grad_() for n, p in ref.named_parameters()}
        nn.functional.mse_loss(functional_call(ref, used, (x,)), y).backward()
        for n, p in ref.named_parameters():
            p.grad = used[n].grad
        ref_opt.step()
        ref_opt.zero_grad()
    if kind == "adamw_fused":  # its CPU kernel's vector and scalar tails differ by an ulp on a
        # shard against the whole tensor: close, not bitwise (stale weights are ~1e-2 off)
        same = {n: torch.allclose(got[n], p.detach(), rtol=1e-5, atol=1e-6)
                for n, p in ref.named_parameters()}
    else:
        same = {n: torch.equal(got[n], p.detach()) for n, p in ref.named_parameters()}
    return same, stats


@pytest.mark.parametrize("world,kind,fmt", [(2, "adamw", "block128"), (4, "adamw", "mx_rceil"),
                                            (2, "adamw_fused", "row128"),
                                            (2, "muon", "mx_floor"), (4, "muon", "ue8m0")])
def test_training_equals_the_fake_quantised_one_process_model(world, kind, fmt):
    for same, stats in run_on_ranks(_train, world, args=(kind, fmt), timeout=240):
        assert all(same.values()), same
        # Each Linear's group: one quantisation per step (forward), two all-gathers (forward and
        # backward's re-gather); the root holds no parameter of its own.
        assert stats == [(STEPS, 2 * STEPS)] * 3, stats
