"""veragged.optim.Muon: against torch.optim.Muon in one process, and distributed (veragged
fully_shard and torch fully_shard parameters, gloo) against a single process, bitwise."""

import pytest
import torch
from torch.distributed.tensor import DTensor

from veragged.optim import Muon
from tests.harness import get_mesh, run_on_ranks

from matrix_cases import CFG, step_with_reference
from matrix_cases import model as build_model


def test_matches_torch_muon_and_adamw_in_one_process():
    torch.manual_seed(0)
    shapes = [(32, 16), (16, 48), (7, 5), (5,)]  # tall, wide, tiny; a vector for AdamW
    ours_p = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = Muon(
        [{"params": ours_p[:3]}, {"params": ours_p[3:], "lr": 1e-2}],
        lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16,
    )
    ref_muon = torch.optim.Muon(ref_p[:3], lr=0.02, weight_decay=0.1)
    ref_adamw = torch.optim.AdamW(ref_p[3:], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(10):
        for p, q in zip(ours_p, ref_p):
            q.grad = torch.randn(p.shape)
            p.grad = q.grad.clone()
        ours.step()
        ref_muon.step()
        ref_adamw.step()
    for p, q in zip(ours_p, ref_p):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
def test_adjust_lr_fns_and_expert_stacks_match_torch_muon(fn):
    """Every adjust_lr_fn of torch.optim.Muon, on a tall, a wide and a stack of three experts
    [3, 6, 10] (torch's Muon takes the experts as three 2-D parameters)."""
    torch.manual_seed(0)
    mats = [torch.randn(12, 4), torch.randn(4, 12)]
    stack = torch.randn(3, 6, 10)
    ours_p = [torch.nn.Parameter(t.clone()) for t in [*mats, stack]]
    ref_p = [torch.nn.Parameter(t.clone()) for t in [*mats, *stack]]
    try:
        ref = torch.optim.Muon(ref_p, lr=0.02, weight_decay=0.1, adjust_lr_fn=fn)
    except ValueError:
        pytest.skip(f"this torch's Muon has no adjust_lr_fn={fn!r}")
    ours = Muon(ours_p, lr=0.02, weight_decay=0.1, adjust_lr_fn=fn, ns_dtype=torch.bfloat16)
    for _ in range(4):
        grads = [torch.randn(p.shape) for p in ours_p]
        for p, g in zip(ours_p, grads):
            p.grad = g.clone()
        for q, g in zip(ref_p, [*grads[:2], *grads[2]]):
            q.grad = g.clone()
        ours.step()
        ref.step()
    assert torch.equal(ours_p[0], ref_p[0]) and torch.equal(ours_p[1], ref_p[1])
    for e in range(3):
        assert torch.equal(ours_p[2][e], ref_p[2 + e]), e


def test_split_sizes_orthogonalise_row_blocks_separately():
    """A fused (q; k; v) matrix with split_sizes == three matrices stepped by torch's Muon."""
    torch.manual_seed(0)
    sizes = (16, 8, 8)
    fused = torch.nn.Parameter(torch.randn(32, 16))
    parts = [torch.nn.Parameter(b.detach().clone()) for b in fused.split(sizes)]
    ours = Muon([{"params": [fused], "split_sizes": sizes}], lr=0.02, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(parts, lr=0.02)
    for _ in range(5):
        fused.grad = torch.randn(32, 16)
        for q, g in zip(parts, fused.grad.split(sizes)):
            q.grad = g.clone()
        ours.step()
        ref.step()
    assert torch.equal(fused.detach(), torch.cat([q.detach() for q in parts]))
    with pytest.raises(ValueError, match="split_sizes"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(10, 4))], "split_sizes": (3, 3)}])


def test_bad_arguments_name_the_argument():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    for kw, name in [
        ({"lr": -1.0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn"),
        ({"owners": "random"}, "owners"),
    ]:
        with pytest.raises(ValueError, match=name):
            Muon(p, **kw)
    with pytest.raises(ValueError, match="2 dims or more"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(4))], "use_muon": True}])


def _groups(model):
    """Embedding and head with AdamW, fused QKV split into q, k, v, the other matrices Muon."""
    named = dict(model.named_parameters())
    emb = [p for n, p in named.items() if "embed" in n or "head" in n]
    qkv = [p for n, p in named.items() if n.endswith("qkv.weight")]
    rest = [p for n, p in named.items() if not any(p is q for q in emb + qkv)]
    q = CFG.dim
    return [
        {"params": emb, "use_muon": False},
        {"params": qkv, "split_sizes": (q, q, q)},
        {"params": rest},
    ]


def _distributed(kind, steps, owners, pattern):
    """Muon on sharded parameters and, in the same process, on full ones with the gradients a
    single process would see; returns the largest difference per parameter and the plans."""
    model = build_model(kind, get_mesh())
    opt = Muon(_groups(model), lr=0.02, weight_decay=0.1, owners=owners, betas=(0.9, 0.95),
               grad_agreement="mesh")  # gradients dropped by hand on some ranks
    ref_model = build_model("single", None)
    ref = Muon(_groups(ref_model), lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    step_with_reference(opt, ref, params, ref_params, steps, pattern)
    got = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
    diffs = [(a - b).abs().max().item() for a, b in zip(got, ref_params)]
    plans = [(pl.owners, pl.groups, pl.ratio) for pl in opt.owner_plans]
    return diffs, plans


@pytest.mark.parametrize(
    "kind,owners,pattern",
    [
        ("veragged", "lpt", "all"),
        ("veragged", "lpt", "cycle"),
        ("veragged", "alpha", "all"),
        ("veragged", "naive", "cycle"),
        ("veragged", "replicated", "all"),
        ("torch", "lpt", "cycle"),
    ],
)
def test_distributed_equals_one_process_bitwise(kind, owners, pattern):
    """50 steps on 4 ranks; the reference is Muon on full parameters with the same gradients.

    Bitwise: momentum and AdamW are elementwise on the shards, and the owner runs Newton-Schulz
    on the same full matrix with the same kernels as the single process.
    """
    results = run_on_ranks(_distributed, 4, args=(kind, 50, owners, pattern), timeout=240)
    for diffs, plans in results:
        assert max(diffs) == 0.0, diffs
    assert all(r[1] == results[0][1] for r in results)  # one plan on every rank


def test_hsdp_equals_one_process_bitwise():
    """A 2x2 (replicate, shard) mesh: each replica group exchanges within itself."""
    results = run_on_ranks(
        _distributed, 4, mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard"),
        args=("veragged", 10, "lpt", "cycle"), timeout=240,
    )
    for diffs, _ in results:
        assert max(diffs) == 0.0, diffs


@pytest.mark.parametrize("layout", ["per_head_qkv", "gate_up_rows"])
def test_interleaved_splits_equal_separate_parameters(layout):
    """split_sizes with split_repeat: blocks whose rows interleave (per-head q, k, v as fused
    attention layouts keep them; gate and up alternating rows) against torch.optim.Muon on each
    block as a parameter of its own."""
    torch.manual_seed(0)
    if layout == "per_head_qkv":
        heads, hd, dim = 4, 3, 10
        sizes, repeat = (hd, hd, hd), heads
    else:
        sizes, repeat, dim = (1, 1), 9, 12
    rows = sum(sizes) * repeat
    fused = torch.nn.Parameter(torch.randn(rows, dim))

    def blocks(t):
        parts = t.view(repeat, sum(sizes), dim)
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        return [parts[:, a:a + s].reshape(repeat * s, dim) for a, s in zip(starts, sizes)]

    separate = [torch.nn.Parameter(b.detach().clone()) for b in blocks(fused)]
    ours = Muon([{"params": [fused], "split_sizes": sizes, "split_repeat": repeat}], lr=0.02,
                adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(separate, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for _ in range(4):
        fused.grad = torch.randn(rows, dim)
        for q, g in zip(separate, blocks(fused.grad)):
            q.grad = g.clone()
        ours.step()
        ref.step()
    for a, b in zip(blocks(fused.detach()), separate):
        assert torch.equal(a, b.detach())
    with pytest.raises(ValueError, match="split_repeat=2 times must cover"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(10, 4))], "split_sizes": (2, 2),
               "split_repeat": 2}])
    with pytest.raises(ValueError, match="split_repeat"):
        Muon([{"params": [fused], "split_sizes": sizes, "split_repeat": 0}])


def _interleaved_sharded():
    """Fused per-head q, k, v (4 heads of 3 rows each) cut by RaggedShard at every row
    boundary the planner picks, 4 ranks, a real forward and backward, against one process."""
    import veragged
    from tests.harness import get_mesh

    torch.manual_seed(0)
    sizes, repeat = (3, 3, 3), 4

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 36, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(36, 1, bias=False))

    m, ref_model = build(), build()
    veragged.fully_shard(m, mesh=get_mesh(), granularity_fn=lambda fqn, p: p.shape[-1])
    groups = lambda mod: [{"params": [mod[0].weight], "split_sizes": sizes,  # noqa: E731
                           "split_repeat": repeat}, {"params": [mod[2].weight]}]
    opt, ref = Muon(groups(m), lr=0.02), Muon(groups(ref_model), lr=0.02)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(4):
        m(torch.randn(5, 10, generator=g)).pow(2).mean().backward()
        for p, q in zip(m.parameters(), ref_model.parameters()):
            q.grad = p.grad.full_tensor()
        opt.step()
        ref.step()
        opt.zero_grad()
    return all(torch.equal(p.full_tensor(), q) for p, q in zip(m.parameters(),
                                                               ref_model.parameters()))


def test_interleaved_splits_sharded_equal_one_process():
    from tests.harness import run_on_ranks

    assert all(run_on_ranks(_interleaved_sharded, 4, timeout=120))
