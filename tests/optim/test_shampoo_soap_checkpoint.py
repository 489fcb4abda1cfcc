"""Shampoo and SOAP state through DCP: saved on 4 ranks, loaded on 2 (a different owner plan, so
every factor moves to its new owner), resuming bitwise; and a plain state_dict round trip."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.harness import get_mesh, run_on_ranks
from tests.harness.grads import set_grads

from matrix_cases import FACTORIES, full_values, load_checkpoint, model, save_checkpoint


def _setup(name):
    m = model("veragged", get_mesh())
    return m, FACTORIES[name](m, grad_agreement="mesh")  # gradients dropped by hand


def _step(m, opt, step):
    # some parameters without a gradient on some steps, the same at any world size
    set_grads(list(m.parameters()), step, lambda i, r: (i + step) % 4 != 0)
    opt.step()


def _owner_state_report(opt):
    """Per factor, root or basis DTensor: this rank's local numel and the tensor's numel (the
    owner holds it whole, the others nothing)."""
    out = []
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, DTensor) and key.startswith(("factor", "root", "basis")):
                out.append((value._local_tensor.numel(), value.numel()))
    return out


def _save(name, path):
    m, opt = _setup(name)
    for step in range(5):
        _step(m, opt, step)
    save_checkpoint(m, opt, path)
    for step in range(5, 8):
        _step(m, opt, step)
    return full_values(list(m.parameters())), _owner_state_report(opt)


def _load(name, path):
    m, opt = _setup(name)
    load_checkpoint(m, opt, path)
    for step in range(5, 8):
        _step(m, opt, step)
    return full_values(list(m.parameters())), opt.owner_plans[0].owners


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_dcp_save_on_4_load_on_2_resumes_bitwise(name, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save, 4, args=(name, path), timeout=240)
    resumed = run_on_ranks(_load, 2, args=(name, path), timeout=240)
    uninterrupted, reports = saved[0][0], [r[1] for r in saved]
    for a, b in zip(uninterrupted, resumed[0][0]):
        assert torch.equal(a, b)
    # owner state lives whole on exactly one rank of the four
    for per_tensor in zip(*reports):
        assert sorted(n for n, _ in per_tensor) == [0, 0, 0, per_tensor[0][1]]


def _round_trip(name):
    m, opt = _setup(name)
    for step in range(4):
        _step(m, opt, step)
    sd = copy.deepcopy(opt.state_dict())
    m2, opt2 = _setup(name)
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(sd)
    for step in range(4, 7):
        _step(m, opt, step)
        _step(m2, opt2, step)
    return all(torch.equal(a, b) for a, b in zip(full_values(list(m.parameters())),
                                                   full_values(list(m2.parameters()))))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_state_dict_round_trip(name):
    assert all(run_on_ranks(_round_trip, 2, args=(name,), timeout=180))
