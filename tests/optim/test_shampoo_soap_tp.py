"""Shampoo and SOAP on FSDP x TP parameters ((dp, tp) and HSDP (replicate, dp, tp) meshes) against
the same optimizer on the full tensors in one process, bitwise. A matrix cut by dp and tp has its
owner among the dp x tp ranks, and its owner state lives on the flattened domain mesh
([Note: owner-resident state]); the placements are those of test_muon_tp's cases."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from veragged.optim import SOAP, Shampoo
from tests.harness.pool import get_pool

import tp_cases
from test_muon_tp import CASES

MAKERS = {
    "shampoo": lambda groups, **kw: Shampoo(groups, lr=0.01, betas=(0.9, 0.99),
                                            max_preconditioner_dim=5, precondition_frequency=2,
                                            **kw),
    "soap": lambda groups, **kw: SOAP(groups, lr=0.01, max_precond_dim=8,
                                      precondition_frequency=2, **kw),
}


def _groups(params):
    matrices = [p for p, (_, _, _, kind) in zip(params, CASES) if kind != "adamw"]
    rest = [p for p, (_, _, _, kind) in zip(params, CASES) if kind == "adamw"]
    return [{"params": matrices}, {"params": rest, "precondition": False}]


def _train(name, mesh_kind, owners, steps):
    mesh = tp_cases.mesh_of(mesh_kind)
    gen = torch.Generator().manual_seed(3)
    fulls = [torch.randn(shape, generator=gen) for _, shape, _, _ in CASES]
    params = [tp_cases.place(f, mesh, pl) for f, (_, _, pl, _) in zip(fulls, CASES)]
    refs = [nn.Parameter(f.clone()) for f in fulls]
    opt = MAKERS[name](_groups(params), owners=owners, grad_agreement="mesh")
    ref = MAKERS[name](_groups(refs))
    present = tp_cases.pattern("cycle")
    for step in range(steps):
        for q, g in zip(refs, tp_cases.set_grads(params, step, present)):
            q.grad = g
        opt.step()
        ref.step()
    got = tp_cases.full_tensors(params)
    equal = {n: bool(torch.equal(a, b.detach())) for (n, *_), a, b in zip(CASES, got, refs)}
    held = [v._local_tensor.numel() for st in opt.state.values() for k, v in st.items()
            if isinstance(v, DTensor) and k.startswith(("factor", "basis"))]
    return equal, held


@pytest.mark.parametrize("name", ["shampoo", "soap"])
@pytest.mark.parametrize("owners", ["lpt", "replicated"])
def test_fsdp_x_tp_equals_one_process_bitwise(name, owners):
    for equal, _ in get_pool(4).run(_train, name, "2d", owners, 6):
        assert all(equal.values()), equal


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_hsdp_x_tp_equals_one_process_bitwise(name):
    results = get_pool(8).run(_train, name, "3d", "lpt", 4, timeout=300)
    for equal, _ in results:
        assert all(equal.values()), equal
