"""Muon, Shampoo and SOAP as a hostile user drives them: real forward and backward under
veragged's and torch's fully_shard with odd shapes (1 x n, n x 1, a prime-sized matrix, a 0-row
one), frozen parameters, a layer used only on some steps, a rank whose batch is empty, two
forwards before one backward, a step before any backward, and a DCP save in the middle of the
run. Every run equals one process stepping on the gradients the sharded run made, bitwise."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import veragged
from veragged.optim import SOAP, Muon, Shampoo
from tests.harness import get_mesh, run_on_ranks

from matrix_cases import full_values, grads_to, load_checkpoint, save_checkpoint

SHAPES = {"row": (1, 7), "col": (7, 1), "prime": (13, 5), "wide": (3, 29), "empty": (0, 5)}


class Odd(nn.Module):
    """x -> [row, col, prime, wide, empty] as a chain of odd linear maps; `rare` only on even
    steps; `frozen` never trains."""

    def __init__(self, empty: bool):
        super().__init__()
        self.inp = nn.Linear(5, 7)  # 7 x 5 plus a bias
        self.row = nn.Linear(7, 1, bias=False)  # 1 x 7
        self.col = nn.Linear(1, 7, bias=False)  # 7 x 1
        self.prime = nn.Linear(7, 13, bias=False)
        self.wide = nn.Linear(13, 3, bias=False)
        self.wide_t = nn.Linear(3, 29, bias=False)  # 29 x 3
        self.rare = nn.Linear(29, 29)
        self.frozen = nn.Linear(29, 29)
        self.frozen.requires_grad_(False)
        # 0 x 29: no elements at all (torch's fully_shard cannot take it: its reduce-scatter's
        # _chunk_cat "expects non-empty tensor", torch 2.15)
        self.empty = nn.Linear(29, 0, bias=False) if empty else None

    def forward(self, x, use_rare):
        h = torch.tanh(self.inp(x))
        h = h * self.row(h)  # rank-1 path through the 1 x 7 and 7 x 1 matrices
        h = h + self.col(self.row(h))
        h = self.wide_t(torch.tanh(self.wide(torch.tanh(self.prime(h)))))
        if use_rare:
            h = torch.tanh(self.rare(h))
        h = self.frozen(h)
        out = h.pow(2).mean()
        return out + self.empty(h).sum() if self.empty is not None else out


def _model(kind, mesh, empty=True):
    torch.manual_seed(0)
    m = Odd(empty)
    if kind == "single":
        return m
    if kind == "veragged":
        shard = veragged.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    for name in ("prime", "rare", "frozen"):
        shard(getattr(m, name), mesh=mesh)
    shard(m, mesh=mesh)
    return m


def _optimizer(name, m):
    params = [p for p in m.parameters() if p.requires_grad]
    if name == "muon":
        return Muon(params, lr=0.02, weight_decay=0.1)
    if name == "shampoo":
        return Shampoo(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01,
                       max_preconditioner_dim=8, precondition_frequency=2,
                       start_preconditioning_step=2)
    return SOAP(params, lr=0.01, weight_decay=0.01, precondition_frequency=2, max_precond_dim=10)


def _batch(step, rank):
    # rank 1 has no data on every third step: an empty batch (its loss is 0 * sum, so its
    # gradients are zeros, and it still takes part in every collective)
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 0 if (rank == 1 and step % 3 == 0) else 3
    return torch.randn(n, 5, generator=g)


def _loss(m, x, step):
    out = m(x, use_rare=step % 2 == 0)
    return out if x.shape[0] else out * 0.0  # an empty batch's mean is nan


def _train(name, kind, steps):
    empty = kind != "torch"
    m, ref_model = _model(kind, get_mesh(), empty), _model("single", None, empty)
    opt, ref = _optimizer(name, m), _optimizer(name, ref_model)
    params, ref_params = list(m.parameters()), list(ref_model.parameters())
    rank = dist.get_rank()
    opt.step()  # before any backward: no gradients anywhere, nothing moves
    ref.step()
    for step in range(steps):
        x = _batch(step, rank)
        loss = _loss(m, x, step)
        if step == 4:  # a second forward before one backward
            loss = loss + _loss(m, _batch(step + 100, rank), step)
        loss.backward()
        grads_to(ref_params, params)
        opt.step()
        ref.step()
        opt.zero_grad()
    got = full_values(params)
    initial = dict(_model("single", None, empty).named_parameters())["frozen.weight"]
    frozen_unchanged = torch.equal(got[[n for n, _ in m.named_parameters()].index(
        "frozen.weight")], initial.detach())
    return [torch.equal(a, b) for a, b in zip(got, ref_params)], frozen_unchanged


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap"])
@pytest.mark.parametrize("kind", ["veragged", "torch"])
def test_odd_shapes_frozen_unused_empty_rank_second_forward(name, kind):
    results = run_on_ranks(_train, 3, args=(name, kind, 7), timeout=240)
    for equal, frozen_unchanged in results:
        assert all(equal), equal
        assert frozen_unchanged


def _run_with_save(name, path, save_at, steps, load):
    m = _model("veragged", get_mesh())
    opt = _optimizer(name, m)
    rank = dist.get_rank()
    start = 0
    if load:
        load_checkpoint(m, opt, path)
        start = save_at
    for step in range(start, steps):
        if step == save_at and not load:
            save_checkpoint(m, opt, path)
        _loss(m, _batch(step, rank), step).backward()
        opt.step()
        opt.zero_grad()
    return full_values(list(m.parameters()))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_save_in_the_middle_resumes_bitwise(name, tmp_path):
    """Saved after step 3 of 7 (Shampoo between two root computations, SOAP between two basis
    refreshes, the rare layer's state one step old), resumed in fresh processes."""
    path = str(tmp_path / "ckpt")
    straight = run_on_ranks(_run_with_save, 3, args=(name, path, 3, 7, False), timeout=240)
    resumed = run_on_ranks(_run_with_save, 3, args=(name, path, 3, 7, True), timeout=240)
    for a, b in zip(straight[0], resumed[0]):
        assert torch.equal(a, b)
