"""Host work per group per step: the kernels FSDP itself launches (ops counted by
`veragged.tools.write_counter.LaunchCounter`, attributed to FSDP's code by its stack), veragged
against torch's fully_shard on the same model in the same ranks. The gradient landing is one
`land_` launch per group ([Note: gradient landing]), not one per parameter, so veragged's FSDP
launches stay at most torch's in every phase however many tensors a group holds; the whole
step (model, clipping, optimizer included) launches no more than torch's. Counts, not times,
so they are asserted (`benchmarks/host_work.py` prints them with host times)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from tests.harness import get_mesh, run_on_ranks
from veragged.tools.write_counter import LaunchCounter

PHASES = ("forward", "backward", "clip", "optim")


class Wide(nn.Module):
    """Many small tensors per group: 24 biased Linears and norms per block."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(12))
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(12))

    def forward(self, x):
        for lin, norm in zip(self.layers, self.norms):
            x = norm(x + torch.tanh(lin(x)))
        return x


def _counts(impl: str, mixed: bool):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(Wide(), Wide(), nn.Linear(16, 4))
    kw = {"mesh": get_mesh()}
    if mixed:
        kw["mp_policy"] = torch.distributed.fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard = veragged.fully_shard if impl == "veragged" else torch_fully_shard
    for m in model[:2]:
        shard(m, **kw)
    shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    counter = LaunchCounter()

    def phase(name: str) -> None:
        counter.phase = name

    for step in range(2):  # the second step is counted (the first makes the optimizer state)
        with counter if step == 1 else contextlib.nullcontext():
            phase("forward")
            loss = model(x).pow(2).mean()
            phase("backward")
            loss.backward()
            phase("clip")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            phase("optim")
            opt.step()
            opt.zero_grad()
    return {p: (counter.counts[(p, "fsdp")], counter.counts[(p, "rest")]) for p in PHASES}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16_params"])
def test_fsdp_launches_at_most_torchs(mixed):
    theirs = run_on_ranks(_counts, 2, args=("torch", mixed), timeout=120)
    ours = run_on_ranks(_counts, 2, args=("veragged", mixed), timeout=120)
    for t, v in zip(theirs, ours):
        for p in PHASES:
            assert v[p][0] <= t[p][0], (p, "fsdp", t, v)
        # 3 groups, 75 tensors: a handful of launches per group in backward (zeroing the
        # padding, the flags, the landing, the reduce-scatter's cast), none per tensor
        assert v["backward"][0] <= 4 * 3, v
        if not mixed:
            assert v["forward"][0] == 0, v  # the all-gather fills the unsharded views
        assert sum(sum(c) for c in v.values()) <= sum(sum(c) for c in t.values()), (t, v)
