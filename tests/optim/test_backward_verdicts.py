"""The optimizers take fully_shard's backward verdicts ([Note: grad verdicts for optimizers],
veragged/dbuffer/grads.py): after a backward under `veragged.fully_shard`, Muon and AdamW8bit with
the default `grad_agreement="auto"` issue no presence all-reduce, and step exactly as with
`grad_agreement="mesh"` (which always all-reduces), with a layer one rank's forward skips (its
gradient comes from the other rank). A `.grad` dropped by hand after backward raises before any
collective; the optimizer's own `zero_grad` ends the record (a step without backward then agrees by
the all-reduce). Recorded parameters still deep-copy and pickle (the record is not on them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from tests.harness import get_mesh, run_on_ranks
from veragged.optim import AdamW8bit, Muon


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16)

    def forward(self, x):
        x = self.b(torch.relu(self.a(x)))
        if dist.get_rank() == 0:  # rank 1 never reaches c
            x = self.c(x)
        return x.square().mean()


def _make(agreement: str):
    torch.manual_seed(0)
    net = _Net()
    mesh = get_mesh()
    for m in (net.a, net.b):
        veragged.fully_shard(m, mesh=mesh)
    veragged.fully_shard(net, mesh=mesh)  # c in the root's group, gathered by every rank
    mats = [p for n, p in net.named_parameters() if n.endswith("weight")]
    vecs = [p for n, p in net.named_parameters() if n.endswith("bias")]
    opts = [Muon(mats, lr=0.02, grad_agreement=agreement),
            AdamW8bit(vecs, lr=1e-2, min_8bit_size=1, grad_agreement=agreement)]
    return net, opts


def _batch(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 16, generator=g)


def _train(agreement: str, steps: int = 3):
    net, opts = _make(agreement)
    reduces = []
    for step in range(steps):
        net(_batch(step)).backward()
        with CommDebugMode() as comm:
            for opt in opts:
                opt.step()
        counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        reduces.append(counts.get("allreduce_", 0))
        for opt in opts:
            opt.zero_grad()
    # a step with no backward since the last zero_grad: no gradient anywhere, nothing moves
    before = [p.to_local().clone() for p in net.parameters()]
    with CommDebugMode() as comm:
        for opt in opts:
            opt.step()
    idle = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, net.parameters()))
    return {"params": [p.to_local().clone() for p in net.parameters()], "reduces": reduces,
            "idle_reduces": idle.get("allreduce_", 0), "idle_unchanged": unchanged}


def _hand_changes():
    out = {}
    for how in ("drop", "module_zero_grad"):
        net, opts = _make("auto")
        net(_batch(0)).backward()
        if how == "drop":
            net.a.weight.grad = None  # every rank drops it: the ranks agree, yet it raises
        else:
            net.zero_grad()  # the module's, not the optimizer's: the record still stands
        try:
            opts[0].step()
            out[how] = "stepped"
        except ValueError as err:
            out[how] = str(err)
    return out


def _copies_after_backward():
    """A recorded parameter still copies and pickles as before: the record is not on it."""
    import copy
    import io

    net, _ = _make("auto")
    net(_batch(0)).backward()
    p = net.a.weight
    buf = io.BytesIO()
    torch.save(p, buf)
    q = copy.deepcopy(p)
    return torch.equal(q.to_local(), p.to_local()) and buf.tell() > 0


def _job():
    return _train("auto"), _train("mesh"), _hand_changes(), _copies_after_backward()


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, 2, timeout=300)


def test_auto_takes_the_backward_verdict_without_all_reduce(results):
    for auto, mesh, *_ in results:
        assert auto["reduces"] == [0, 0, 0], auto["reduces"]
        assert all(n > 0 for n in mesh["reduces"]), mesh["reduces"]  # the presence all-reduce
        for a, b in zip(auto["params"], mesh["params"]):
            assert torch.equal(a, b)


def test_a_step_after_zero_grad_agrees_by_all_reduce(results):
    for auto, *_ in results:
        assert auto["idle_reduces"] > 0 and auto["idle_unchanged"], auto


def test_gradients_changed_by_hand_raise_before_any_collective(results):
    for _, _, hand, _ in results:
        for how in ("drop", "module_zero_grad"):
            assert "grad_agreement='mesh'" in hand[how], hand
            assert "fully_shard's backward left it a gradient on every rank" in hand[how], hand


def test_recorded_parameters_copy_and_pickle(results):
    assert all(r[3] for r in results)
