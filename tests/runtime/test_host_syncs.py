"""No host sync in a training step ([Note: streams and events] in veragged/runtime/streams.py).

On an accelerator, reading a device tensor's value on the host (`.item()`, `.tolist()`, `bool()`,
`int()`, `float()`, `.cpu()`, `.numpy()`) waits for every kernel queued before it. On the CPU
the same calls cost nothing, so they are found here by watching them: between the start of
forward and `optimizer.step()` returning, veragged's own code (not torch's, not the test's) may
call none of them on a tensor other than the optimizers' step counters, which live on the host
as torch's do (torch.optim keeps `state["step"]` on the CPU unless capturable), nor build a
tensor from host data with a `device` (`torch.tensor(x, device=...)`: a blocking copy from
pageable memory). The steps after the first are watched (the first creates the optimizer state),
with fully_shard + torch's AdamW, Muon and AdamW8bit, and with clipping (torch's and
veragged's)."""

from __future__ import annotations

import os
import sys
import traceback
from unittest import mock

import pytest
import torch
import torch.nn as nn

import veragged
from veragged.optim import AdamW8bit, Muon
from tests.harness import get_mesh, run_on_ranks

PACKAGE = os.path.dirname(veragged.__file__)
WATCHED = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")
FACTORIES = ("tensor", "as_tensor")  # from host data onto a device: a blocking copy


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(),
                                                  nn.LayerNorm(64)) for _ in range(3))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _ours(frames) -> str | None:
    """The innermost frame in veragged's own code (outside veragged/testing), as file:line."""
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if path.startswith(PACKAGE) and os.sep + "testing" + os.sep not in path:
            return f"{os.path.relpath(path, os.path.dirname(PACKAGE))}:{f.lineno} ({f.name})"
    return None


def _planted_sync():
    """A post-backward that reads a gradient's value on the host, as if written in
    veragged/fsdp/group.py (the detector must report it)."""
    from veragged.fsdp.group import ParamGroup

    src = ("def post_backward(self, ctx):\n"
           "    orig(self, ctx)\n"
           "    float(self.buffer.grads.flat.sum()) if self.buffer.grads.allocated else None\n")
    scope = {"orig": ParamGroup.post_backward}
    exec(compile(src, os.path.join(PACKAGE, "fsdp", "group.py"), "exec"), scope)
    return mock.patch.object(ParamGroup, "post_backward", scope["post_backward"])


def _train(opt_name: str, clip: str, planted: bool = False):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    kw = {"mesh": get_mesh()}
    if opt_name == "adamw8bit":  # whole quantisation blocks per rank
        kw["granularity_fn"] = veragged.optim.adamw8bit_granularity(256)
    for b in model.blocks:
        veragged.fully_shard(b, **kw)
    veragged.fully_shard(model, **kw)
    params = list(model.parameters())
    if opt_name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3)
    elif opt_name == "muon":
        opt = Muon(params, lr=1e-3)
    else:
        opt = AdamW8bit(params, lr=1e-3, min_8bit_size=1024)
    calls: list[str] = []
    watching = [False]
    host: set[int] = set()  # the optimizers' step counters (host tensors, as torch's)

    def watch(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if watching[0] and id(self) not in host:
                where = _ours(traceback.extract_stack()[:-1])
                if where is not None:
                    calls.append(f"Tensor.{name} at {where}")
            return orig(self, *args, **kwargs)

        return mock.patch.object(torch.Tensor, name, wrapper)

    rank = dist.get_rank()
    def watch_factory(name):  # torch.tensor(data, device=...): a blocking host-to-device copy
        orig = getattr(torch, name)

        def wrapper(*args, **kwargs):
            if watching[0] and kwargs.get("device") not in (None, "meta"):
                where = _ours(traceback.extract_stack()[:-1])
                if where is not None:
                    calls.append(f"torch.{name}(device=) at {where}")
            return orig(*args, **kwargs)

        return mock.patch.object(torch, name, wrapper)

    patches = [watch(n) for n in WATCHED] + [watch_factory(n) for n in FACTORIES]
    if planted:
        patches.append(_planted_sync())
    for p in patches:
        p.start()
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + rank)
            watching[0] = step > 0
            loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
            loss.backward()
            if clip == "torch":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif clip == "veragged":
                veragged.clip_grad_norm_(params, 1.0)
            opt.step()
            watching[0] = False
            opt.zero_grad()
            host.update(id(s["step"]) for s in opt.state.values()
                        if isinstance(s.get("step"), torch.Tensor))
    finally:
        for p in patches:
            p.stop()
    return sorted(set(calls))


@pytest.mark.parametrize("opt_name,clip", [("adamw", "none"), ("adamw", "torch"),
                                           ("adamw", "veragged"), ("muon", "veragged"),
                                           ("adamw8bit", "veragged")])
def test_no_host_sync_in_a_step(opt_name, clip):
    for calls in run_on_ranks(_train, 2, args=(opt_name, clip), timeout=180):
        assert calls == [], calls


def test_a_planted_sync_is_reported():
    for calls in run_on_ranks(_train, 2, args=("adamw", "none", True), timeout=180):
        where = "Tensor.__float__ at veragged/fsdp/group.py"
        assert calls and all(where in c for c in calls), calls
