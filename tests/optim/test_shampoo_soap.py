"""veragged.optim.Shampoo and SOAP: one process against references written here from the papers'
equations, and distributed (veragged and torch fully_shard, gloo) against one process, bitwise."""

import math

import pytest
import torch

from veragged.optim import SOAP, Shampoo
from tests.harness import run_on_ranks

from matrix_cases import distributed_vs_one_process

# --- references from the equations -------------------------------------------------------------


def _inverse_root(a, root, eps):
    """(A + eps I)^(-1/root) for symmetric PSD A (eigenvalues shifted to >= 0 first)."""
    w, v = torch.linalg.eigh(a.double())
    w = w - torch.clamp(w.min(), max=0.0)
    return (v @ torch.diag((w + eps) ** (-1.0 / root)) @ v.T).float()


def _reference_shampoo(params, grads_seq, lr, b1, b2, eps, wd, dim, freq, start, gb2, geps):
    """Shampoo with Adam grafting per block (tiles of at most `dim`), Distributed Shampoo's
    order: factors, grafting state and first moment take G; roots (bias-corrected factors) at
    step `start` and on the later steps `freq` divides, used from `start` on; direction =
    L^-1/4 M_hat R^-1/4 scaled to the norm of Adam's M_hat / (sqrt(V_hat) + geps); decoupled
    decay added to the direction; p -= lr * direction."""
    states = [dict() for _ in params]
    for step, grads in enumerate(grads_seq, start=1):
        for p, g, s in zip(params, grads, states):
            if not s:
                s["m"], s["v"] = torch.zeros_like(p), torch.zeros_like(p)
                s["blocks"] = {}
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = gb2 * s["v"] + (1 - gb2) * g * g
            m_hat = s["m"] / (1 - b1**step)
            graft = m_hat / ((s["v"] / (1 - gb2**step)).sqrt() + geps)
            if p.ndim != 2:
                direction = graft
            else:
                direction = torch.empty_like(g)
                for i, rows in enumerate(torch.arange(p.shape[0]).split(dim)):
                    for j, cols in enumerate(torch.arange(p.shape[1]).split(dim)):
                        idx = (rows[:, None], cols[None, :])
                        gb, mb, grb = g[idx], m_hat[idx], graft[idx]
                        bl = s["blocks"].setdefault((i, j), {
                            "L": torch.zeros(len(rows), len(rows)),
                            "R": torch.zeros(len(cols), len(cols))})
                        bl["L"] = b2 * bl["L"] + (1 - b2) * gb @ gb.T
                        bl["R"] = b2 * bl["R"] + (1 - b2) * gb.T @ gb
                        if (step % freq == 0 and step > start) or step == start:
                            c = 1 - b2**step
                            bl["rl"] = _inverse_root(bl["L"] / c, 4, eps)
                            bl["rr"] = _inverse_root(bl["R"] / c, 4, eps)
                        if step < start:
                            direction[idx] = grb
                        else:
                            sd = bl["rl"] @ mb @ bl["rr"]
                            direction[idx] = sd * grb.norm() / (sd.norm() + 1e-16)
            with torch.no_grad():
                p.sub_(lr * (direction + wd * p))


def _reference_soap(params, grads_seq, lr, b1, b2, eps, wd, freq, dim):
    """SOAP in the reference's order (M rotated back and forth every step)."""
    states = [dict() for _ in params]

    def proj(x, q):
        x = q[0].T @ x if q[0] is not None else x
        return x @ q[1] if q[1] is not None else x

    def back(x, q):
        x = q[0] @ x if q[0] is not None else x
        return x @ q[1].T if q[1] is not None else x

    for grads in grads_seq:
        for p, g, s in zip(params, grads, states):
            sides = [n <= dim for n in p.shape] if p.ndim == 2 else [False]
            grams = [g @ g.T, g.T @ g] if p.ndim == 2 else [None]
            if not s:
                s.update(m=torch.zeros_like(p), v=torch.zeros_like(p), t=0)
                s["f"] = [(1 - b2) * gr if ok else None for gr, ok in zip(grams, sides)]
                s["q"] = [None if f is None else torch.linalg.eigh(f)[1].flip(1) for f in s["f"]]
                continue
            q = s["q"] + [None] * (2 - len(s["q"]))
            s["t"] += 1
            t = s["t"]
            gp = proj(g, q) if p.ndim == 2 else g
            s["m"] = b1 * s["m"] + (1 - b1) * gp
            s["v"] = b2 * s["v"] + (1 - b2) * gp * gp
            n = s["m"] / (s["v"].sqrt() + eps)
            n = back(n, q) if p.ndim == 2 else n
            with torch.no_grad():
                p.sub_(lr * math.sqrt(1 - b2**t) / (1 - b1**t) * n)
                p.sub_(lr * wd * p)
            if p.ndim != 2:
                continue
            m = back(s["m"], q)
            s["f"] = [None if f is None else b2 * f + (1 - b2) * gr for f, gr in zip(s["f"], grams)]
            if t % freq == 0:
                for i, f in enumerate(s["f"]):
                    if f is None:
                        continue
                    order = torch.argsort(torch.diag(s["q"][i].T @ f @ s["q"][i]), descending=True)
                    s["v"] = s["v"].index_select(i, order)
                    s["q"][i] = torch.linalg.qr(f @ s["q"][i][:, order])[0]
            s["m"] = proj(m, s["q"])


SHAPES = [(40, 24), (16, 45), (9,), (12, 7)]


def _run_pair(make, reference, steps=12):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    refs = [p.detach().clone() for p in ours]
    opt = make(ours)
    seq = [[torch.randn(s) for s in SHAPES] for _ in range(steps)]
    for grads in seq:
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
    reference(refs, seq)
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, refs)]


def test_shampoo_matches_the_equations_in_one_process():
    """Tiles of 16 (remainders on both dims), preconditioning from step 3 (roots at 3, 4, 6,
    ...), momentum off. Every tile's factors have full rank by step 3 (a singular factor's
    root would be decided by round-off eigenvalues against epsilon).
    Within fp32 round-off: the roots are float64 eigendecompositions on both sides; the rest
    is fp32 in a different association."""
    kw = dict(lr=0.01, betas=(0.9, 0.99), epsilon=1e-10, weight_decay=0.01,
              max_preconditioner_dim=16, precondition_frequency=2, start_preconditioning_step=3,
              graft_beta2=0.999, graft_epsilon=1e-8)
    rel = _run_pair(
        lambda ps: Shampoo(ps, **kw),
        lambda ps, seq: _reference_shampoo(ps, seq, 0.01, 0.9, 0.99, 1e-10, 0.01, 16, 2, 3,
                                           0.999, 1e-8),
    )
    assert max(rel) < 2e-5, rel


def test_soap_matches_the_equations_in_one_process():
    """A side above max_precond_dim (45) stays unrotated; a 1-D parameter takes Adam steps;
    refreshes every 3 steps."""
    rel = _run_pair(
        lambda ps: SOAP(ps, lr=0.01, precondition_frequency=3, max_precond_dim=30),
        lambda ps, seq: _reference_soap(ps, seq, 0.01, 0.95, 0.95, 1e-8, 0.01, 3, 30),
    )
    assert max(rel) < 2e-5, rel


@pytest.mark.parametrize("name", ["shampoo", "soap"])
@pytest.mark.parametrize(
    "kind,owners,pattern",
    [
        ("veragged", "lpt", "cycle"),
        ("veragged", "alpha", "all"),
        ("veragged", "replicated", "cycle"),
        ("torch", "lpt", "cycle"),
    ],
)
def test_distributed_equals_one_process_bitwise(name, kind, owners, pattern):
    """10 steps on 4 ranks (rank-asymmetric grad=None in "cycle"); the reference is the same
    optimizer on full parameters with the gradients one process would see. Bitwise: the owner
    runs the same kernels on the same whole matrix; the rest is elementwise on shards."""
    results = run_on_ranks(distributed_vs_one_process, 4,
                           args=(name, kind, 10, owners, pattern), timeout=240)
    for diffs, plans in results:
        assert max(diffs) == 0.0, diffs
    assert all(r[1] == results[0][1] for r in results)  # one plan on every rank
    if owners in ("lpt", "alpha"):
        assert len({o for pl in results[0][1] for o in pl[0]}) > 1  # the work is spread


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_hsdp_equals_one_process_bitwise(name):
    """A 2x2 (replicate, shard) mesh: each replica group has its own owners."""
    results = run_on_ranks(
        distributed_vs_one_process, 4, mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard"),
        args=(name, "veragged", 6, "lpt", "cycle"), timeout=240,
    )
    for diffs, _ in results:
        assert max(diffs) == 0.0, diffs


def test_bad_arguments_name_the_argument():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    for kw, name in [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 0.0)}, "betas"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"precondition_frequency": 4, "start_preconditioning_step": 2},
         "start_preconditioning_step"),
        ({"owners": "random"}, "owners"),
        ({"grad_agreement": "world"}, "grad_agreement"),
    ]:
        with pytest.raises(ValueError, match=name):
            Shampoo(p, **kw)
    for kw, name in [
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"max_precond_dim": 0}, "max_precond_dim"),
        ({"precondition_frequency": 1.5}, "precondition_frequency"),
        ({"owners": "random"}, "owners"),
    ]:
        with pytest.raises(ValueError, match=name):
            SOAP(p, **kw)
    with pytest.raises(ValueError, match="2 dims or more"):
        Shampoo([{"params": [torch.nn.Parameter(torch.randn(4))], "precondition": True}])



def _train(name, kind, steps, **kw):
    """Real forward and backward on each rank's own batch under `kind`'s fully_shard; in the same
    process, the same optimizer (keywords `kw`) on a one-process copy fed the gradients the
    sharded run made."""
    import torch.distributed as dist

    from matrix_cases import CFG, FACTORIES, full_values, model
    from tests.harness import get_mesh

    m, ref_model = model(kind, get_mesh()), model("single", None)
    opt, ref = FACTORIES[name](m, **kw), FACTORIES[name](ref_model, **kw)
    params, ref_params = list(m.parameters()), list(ref_model.parameters())
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        batch = torch.randint(0, CFG.vocab, (2, CFG.max_seq), generator=g)
        m.loss(batch).backward()
        for p, q in zip(params, ref_params):
            q.grad = p.grad.full_tensor()
        opt.step()
        ref.step()
        opt.zero_grad()
    got = full_values(params)
    return [torch.equal(a, b) for a, b in zip(got, ref_params)], len(got)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_training_under_fully_shard_equals_one_process(name):
    """The user's path: 5 steps of real forward/backward on 4 ranks under veragged's and torch's
    fully_shard; each run's parameters equal one process stepping on its gradients, bitwise.
    The two runs are not compared with each other: their reduce-scatters over gloo sum the
    ranks' gradients in different orders (3e-8 apart after one backward), and inverse roots of
    the nearly singular factors of a 16-token batch amplify that to 1e-3 within 5 steps."""
    for kind in ("veragged", "torch"):
        equal, _ = run_on_ranks(_train, 4, args=(name, kind, 5), timeout=240)[0]
        assert all(equal), (kind, equal)
