"""fully_shard on one CUDA device with NCCL ([Note: streams and events]): the same training as
torch's fully_shard, bitwise, with the all-gathers and reduce-scatters on the runtime's side
streams and no host sync between forward and `optimizer.step()` returning
(`torch.cuda.set_sync_debug_mode("error")` raises on any). A lent GPU machine has one device,
so this runs on a mesh of one rank; the multi-rank orderings are checked on the CPU by
tests/runtime/test_happens_before.py. Skipped without CUDA (`scripts/gpu_check.sh` runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from tests.harness import run_on_ranks
from tests.harness.device import backend_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_check.sh)")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(64, 256), nn.Linear(256, 64), nn.LayerNorm(64)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


def _train(impl: str, mixed: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from veragged.runtime.streams import DeviceStreams

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)], nn.Linear(64, 8)).cuda()
    shard = veragged.fully_shard if impl == "veragged" else torch_fully_shard
    kw = {"mesh": mesh}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for b in model[:4]:
        shard(b, **kw)
    shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(4):
        x = torch.randn(32, 64, device="cuda", generator=g)
        if step > 0:  # the first step makes the optimizer state (host step counters)
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    params = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    streams = None
    if impl == "veragged":
        rt = model._veragged_state.ctx.streams
        bufs = [g.buffer for m in model.modules() if getattr(m, "_veragged_state", None)
                for g in m._veragged_state.groups]
        streams = (isinstance(rt, DeviceStreams),
                   all(b._unsharded_stream is rt.stream("all_gather") for b in bufs),
                   rt.stream("all_gather") != torch.cuda.current_stream(),
                   len(rt._pending))
    return losses, params, streams


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16_params"])
def test_one_gpu_matches_torch_without_host_syncs(mixed):
    backend = backend_for("cuda")
    (t_losses, t_params, _), = run_on_ranks(_train, 1, args=("torch", mixed), backend=backend,
                                             timeout=300)
    (v_losses, v_params, streams), = run_on_ranks(_train, 1, args=("veragged", mixed),
                                                  backend=backend, timeout=300)
    assert streams == (True, True, True, 0), streams
    for a, b in zip(t_losses, v_losses):
        assert torch.equal(a, b)
    for n, p in t_params.items():
        assert torch.equal(p, v_params[n]), n


def _profiled(impl: str):
    """One profiled training step after a warm-up: benchmarks/trace_overlap's NCCL overlap."""
    import pathlib
    import sys

    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    from trace_overlap import profile_step

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)], nn.Linear(64, 8)).cuda()
    shard = veragged.fully_shard if impl == "veragged" else torch_fully_shard
    for b in model[:4]:
        shard(b, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    return profile_step(step)


def test_profiler_trace_overlap_on_both_sides():
    """The benchmarks' NCCL-overlap figure reads a real trace: compute kernels are found, and
    whatever NCCL time one rank shows is split into hidden and exposed parts."""
    for impl in ("torch", "veragged"):
        r, = run_on_ranks(_profiled, 1, args=(impl,), backend=backend_for("cuda"),
                           timeout=300)
        assert r["compute_us"] > 0, (impl, r)
        assert 0.0 <= r["hidden"] <= 1.0, (impl, r)
        assert abs(r["hidden_us"] + r["exposed_us"] - r["nccl_us"]) < 1e-6, (impl, r)
