"""What backward keeps alive ([Note: backward memory order], [Note: sharded gradient lifetime]):
a group's gradient buffer exists only from its post-backward to the end of its reduction, never
beside its own unsharded parameters; the sharded gradients live as long as the `.grad`s do, so
`zero_grad()` frees them as torch's, and `zero_grad(set_to_none=False)` or accumulating across
steps keeps them. A real forward and backward on 2 gloo ranks; the trained values are checked
against torch's fully_shard in the same run (benchmarks/memory.py measures the bytes)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from tests.fsdp._reference import Block, full
from tests.harness import get_mesh, run_on_ranks


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _groups(module):
    return module._veragged_state.groups


def _build(shard):
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        shard(layer, mesh=get_mesh())
    shard(model, mesh=get_mesh())
    return model


def _watch():
    model = _build(veragged.fully_shard)
    root, layers = _groups(model)[0], [_groups(m)[0] for m in model.layers]
    seen = []

    def during_layer0_backward(grad):
        # layers.0 computes its backward now: layers.1's reduction is still in flight (one is
        # allowed, as torch keeps one reduce-scatter input), layers.2's finished when layers.1's
        # started, and neither the root nor layers.0 has reached its post-backward.
        seen.append({
            "root_buffer": root.buffer.grads.allocated,
            "layer0_buffer": layers[0].buffer.grads.allocated,
            "layer1_buffer": layers[1].buffer.grads.allocated,
            "layer2_buffer": layers[2].buffer.grads.allocated,
            "layer1_unsharded": layers[1].is_unsharded or layers[1].buffer.is_unsharded,
            "layer0_unsharded": layers[0].is_unsharded,
        })
        return grad

    hook = model.layers[0].norm.register_full_backward_pre_hook(
        lambda m, g: during_layer0_backward(g))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    res = {}
    for step in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    res["during"] = seen[-1]
    gc.collect()
    res["freed_by_zero_grad"] = [g.buffer.grads.shard_grad is None for g in [root, *layers]]
    # set_to_none=False keeps the views, so the buffer and its (zeroed) values
    model(x).sum().backward()
    opt.zero_grad(set_to_none=False)
    res["kept_by_zeroing"] = all(
        g.buffer.grads.shard_grad is not None for g in [root, *layers]) and all(
        float(p.grad.to_local().abs().sum()) == 0 for p in model.parameters())
    hook.remove()
    return res


def test_buffers_live_only_while_needed():
    for r in run_on_ranks(_watch, 2, timeout=120):
        assert r["during"] == {"root_buffer": False, "layer0_buffer": False,
                               "layer1_buffer": True, "layer2_buffer": False,
                               "layer1_unsharded": False,
                               "layer0_unsharded": True}, r
        assert r["freed_by_zero_grad"] == [True] * 4, r
        assert r["kept_by_zeroing"], r


def _accumulate(impl):
    model = _build(veragged.fully_shard if impl == "veragged" else torch_fully_shard)
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(4, 16, generator=g) for _ in range(3)]
    out = []
    model(xs[0]).sum().backward()
    kept = [full(p.grad) for p in model.parameters()]  # a value read, then grads dropped
    model.zero_grad()
    for x in xs[1:]:  # two steps' gradients summed in the .grads (no zero_grad between)
        model(x).sum().backward()
    out.append([full(p.grad) for p in model.parameters()])
    model.zero_grad()
    model(xs[0]).sum().backward()  # fresh memory: equal to the first step's values
    out.append([full(p.grad) for p in model.parameters()])
    return kept, out


def test_gradients_after_zero_grad_match_torch():
    theirs = run_on_ranks(_accumulate, 2, args=("torch",), timeout=120)
    ours = run_on_ranks(_accumulate, 2, args=("veragged",), timeout=120)
    for (tk, to), (vk, vo) in zip(theirs, ours):
        for a, b in zip(tk, vk):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for t_list, v_list in zip(to, vo):
            for a, b in zip(t_list, v_list):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for a, b in zip(vk, vo[1]):  # the same step twice: bitwise the same
            assert torch.equal(a, b)
