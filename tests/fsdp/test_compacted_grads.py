"""`requires_grad_()` after fully_shard: the gradient path shrinks to what requires grad
([Note: compacted gradients] in veragged/dbuffer/grad_layout.py), with torch's numbers.

Two ranks (and four, as HSDP 2 x 2) train the same model under torch's fully_shard and
veragged's in one run, with the trainable set changing between steps as a user's script changes
it: weights frozen after the optimizer exists (BitFit, PEFT's freeze after sharding), frozen
while their `.grad` from the last step is still there (no `zero_grad` in between), unfrozen
between two no-sync micro-batches, frozen between forward and backward, and everything unfrozen
again. Each gradient element is the same sum of the same terms on both implementations (HSDP:
the shard group's pair, then the replicas' pair), so losses, gradients and parameters are
compared bitwise. The reduce-scatters are counted: after a freeze they carry each rank's
pieces of the trainable parameters and the verdict flags, no frozen element.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from tests.fsdp._reference import Block
from tests.harness import get_mesh, run_on_ranks

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}


def _schedule():
    """(name, what to do before the step's forward)."""
    def freeze(pattern):
        return lambda m: [p.requires_grad_(pattern(n)) for n, p in m.named_parameters()]

    return [
        ("all", None),
        ("bitfit", freeze(lambda n: "bias" in n)),          # grads of step 0 dropped (zero_grad)
        ("keep_grads", freeze(lambda n: n.endswith("norm.bias"))),  # .grad kept from "bitfit"
        ("no_sync_unfreeze", "no_sync"),                    # unfreeze between micro-batches
        ("freeze_in_backward", "between"),                  # frozen after forward
        ("all_again", freeze(lambda n: True)),
    ]


def _train(impl: str):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for block in model:
        IMPLS[impl](block, mesh=get_mesh())
    IMPLS[impl](model, mesh=get_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sizes: list[int] = []  # elements each reduce-scatter sends from this rank
    orig, orig_list = dist.reduce_scatter_tensor, dist.reduce_scatter

    def counting(output, input, *args, **kwargs):
        sizes.append(input.numel())
        return orig(output, input, *args, **kwargs)

    def counting_list(output, inputs, *args, **kwargs):  # slots of different sizes
        sizes.append(sum(t.numel() for t in inputs))
        return orig_list(output, inputs, *args, **kwargs)

    rank = dist.get_rank()

    def data(step, micro=0):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        return torch.randn(4, 16, generator=g)

    out = []
    dist.reduce_scatter_tensor, dist.reduce_scatter = counting, counting_list
    try:
        for step, (name, change) in enumerate(_schedule()):
            sizes.clear()
            if callable(change):
                change(model)
            if name != "keep_grads":
                opt.zero_grad()
            if change == "no_sync":
                model.set_requires_gradient_sync(False)
                loss = model(data(step, 0)).pow(2).mean()
                loss.backward()
                model[1].small.weight.requires_grad_(True)  # gains a gradient mid-accumulation
                model.set_requires_gradient_sync(True)
                loss = loss.detach() + model(data(step, 1)).pow(2).mean()
                loss.backward() if loss.requires_grad else None
            else:
                y = model(data(step)).pow(2).mean()
                if change == "between":
                    model[0].big.bias.requires_grad_(False)  # autograd already recorded it
                y.backward()
                loss = y
            grads = {n: (None if p.grad is None else p.grad.full_tensor())
                     for n, p in model.named_parameters()}
            opt.step()
            params = {n: p.full_tensor() for n, p in model.named_parameters()}
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            out.append((name, loss.detach(), grads, params, list(sizes), trainable))
    finally:
        dist.reduce_scatter_tensor, dist.reduce_scatter = orig, orig_list
    return out


MESHES = {"1d": dict(world=2), "hsdp": dict(world=4, mesh_shape=(2, 2),
                                             mesh_dim_names=("replicate", "shard"))}


def _run(mesh: str = "1d"):
    kw = dict(MESHES[mesh])
    world = kw.pop("world")
    return {impl: run_on_ranks(_train, world, args=(impl,), **kw)[0] for impl in IMPLS}


@pytest.fixture(scope="module", params=list(MESHES))
def runs(request):
    return _run(request.param)


def test_requires_grad_changes_match_torch_bitwise(runs):
    for (name, t_loss, t_grads, t_params, _, _), (_, v_loss, v_grads, v_params, _, _) in zip(
            runs["torch"], runs["veragged"]):
        assert torch.equal(t_loss, v_loss), name
        assert t_grads.keys() == v_grads.keys()
        for n in t_grads:
            tg, vg = t_grads[n], v_grads[n]
            assert (tg is None) == (vg is None), (name, n, tg, vg)
            if tg is not None:
                assert torch.equal(tg, vg), (name, n, (tg - vg).abs().max())
        for n in t_params:
            assert torch.equal(t_params[n], v_params[n]), (name, n)


def test_frozen_parameters_leave_the_reduce_scatter(runs):
    full = runs["veragged"][0][4]  # step "all": every tensor has room
    for name, _, _, _, sizes, trainable in runs["veragged"]:
        if name in ("all", "all_again"):
            assert sizes == full, name
            continue
        for n, f in zip(sizes, full):
            assert n < f, (name, sizes, full)  # frozen elements are not sent
        # Everything trainable is sent once, each rank's slot as large as its share (rounded
        # up to 16 bytes) plus the verdict flags: at most 3 + 8 fp32 elements more per slot of
        # the shard group's 2 (a Block's 6 tensors take 8 flags), however unevenly the shares
        # fall (the largest share in every slot would send more).
        assert trainable <= sum(sizes) <= trainable + 11 * 2 * len(sizes), (
            name, sizes, trainable)
