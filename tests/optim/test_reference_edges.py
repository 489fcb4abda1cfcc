"""Edge cases where the reference implementations (torch.optim.Muon, Meta's Distributed Shampoo,
nikhilvyas/SOAP, bitsandbytes) set the behaviour: complex parameters raise naming the parameter,
Shampoo's Nesterov momentum with dampening is Distributed Shampoo's, a non-finite factor keeps
the previous root (counted and warned, as Distributed Shampoo's tolerance does), and empty
matrices ((n, 0), (0, n), a stack of them) are skipped."""

import warnings

import pytest
import torch
import torch.nn as nn

from veragged.optim import SOAP, AdamW8bit, Muon, Shampoo

OPTIMIZERS = {"muon": Muon, "shampoo": Shampoo, "soap": SOAP, "adamw8bit": AdamW8bit}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_complex_parameters_raise_naming_the_parameter(name):
    real = nn.Parameter(torch.randn(4, 4))
    cplx = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="param.*1.*complex"):
        OPTIMIZERS[name]([real, cplx])
    opt = OPTIMIZERS[name]([real])
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group({"params": [cplx]})


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap"])
def test_empty_matrices_are_skipped(name):
    shapes = [(5, 0), (0, 5), (2, 5, 0), (3, 4)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = OPTIMIZERS[name](params, lr=0.01)
    before = params[3].detach().clone()
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    assert not torch.equal(params[3], before)  # the real matrix moved
    assert all(m.layout.numel > 0 for m in opt.matrices())


def test_shampoo_nesterov_with_dampening_is_distributed_shampoos():
    """Grafting only (no roots yet), so the direction is Adam's: check the momentum rule
    B = m B + (1 - d) P, dir = (1 - d) P + m B against a hand computation."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6))  # a vector: the grafting step alone, elementwise
    q = p.detach().clone()
    mu, d, lr = 0.9, 0.3, 0.1
    opt = Shampoo([p], lr=lr, betas=(0.0, 1.0), momentum=mu, dampening=d, use_nesterov=True,
                  graft_beta2=0.999, graft_epsilon=1e-10, use_bias_correction=True)
    buf = torch.zeros(6)
    v = torch.zeros(6)
    for t in range(1, 4):
        g = torch.randn(6)
        p.grad = g.clone()
        opt.step()
        v = v * 0.999 + 0.001 * g * g
        direction = g / ((v / (1 - 0.999**t)).sqrt() + 1e-10)
        buf = buf * mu + (1 - d) * direction
        q = q - lr * ((1 - d) * direction + mu * buf)
    assert torch.allclose(p.detach(), q, rtol=1e-6, atol=1e-7)


def test_shampoo_nonfinite_factor_keeps_the_root_counted():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 3))
    opt = Shampoo([p], lr=0.01, precondition_frequency=1, start_preconditioning_step=1)
    p.grad = torch.randn(4, 3)
    opt.step()  # roots from a finite factor
    root = opt.state[p]["root_left_0"].clone()
    p.grad = torch.full((4, 3), float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        opt.step()
    assert torch.equal(opt.state[p]["root_left_0"], root)  # the previous root stayed
    assert opt.root_failures == {"param 0 of group 0": 4}  # both sides, two steps
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "param 0 of group 0" in messages[0]
    assert "step 2" in messages[0]
