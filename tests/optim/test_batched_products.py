"""[Note: batched owner products]: same-shape owner products run batched only where that is
bitwise the one-by-one product, for Muon (Newton-Schulz), Shampoo (G G^T, G^T G,
L^-1/4 M R^-1/4) and SOAP (Q_L^T G Q_R, Q_L N Q_R^T, G G^T, G^T G). Either way every result is
bitwise what one matrix at a time gives; the verdicts say where batching happens here."""

import pytest
import torch
import torch.nn as nn

from veragged.optim import SOAP, Muon, Shampoo, batched

SHAPES = [(7, 5), (6, 10), (16, 12), (33, 17), (64, 48), (96, 192)]
DEVICE = torch.get_default_device()  # GPU 0 under VERAGGED_TEST_DEVICE=cuda
ON_CPU = DEVICE.type == "cpu"  # the claims about which kinds batch are MKL's


def _generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _chains_of(shape, n, g):
    r, c = shape
    out = []
    for _ in range(n):
        x, left, right = (torch.randn(r, c, generator=g), torch.randn(r, r, generator=g),
                          torch.randn(c, c, generator=g))
        out += [(x, x.T), (x.T, x), (left, x, right), (left.T, x, right), (left, x, right.T)]
    return out


@pytest.mark.parametrize("n", [2, 5])
def test_chains_are_bitwise_one_by_one(n):
    g = _generator(0)
    products = [c for shape in SHAPES for c in _chains_of(shape, n, g)]
    got = batched.chains(products)
    for c, r in zip(products, got):
        want = c[0]
        for x in c[1:]:
            want = want @ x
        assert torch.equal(r, want), [tuple(x.shape) for x in c]
    mine = {k: v for k, v in batched.verdicts().items() if k[1] == n}
    print({(k[0][0][0], k[1]): v for k, v in mine.items()})  # where it batches (-s shows it)
    assert any(mine.values()) or not ON_CPU, mine  # on MKL some kinds batch (and match)


def test_chains_results_start_aligned_and_odd_operands_run_alone():
    g = _generator(1)
    xs = [torch.randn(64, 48, generator=g) for _ in range(3)]
    got = batched.chains([(x, x.T) for x in xs])
    assert all(r.data_ptr() % batched.OPERAND_ALIGN_BYTES == 0 for r in got)  # as fresh ones
    assert all((r.data_ptr() - got[0].data_ptr()) % batched.STACK_ALIGN_BYTES == 0 for r in got)
    big = torch.randn(64, 96, generator=g)
    strided = big[:, :48]  # neither a matrix of its own nor the transpose of one
    got = batched.chains([(strided, xs[0].T), (xs[1], xs[0].T)])
    assert torch.equal(got[0], strided @ xs[0].T) and torch.equal(got[1], xs[1] @ xs[0].T)
    with pytest.raises(ValueError, match="product 0 has 1 operand"):
        batched.chains([(xs[0],)])


def _optimizer(name, params):
    if name == "muon":
        return Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    if name == "shampoo":  # tiles with remainders, roots from step 2 on
        return Shampoo(params, lr=0.01, betas=(0.9, 0.99), momentum=0.9,
                       max_preconditioner_dim=40, precondition_frequency=2,
                       start_preconditioning_step=2)
    return SOAP(params, lr=0.01, precondition_frequency=2, max_precond_dim=80)  # 96: one side


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap"])
@torch.no_grad()
def test_compute_many_equals_one_by_one(name):
    """The owner computing a micro-group of same-shape (and mixed) matrices at once gives each
    the update and state it gets alone, bitwise, over steps that refresh roots and bases."""
    torch.manual_seed(0)
    shapes = [(64, 48)] * 4 + [(7, 5)] * 3 + [(96, 64)] * 2 + [(48, 64)]
    values = [torch.randn(s) for s in shapes]
    together = [nn.Parameter(v.clone()) for v in values]
    alone = [nn.Parameter(v.clone()) for v in values]
    opt_together, opt_alone = _optimizer(name, together), _optimizer(name, alone)
    ms_together, ms_alone = opt_together.matrices(), opt_alone.matrices()
    g = _generator(1)
    for step in range(5):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for ps in (together, alone):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        fulls = [[opt._prepare(p, m.group, p.grad).reshape(-1) for p, m in zip(ps, ms)]
                 for opt, ps, ms in ((opt_together, together, ms_together),
                                     (opt_alone, alone, ms_alone))]
        outs_together = opt_together._compute_many(ms_together, fulls[0])
        outs_alone = [opt_alone._compute_aligned(m, f) for m, f in zip(ms_alone, fulls[1])]
        for i, (u, v) in enumerate(zip(outs_together, outs_alone)):
            assert (u is None) == (v is None)
            assert u is None or torch.equal(u, v), (name, step, i, shapes[i])
        for p, q in zip(together, alone):
            for key, value in opt_together.state[p].items():
                assert torch.equal(value, opt_alone.state[q][key]), (name, step, key)
        for opt, ps in ((opt_together, together), (opt_alone, alone)):
            for p in ps:
                opt._after_param(p)
    if name != "muon" and ON_CPU:  # (Muon's Newton-Schulz keeps its own verdicts)
        assert any(batched.verdicts().values())  # some of these products batched (MKL)
