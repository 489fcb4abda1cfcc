"""Block-scaled weights under what users do ([Note: block-scaled weights]): a frozen quantised
weight (quantised once: its shard never changes), a module unused on one step, a rank without
data, two forwards before one backward, a DCP save and load in the middle of training, and
`torch.compile` (aot_eager) of the sharded model, whose gradients equal eager's (compute="fp8"
runs each F.linear eagerly: [Note: FP8 compute]); for compute="bf16" and "fp8"."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import veragged
from tests.harness import get_mesh, run_on_ranks


class Net(nn.Sequential):
    use_last = True

    def forward(self, x):
        h = self[2](self[1](self[0](x)))
        return self[3](h) if self.use_last else h[:, :8]


def _build(fmt):
    torch.manual_seed(0)
    m = Net(nn.Linear(64, 130), nn.ReLU(), nn.Linear(130, 130), nn.Linear(130, 8))
    m[2].weight.requires_grad_(False)
    qf = lambda n, p: fmt if p.ndim == 2 else None  # noqa: E731
    for layer in (m[0], m[2], m[3]):
        veragged.fully_shard(layer, mesh=get_mesh(), quant_fn=qf)
    veragged.fully_shard(m, mesh=get_mesh(), quant_fn=qf)
    return m


def _usage(compute):
    rank = dist.get_rank()
    fmt = veragged.BlockFP8(compute=compute)
    m = _build(fmt)
    frozen = m[2].weight.full_tensor()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 64) if rank == 0 else torch.zeros(0, 64)  # rank 1: no data
    for use_last in (True, False):  # m[3] unused on the second step
        m.use_last = use_last
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    m.use_last = True
    y1, y2 = m(x), m(x)
    (y1.sum() + y2.sum()).backward()
    opt.step()
    opt.zero_grad()
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    dcp.save(m.state_dict(), checkpoint_id=folder[0])
    m2 = _build(fmt)
    sd = m2.state_dict()
    dcp.load(sd, checkpoint_id=folder[0])
    m2.load_state_dict(sd)
    probe = torch.ones(2, 64)
    with torch.no_grad():
        same_out = torch.equal(m(probe), m2(probe))
    trainable = [p for p in m.parameters() if p.requires_grad]
    m(probe).sum().backward()
    eager = [p.grad.full_tensor() for p in trainable]
    opt.zero_grad()
    compiled = torch.compile(m, backend="aot_eager")
    compiled(probe).sum().backward()
    grads = [p.grad is not None and torch.equal(p.grad.full_tensor(), g)
             for p, g in zip(trainable, eager)]
    return dict(
        frozen=torch.equal(m[2].weight.full_tensor(), frozen),
        loaded=all(torch.equal(a.full_tensor(), b.full_tensor())
                   for a, b in zip(m.parameters(), m2.parameters())),
        same_out=same_out,
        quantizations=[s.quantizations for s in m.quant_stats()],
        compiled_grads=grads)


@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_block_scaled_weights_under_usual_training(compute):
    for r in run_on_ranks(_usage, 2, args=(compute,), timeout=300):
        assert r["frozen"] and r["loaded"] and r["same_out"], r
        # One quantisation per root forward ([Note: shard epochs]), frozen weights included:
        # 3 training steps (2 forwards in the third), the probe, eager and compiled; m[3] is
        # skipped in step 2.
        assert r["quantizations"] == [7, 7, 6], r
        assert all(r["compiled_grads"]), r
