"""Expert stacks in Muon, Shampoo and SOAP ([Note: matrices of a stack]): a parameter
[E, out, in] is E matrices, each updated as that expert alone as a 2-D parameter would be,
bitwise; under veragged.fully_shard (experts whole on a rank, or cut by the planner), under
FSDP x EP, through DCP from 4 ranks to 2, and with the locality-aware owner plan, which computes
an expert where it lies and moves none of its bytes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import veragged
from veragged.optim import SOAP, Muon, Shampoo
from tests.harness import get_mesh, run_on_ranks
from tests.harness.grads import set_grads
from veragged.models.moe import MoE, MoEConfig, expert_parallel
from veragged.tools.peer_traffic import PeerTraffic

from matrix_cases import full_values, grads_to, load_checkpoint, save_checkpoint

CFG = MoEConfig(vocab=48, dim=16, layers=2, heads=2, experts=4, top_k=2, hidden=12)
NAMES = ["muon", "shampoo", "soap"]


def _optimizer(name, params, **kw):
    if name == "muon":
        return Muon(params, lr=0.02, weight_decay=0.1, **kw)
    if name == "shampoo":  # tiles with remainders, momentum, roots from step 2 on
        return Shampoo(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01, momentum=0.9,
                       max_preconditioner_dim=10, precondition_frequency=2,
                       start_preconditioning_step=2, **kw)
    return SOAP(params, lr=0.01, weight_decay=0.01, precondition_frequency=2, max_precond_dim=14,
                **kw)


# ---- one process: a stack is its matrices -------------------------------------------------------


@pytest.mark.parametrize("dims", [(-2, -1), (-1, -2)], ids=["rows_cols", "transposed"])
@pytest.mark.parametrize("name", NAMES)
def test_stack_equals_separate_matrices(name, dims):
    """[3, 5, 7] (or stored transposed, [3, 7, 5] with matrix_dims=(-1, -2), as GPT-OSS keeps
    [E, in, out]) against three 5 x 7 parameters, over steps that refresh roots and bases."""
    torch.manual_seed(0)
    transposed = dims == (-1, -2)
    w = torch.randn(3, 7, 5) if transposed else torch.randn(3, 5, 7)

    def matrix(t, e):
        return (t[e].T if transposed else t[e]).contiguous()

    stack = nn.Parameter(w.clone())
    singles = [nn.Parameter(matrix(w, e)) for e in range(3)]
    opt_stack = _optimizer(name, [{"params": [stack], "matrix_dims": dims}])
    opt_singles = _optimizer(name, singles)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        grad = torch.randn(w.shape, generator=g)
        stack.grad = grad.clone()
        for e, p in enumerate(singles):
            p.grad = matrix(grad, e)
        opt_stack.step()
        opt_singles.step()
    for e, p in enumerate(singles):
        assert torch.equal(matrix(stack.detach(), e), p.detach()), e


def test_stack_options_are_checked():
    p = nn.Parameter(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="matrix_dims=\\(0, 1\\)"):
        Muon([{"params": [p], "matrix_dims": (0, 1)}])
    with pytest.raises(ValueError, match="split_sizes with matrix_dims=\\(-1, -2\\)"):
        Muon([{"params": [p], "matrix_dims": (-1, -2), "split_sizes": (2, 2)}])
    with pytest.raises(ValueError, match="split_sizes=\\[1, 1\\] repeated split_repeat=1 times"):
        Muon([{"params": [p], "split_sizes": (1, 1)}])
    # a conv kernel is a stack too by default: its group says otherwise
    conv = nn.Parameter(torch.randn(4, 3, 2, 2))
    opt = Muon([{"params": [conv], "use_muon": False}])
    assert "exp_avg" in opt.state[conv]


# ---- under fully_shard ------------------------------------------------------------------------


def whole_experts(fqn, p):
    """Each expert whole on one rank (a block per expert)."""
    return p[0].numel() if p.ndim == 3 else None


def cut_experts(fqn, p):
    """Experts cut anywhere between rows: the planner splits them across ranks."""
    return p.shape[-1] if p.ndim == 3 else None


GRANULARITIES = {"whole": whole_experts, "cut": cut_experts}


def _moe(kind, mesh=None, granularity=None):
    torch.manual_seed(0)
    m = MoE(CFG)
    if kind == "veragged":
        for block in m.blocks:
            veragged.fully_shard(block, mesh=mesh, granularity_fn=granularity)
        veragged.fully_shard(m, mesh=mesh, granularity_fn=granularity)
    return m


def _make(name, m, **kw):
    """Embedding and head elementwise, every other matrix and stack by the optimizer."""
    named = dict(m.named_parameters())
    flat = [p for n, p in named.items() if "embed" in n or "head" in n]
    rest = [p for p in named.values() if not any(p is q for q in flat)]
    flag = "use_muon" if name == "muon" else "precondition"
    return _optimizer(name, [{"params": flat, flag: False}, {"params": rest}], **kw)


def _expert_report(opt):
    """Per expert matrix: whether its owner holds it whole (its gather moves nothing)."""
    return [m.layout.size(m.owner) == m.layout.numel
            for m in opt.matrices() if m.index is not None and m.owner is not None]


def _train(name, granularity, owners, steps=5):
    m = _moe("veragged", get_mesh(), GRANULARITIES[granularity])
    ref_model = _moe("single")
    opt, ref = _make(name, m, owners=owners), _make(name, ref_model)
    params, ref_params = list(m.parameters()), list(ref_model.parameters())
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    equal = []
    for step in range(steps):
        tokens = torch.randint(0, CFG.vocab, (2, 9), generator=g)
        m.loss(tokens).backward()
        grads_to(ref_params, params)
        opt.step()
        ref.step()
        opt.zero_grad()
        equal.append(all(torch.equal(a, b) for a, b in zip(full_values(params), ref_params)))
    experts = [m for m in opt.matrices() if m.index is not None]
    return equal, _expert_report(opt), len(experts), [pl.moved for pl in opt.owner_plans]


@pytest.mark.parametrize("owners", ["lpt", "local"])
@pytest.mark.parametrize("granularity", ["whole", "cut"])
@pytest.mark.parametrize("name", NAMES)
def test_fully_shard_moe_equals_one_process(name, granularity, owners):
    """4 ranks, a real forward and backward per step; the one-process optimizer steps on the
    gradients the sharded run made, and every parameter matches bitwise after every step."""
    results = run_on_ranks(_train, 4, args=(name, granularity, owners), timeout=300)
    equal, at_home, n_experts, _ = results[0]
    assert all(equal), equal
    assert n_experts == 3 * CFG.experts * CFG.layers  # w1, w2, w3 of every layer, per expert
    if granularity == "whole" and owners == "local":
        if name == "muon":
            assert all(at_home), at_home  # every expert computed where it lies
        else:  # heavier cost models: a few experts may move for balance (the locality slack)
            assert sum(at_home) >= 0.75 * len(at_home), at_home
    if granularity == "cut":
        assert not all(at_home)  # experts cut across ranks travel


def _moved_bytes(owners):
    m = _moe("veragged", get_mesh(), whole_experts)
    opt = _make("muon", m, owners=owners)
    matrices = opt.matrices()
    experts = sum(mx.layout.numel - mx.layout.size(mx.owner)
                  for mx in matrices if mx.index is not None)
    return experts, [pl.moved for pl in opt.owner_plans]


def test_local_plan_moves_no_expert_bytes():
    """Experts planned whole: the locality-aware plan sends none of their elements, lpt does."""
    experts_local, moved_local = run_on_ranks(_moved_bytes, 4, args=("local",))[0]
    experts_lpt, moved_lpt = run_on_ranks(_moved_bytes, 4, args=("lpt",))[0]
    assert experts_local == 0
    assert experts_lpt > 0
    assert sum(moved_local) < sum(moved_lpt)


def _traffic(owners):
    m = _moe("veragged", get_mesh(), whole_experts)
    opt = _make("muon", m, owners=owners)
    m.loss(torch.randint(0, CFG.vocab, (2, 9))).backward()
    with PeerTraffic() as traffic:
        opt.step()
    return traffic.bytes, dict(traffic.by_op), [pl.bytes_per_step(4) for pl in opt.owner_plans]


@pytest.mark.parametrize("owners", ["lpt", "local"])
def test_plan_bytes_are_the_bytes_on_the_wire(owners):
    """The plan's bytes per step (2 x moved x 4 bytes, fp32 on the CPU) are what the step's
    all-to-alls receive from other ranks, summed over the ranks."""
    results = run_on_ranks(_traffic, 4, args=(owners,))
    measured = sum(r[0] for r in results)
    assert measured == sum(results[0][2]), results
    assert set(results[0][1]) <= {"alltoall_base_"}


# ---- FSDP x EP --------------------------------------------------------------------------------


def _train_ep(name, steps=4):
    mesh = get_mesh()
    dp = mesh._flatten("dp")
    m, ref_model = _moe("single"), _moe("single")
    expert_parallel(m, mesh["ep"])
    for block in m.blocks:
        veragged.fully_shard(block.moe.experts, mesh=mesh["dp_mod_ep"])
        block.moe.experts.set_gradient_divide_factor(dist.get_world_size())
        veragged.fully_shard(block, mesh=dp)
    veragged.fully_shard(m, mesh=dp)
    opt, ref = _make(name, m, owners="local"), _make(name, ref_model)
    params, ref_params = list(m.parameters()), list(ref_model.parameters())
    g = torch.Generator().manual_seed(200 + dist.get_rank())
    equal = []
    for _ in range(steps):
        m.loss(torch.randint(0, CFG.vocab, (2, 9), generator=g)).backward()
        grads_to(ref_params, params)
        opt.step()
        ref.step()
        opt.zero_grad()
        equal.append(all(torch.equal(a, b) for a, b in zip(full_values(params), ref_params)))
    return equal, len([x for x in opt.matrices() if x.index is not None])


@pytest.mark.parametrize("name", NAMES)
def test_fsdp_ep_experts_equal_one_process(name):
    results = run_on_ranks(_train_ep, 4, mesh_shape=(2, 2), mesh_dim_names=("dp_mod_ep", "ep"),
                           args=(name,), timeout=300)
    equal, n_experts = results[0]
    assert all(equal), equal
    assert n_experts == 3 * CFG.experts * CFG.layers


# ---- DCP: 4 ranks to 2 ------------------------------------------------------------------------


def _setup(name):
    m = _moe("veragged", get_mesh(), cut_experts)
    return m, _make(name, m, owners="local", grad_agreement="mesh")  # gradients by hand


def _step(m, opt, step):
    set_grads(list(m.parameters()), step, lambda i, r: (i + step) % 5 != 0)
    opt.step()


def _save(name, path):
    m, opt = _setup(name)
    for step in range(3):
        _step(m, opt, step)
    save_checkpoint(m, opt, path)
    for step in range(3, 6):
        _step(m, opt, step)
    keys = sorted(k for s in opt.state.values() for k in s if "[" in k)
    return full_values(list(m.parameters())), keys


def _load(name, path):
    m, opt = _setup(name)
    load_checkpoint(m, opt, path)
    for step in range(3, 6):
        _step(m, opt, step)
    return full_values(list(m.parameters()))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_dcp_save_on_4_load_on_2_resumes_bitwise(name, tmp_path):
    """Per-expert owner state (`factor_left_0[3]`, ...) saved by its owners on 4 ranks, read by
    its new owners on 2."""
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save, 4, args=(name, path), timeout=300)
    resumed = run_on_ranks(_load, 2, args=(name, path), timeout=300)
    uninterrupted, keys = saved[0]
    assert any(k.endswith("[3]") for k in keys), keys[:8]
    for a, b in zip(uninterrupted, resumed[0]):
        assert torch.equal(a, b)


# ---- hostile stacks: test_matrix_hostile.py's cases on [E, out, in] parameters --------------


class OddStacks(nn.Module):
    """A chain of stacks of odd matrices (each layer averages its experts' outputs): 1 x 7 and
    7 x 1 experts, a prime-sized stack, wide ones, one used only on even steps, a frozen one
    and stacks with no elements ([2, 0, 29], [2, 3, 0])."""

    SHAPES = {"inp": (3, 7, 5), "row": (2, 1, 7), "col": (3, 7, 1), "prime": (5, 13, 7),
              "wide": (2, 3, 13), "wide_t": (3, 29, 3), "rare": (2, 29, 29),
              "frozen": (2, 29, 29), "empty": (2, 0, 29), "empty_in": (2, 3, 0)}

    def __init__(self):
        super().__init__()
        for name, shape in self.SHAPES.items():
            setattr(self, name, nn.Parameter(torch.randn(shape) / shape[-1] ** 0.5))
        self.frozen.requires_grad_(False)

    @staticmethod
    def _apply_stack(w, h):
        return torch.einsum("eoi,ni->no", w, h) / w.shape[0]

    def forward(self, x, use_rare):
        f = self._apply_stack
        h = torch.tanh(f(self.inp, x))
        h = h * f(self.row, h)
        h = h + f(self.col, f(self.row, h))
        h = f(self.wide_t, torch.tanh(f(self.wide, torch.tanh(f(self.prime, h)))))
        if use_rare:
            h = torch.tanh(f(self.rare, h))
        h = f(self.frozen, h)
        return h.pow(2).mean() + f(self.empty, h).sum() + self.empty_in.sum()


class _Wrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = OddStacks()

    def forward(self, x, use_rare):
        return self.body(x, use_rare)


def _odd(kind, mesh):
    torch.manual_seed(0)
    m = _Wrap()
    if kind == "veragged":
        veragged.fully_shard(m.body, mesh=mesh, granularity_fn=lambda fqn, p: (
            p[0].numel() or None) if fqn.endswith(("prime", "rare")) else None)
        veragged.fully_shard(m, mesh=mesh)
    return m


def _train_odd(name, steps=6):
    m, ref_model = _odd("veragged", get_mesh()), _odd("single", None)
    params = [p for p in m.parameters() if p.requires_grad]
    ref_params = [p for p in ref_model.parameters() if p.requires_grad]
    opt, ref = _optimizer(name, params, owners="local"), _optimizer(name, ref_params)
    rank = dist.get_rank()
    opt.step()  # before any backward: nothing moves
    ref.step()
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        n = 0 if (rank == 1 and step % 3 == 0) else 3  # an empty batch on some steps
        x = torch.randn(n, 5, generator=g)
        loss = m(x, step % 2 == 0)
        loss = loss if n else loss * 0.0
        if step == 4:  # a second forward before one backward
            loss = loss + m(torch.randn(3, 5, generator=g), False)
        loss.backward()
        grads_to(ref_params, params)
        opt.step()
        ref.step()
        opt.zero_grad()
    got = full_values(list(m.parameters()))
    return [torch.equal(a, b) for a, b in zip(got, ref_model.parameters())]


@pytest.mark.parametrize("name", NAMES)
def test_hostile_stacks_equal_one_process(name):
    for equal in run_on_ranks(_train_odd, 3, args=(name,), timeout=240):
        assert all(equal), equal


# ---- batched Newton-Schulz ------------------------------------------------------------------


def test_batched_newton_schulz_is_bitwise_or_not_used():
    """[Note: batched Newton-Schulz]: each (shape, count) is batched only where a probe found
    the batched products bitwise equal to one-by-one ones; either way the results are bitwise
    orthogonalize's. On this CPU (MKL) the larger shapes batch and the tiny ones do not."""
    from veragged.optim import newton_schulz as ns

    torch.manual_seed(0)
    batched = {}
    for shape in [(7, 5), (6, 10), (16, 12), (96, 192), (192, 96), (64, 64)]:
        for n in (2, 5):
            xs = [torch.randn(shape) for _ in range(n)]
            got = ns.orthogonalize_batch(xs, dtype=torch.float32)
            for x, g in zip(xs, got):
                assert torch.equal(g, ns.orthogonalize(x, dtype=torch.float32)[0]), shape
            key = (shape, n, ns.DEFAULT_COEFFICIENTS, 5, 1e-7, torch.float32, x.device,
                   torch.get_num_threads())
            batched[shape, n] = ns._BATCHABLE[key]
    assert any(batched.values()), batched  # the batched path ran (and matched) somewhere
    # mixed shapes in one call: grouped by shape, order kept
    xs = [torch.randn(96, 192), torch.randn(7, 5), torch.randn(96, 192)]
    got = ns.orthogonalize_batch(xs, dtype=torch.float32)
    assert [tuple(g.shape) for g in got] == [(96, 192), (7, 5), (96, 192)]
