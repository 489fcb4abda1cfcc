"""`torch.amp.GradScaler` with fp16 compute under veragged's fully_shard, against torch's
fully_shard with the same scaler ([Note: GradScaler on RaggedShard]).

The model overflows in fp16 on purpose: the gradient of `s` (scaled by 1e3 in the forward)
is the first to reach inf as the loss scale grows, and veragged keeps `s` whole on one rank
(granularity = its numel), so only that rank's local shard sees the inf. The ranks must still
agree to skip: found_inf is all-reduced over the mesh."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import veragged
from tests.harness import get_mesh, run_on_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.s = nn.Parameter(torch.zeros(16))
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.l1(x)) + self.s * 1e3
        return self.l2(h).float().pow(2).mean()


def _train(kind, steps, optimizer):
    torch.manual_seed(0)
    model = Net()
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if kind == "veragged":
        granularity = lambda fqn, p: p.numel() if fqn == "s" else None  # noqa: E731
        veragged.fully_shard(model, mesh=get_mesh(), mp_policy=mp, granularity_fn=granularity)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=get_mesh(), mp_policy=mp)
    kw = {"fused": True} if optimizer == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    g = torch.Generator().manual_seed(dist.get_rank())
    scales, skipped, local_inf = [], [], []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        scaler.scale(model(x)).backward()
        if optimizer != "fused":  # fused AdamW unscales inside step
            scaler.unscale_(opt)
            state = scaler._per_optimizer_states[id(opt)]
            local_inf.append(sum(v.item() for v in state["found_inf_per_device"].values()))
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        scales.append(scale)
        opt.zero_grad()
    params = [p.full_tensor() for p in model.parameters()]
    return scales, skipped, local_inf, params


def _both(steps, optimizer):
    return _train("veragged", steps, optimizer), _train("torch", steps, optimizer)


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_grad_scaler_matches_torch_fully_shard(optimizer):
    """10 steps on 2 ranks: the scale sequence and the skipped steps equal torch's (some steps
    overflow, some not), found_inf agrees on every rank, and the parameters equal torch's
    bitwise (two ranks: the fp32 reduce-scatter sums the same two values in either order)."""
    (ours, ref), (other, _) = run_on_ranks(_both, 2, args=(10, optimizer), timeout=180)
    scales, skipped, local_inf, params = ours
    assert 0 < sum(skipped) < len(skipped), skipped  # the test exercises both outcomes
    assert scales == ref[0] and skipped == ref[1]
    assert local_inf == other[2] == ref[2]
    for a, b in zip(params, ref[3]):
        assert torch.equal(a, b)
