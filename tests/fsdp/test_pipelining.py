"""torch's pipelining (`torch.distributed.pipelining`) with fully_shard'ed stages.

torch 2.15's `PipelineStage` drives an `FSDPModule` stage through FSDP2's API: gradient sync off
for the micro-batches, `set_manual_backward_finalization(True)`, then `finalize_backward(async_op=
True)` and the handle's `wait()` ([Note: manual backward finalization]). On 4 gloo ranks (a 2 x 2
mesh: 2 pipeline stages, each sharded over 2 ranks) the GPipe and 1F1B schedules give
veragged's stages the losses, gradients and parameters torch's fully_shard gives, bitwise (the
same reductions in the same order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

import veragged
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

pytestmark = pytest.mark.skipif(
    not hasattr(TorchFSDPModule, "finalize_backward"),
    reason="torch's pipelining drives FSDP through torch 2.15's finalize_backward",
)

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}
DIM, LAYERS = 16, 4


def _stage_module(stage: int) -> nn.Sequential:
    torch.manual_seed(0)
    full = nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(LAYERS)))
    half = LAYERS // 2
    return nn.Sequential(*list(full)[stage * half : (stage + 1) * half])


def _pipeline(impl: str, schedule_cls) -> dict:
    mesh = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    module = _stage_module(stage)
    for layer in module:
        IMPLS[impl](layer, mesh=mesh["dp"])
    IMPLS[impl](module, mesh=mesh["dp"])
    optim = torch.optim.AdamW(module.parameters(), lr=0.05)
    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = schedule_cls(pipe, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank())
    out = {"losses": [], "grads": []}
    for _ in range(3):
        x, y = torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)
        if stage == 0:
            schedule.step(x)
        else:
            losses = []
            schedule.step(target=y, losses=losses)
            out["losses"].append(torch.stack(losses))
        out["grads"].append({n: p.grad.full_tensor() for n, p in module.named_parameters()})
        optim.step()
        optim.zero_grad()
    out["params"] = {n: p.full_tensor() if isinstance(p, DTensor) else p
                     for n, p in module.named_parameters()}
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_match_torch(schedule):
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    ref = get_pool(4).run(_pipeline, "torch", schedule_cls)
    got = get_pool(4).run(_pipeline, "veragged", schedule_cls)
    for rank in range(4):
        for a, b in zip(ref[rank]["losses"], got[rank]["losses"]):
            assert torch.equal(a, b)
        for ga, gb in zip(ref[rank]["grads"], got[rank]["grads"]):
            assert ga.keys() == gb.keys()
            for k in ga:
                assert torch.equal(ga[k], gb[k]), k
        for k, v in ref[rank]["params"].items():
            assert torch.equal(v, got[rank]["params"][k]), k
