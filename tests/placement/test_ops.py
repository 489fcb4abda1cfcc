"""Ops on RaggedShard DTensors (4 gloo ranks).

Covers element-wise ops, _foreach_* (also on lists mixing plain tensors), fused AdamW, norms and
errors.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh, run_on_ranks
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

WORLD = 4
SHAPES = [
    ((7, 13), RaggedShard((0, 1), (30, 0, 51, 10))),
    ((18, 5), RaggedShard((0,), (5, 0, 9, 4))),
    ((3, 4, 5), RaggedShard((), (0, 1, 0, 0))),
]


def _params(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape, _ in SHAPES], [
        torch.randn(shape, generator=g) for shape, _ in SHAPES
    ]


def _local(full, placement):
    numel, offset = placement.local_numel_and_offset(full.shape, dist.get_rank())
    return full.reshape(-1)[offset : offset + numel]


def _elementwise():
    mesh = get_mesh()
    fulls, others = _params()
    res = {}
    (shape, p), full, other = SHAPES[0], fulls[0], others[0]
    a = veragged.distribute_tensor(full, mesh, [p])
    b = veragged.distribute_tensor(other, mesh, [p])
    c = a * 2 + b
    res["binary"] = (
        type(c).__name__ == "RaggedDTensor"
        and c.placements == (p,)
        and torch.equal(c.full_tensor(), full * 2 + other)
    )
    d = a.clone()
    ret = d.mul_(3)
    res["inplace_returns_self"] = ret is d and torch.equal(d.full_tensor(), full * 3)
    res["scalar_tensor"] = torch.equal((a * torch.tensor(0.5)).full_tensor(), full * 0.5)
    rep_scalar = DTensor.from_local(torch.tensor(2.0), mesh, [Replicate()])
    res["replicate_scalar"] = torch.equal((a * rep_scalar).full_tensor(), full * 2)
    res["where"] = torch.equal(
        torch.where(a > 0, a, b).full_tensor(), torch.where(full > 0, full, other)
    )
    res["cast"] = a.to(torch.float64).dtype == torch.float64 and torch.equal(
        a.to(torch.float64).full_tensor(), full.double()
    )
    z = torch.zeros_like(a)
    res["zeros_like"] = z.placements == (p,) and torch.equal(z.full_tensor(), torch.zeros(shape))
    e = torch.empty_like(a).copy_(b)
    res["copy_"] = torch.equal(e.full_tensor(), other)
    res["metadata"] = (a.shape, a.dim(), a.numel(), a.size(1), a.dtype) == (
        torch.Size(shape),
        2,
        full.numel(),
        13,
        torch.float32,
    )
    da = [veragged.distribute_tensor(f, mesh, [q]) for f, (_, q) in zip(fulls, SHAPES)]
    db = [veragged.distribute_tensor(f, mesh, [q]) for f, (_, q) in zip(others, SHAPES)]
    torch._foreach_add_(da, db, alpha=0.25)
    torch._foreach_mul_(da, 3.0)
    res["foreach"] = all(
        torch.equal(x.full_tensor(), (f + 0.25 * o) * 3.0) for x, f, o in zip(da, fulls, others)
    )
    outs = torch._foreach_sqrt([x.abs() for x in da])
    res["foreach_out"] = all(o.placements == x.placements for o, x in zip(outs, da))
    return res


def test_elementwise_and_foreach_ops_run_on_local_shards():
    for res in run_on_ranks(_elementwise, WORLD, timeout=120):
        assert all(res.values()), res


def _optimizer(fused, foreach):
    """AdamW on RaggedShard parameters matches AdamW on the full tensors.

    Bit for bit for the foreach and for-loop paths. torch's fused CPU kernel computes the last
    `len % vector_width` elements of each tensor in a scalar loop that rounds differently from its
    vector loop, so where a shard boundary moves that split its results differ in the last bit.
    """
    mesh = get_mesh()
    fulls, grads = _params()
    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    params = [
        torch.nn.Parameter(veragged.distribute_tensor(f, mesh, [p]))
        for f, (_, p) in zip(fulls, SHAPES)
    ]
    opt_ref = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, fused=fused, foreach=foreach)
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=fused, foreach=foreach)
    for step in range(3):
        for r, x, g in zip(ref, params, grads):
            r.grad = g * (step + 1)
            x.grad = veragged.distribute_tensor(g * (step + 1), mesh, x.placements)
        opt_ref.step()
        opt.step()
    if fused:
        ok = all(
            torch.allclose(x.full_tensor(), r.detach(), rtol=1e-6, atol=0)
            for x, r in zip(params, ref)
        )
    else:
        ok = all(torch.equal(x.full_tensor(), r.detach()) for x, r in zip(params, ref))
    state = opt.state[params[0]]["exp_avg_sq"]
    ok &= isinstance(state, DTensor) and state.placements == params[0].placements
    return ok


@pytest.mark.parametrize("fused, foreach", [(True, False), (False, True), (False, False)])
def test_adamw_on_ragged_parameters_is_bit_exact(fused, foreach):
    assert all(run_on_ranks(_optimizer, WORLD, args=(fused, foreach), timeout=120))


def _norms():
    mesh = get_mesh()
    fulls, _ = _params()
    res = {}
    for (shape, p), full in zip(SHAPES, fulls):
        dt = veragged.distribute_tensor(full, mesh, [p])
        for ord in (2, 1, 3, math.inf, -math.inf, 0):
            got = torch.linalg.vector_norm(dt, ord)
            want = torch.linalg.vector_norm(full, ord)
            res[(shape, ord)] = got.placements == (Replicate(),) and torch.allclose(
                got.full_tensor(), want, rtol=1e-5
            )
    # clip_grad_norm_: the total norm is right and the gradients are scaled like torch's.
    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    params = [
        torch.nn.Parameter(veragged.distribute_tensor(f, mesh, [p]))
        for f, (_, p) in zip(fulls, SHAPES)
    ]
    for r, x in zip(ref, params):
        r.grad = r.detach() * 3
        x.grad = veragged.distribute_tensor(r.grad, mesh, x.placements)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    got = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    res["clip_total"] = torch.allclose(got.full_tensor(), want, rtol=1e-5)
    res["clip_grads"] = all(
        torch.allclose(x.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7)
        for x, r in zip(params, ref)
    )
    return res


def test_norms_and_clip_grad_norm_match_the_full_tensor():
    for res in run_on_ranks(_norms, WORLD, timeout=120):
        assert all(res.values()), res


def _raises(fn, exc, text):
    try:
        fn()
    except exc as e:
        return text in str(e) or str(e)
    return f"no {exc.__name__}"


def _unsupported_ops():
    mesh = get_mesh()
    full = torch.randn(6, 4)
    a = veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (1, 2, 0, 3))])
    b = veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (3, 0, 2, 1))])
    s0 = torch.distributed.tensor.distribute_tensor(full, mesh, [Shard(0)])
    x = veragged.distribute_tensor(
        full.clone().requires_grad_(), mesh, [RaggedShard((0,), (1, 2, 0, 3))]
    )
    return {
        # Reductions over a ragged-sharded dim work ([Note: reductions over ragged-sharded
        # dims]); prod over some dims still raises.
        "sum_dim": torch.allclose(a.sum(0).full_tensor(), full.sum(0), rtol=1e-6, atol=1e-6),
        "prod_dim": _raises(lambda: a.prod(0), NotImplementedError, "torch.prod"),
        "cumsum": _raises(lambda: a.cumsum(0), NotImplementedError, "aten.cumsum"),
        "view": _raises(lambda: a.view(4, 6), NotImplementedError, "aten.view"),
        "matmul": _raises(lambda: a @ full.T, (ValueError, NotImplementedError), "RaggedShard"),
        "norm_dim": torch.allclose(
            torch.linalg.vector_norm(a, dim=0).full_tensor(),
            torch.linalg.vector_norm(full, dim=0), rtol=1e-6, atol=0,
        ),
        "layouts": _raises(lambda: a + b, ValueError, "identical layouts"),
        "plain_tensor": _raises(lambda: a + full, ValueError, "implicit_replication"),
        "shard0": _raises(lambda: a + s0, ValueError, "0-dim tensors"),
        "random_values": _raises(lambda: torch.bernoulli(a), NotImplementedError, "bernoulli"),
        "autograd": _raises(lambda: x * 2, NotImplementedError, "autograd"),
        "async_method": _raises(
            lambda: a.redistribute(mesh, [Replicate()], async_op=True),
            ValueError,
            "veragged.redistribute",
        ),
    }


def test_unsupported_ops_raise_clear_errors():
    for res in run_on_ranks(_unsupported_ops, WORLD, timeout=120):
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, bad


def _mixed_lists():
    """`_foreach_*`/fused ops on lists mixing RaggedShard DTensors with plain tensors (FSDP next to
    replicate()), with ranks holding no element: the ragged positions run on the shards, the
    others as torch's op; checked against the same ops on full tensors."""
    mesh = init_device_mesh(rank_device_type(), (2,))
    g = torch.Generator().manual_seed(1)
    shapes = [(6, 4), (8, 8), (5,), (3, 3), (4, 2)]
    placements = [
        RaggedShard((0,), (1, 2)), None, RaggedShard((), (0, 1)), None, RaggedShard((0, 1), (8, 0))
    ]
    fulls = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]

    def shard(t, p):
        return t.clone() if p is None else veragged.distribute_tensor(t, mesh, [p])

    def full(x):
        return x.full_tensor() if isinstance(x, DTensor) else x.detach()

    res = {}
    # Adam steps inside implicit_replication(), as torch's FSDP tests with replicate() do.
    for kw in ({"foreach": True}, {"fused": True}):
        ref = [torch.nn.Parameter(f.clone()) for f in fulls]
        params = [torch.nn.Parameter(shard(f, p)) for f, p in zip(fulls, placements)]
        opt_ref = torch.optim.Adam(ref, lr=0.1, **kw)
        opt = torch.optim.Adam(params, lr=0.1, **kw)
        for step in range(3):
            for r, x, gr, p in zip(ref, params, grads, placements):
                r.grad = gr * (step + 1)
                x.grad = shard(r.grad, p)
            opt_ref.step()
            with implicit_replication():
                opt.step()
        rtol = 1e-6 if "fused" in kw else 0  # fused CPU kernel: see _optimizer
        res[f"adam.{kw}"] = all(
            torch.allclose(full(x), r.detach(), rtol=rtol, atol=0) for x, r in zip(params, ref)
        ) and all(isinstance(opt.state[x]["exp_avg"], DTensor) == (p is not None)
                  for x, p in zip(params, placements))
    xs = [shard(f, p) for f, p in zip(fulls, placements)]
    ys = [shard(f, p) for f, p in zip(grads, placements)]
    with implicit_replication():
        outs = torch._foreach_add(xs, ys, alpha=2.0)
        torch._foreach_mul_(outs, [1.0, 2.0, 3.0, 4.0, 5.0])  # a scalar list, split too
        norms = torch._foreach_norm(xs, 2)
    want = [(f + 2.0 * o) * (i + 1) for i, (f, o) in enumerate(zip(fulls, grads))]
    res["out_of_place"] = [type(o) for o in outs] == [type(x) for x in xs] and all(
        torch.equal(full(o), w) for o, w in zip(outs, want)
    )
    res["norm"] = all(
        (type(n) is DTensor) == (p is not None)
        and torch.allclose(full(n), torch.linalg.vector_norm(f), rtol=2e-6, atol=0)
        for n, f, p in zip(norms, fulls, placements)
    )
    # A torch Shard(0) DTensor at another position is torch's; no plain tensor, no context needed.
    s0 = torch.distributed.tensor.distribute_tensor(fulls[1], mesh, [Shard(0)])
    torch._foreach_mul_([xs[0], s0], 2.0)
    res["shard0"] = torch.equal(s0.full_tensor(), fulls[1] * 2)
    res["no_implicit_replication"] = _raises(
        lambda: torch._foreach_add_(xs, ys), RuntimeError, "implicit_replication()"
    )
    # a full-size plain tensor at a ragged position is cut to the local rows ([Note: replicated
    # operands of ragged ops]); xs[0] holds 2 * fulls[0] after the Shard(0) case above
    with implicit_replication():
        torch._foreach_add_([xs[0], xs[1]], [fulls[0], ys[1]])
    res["full_size_plain_at_ragged_position"] = (
        torch.equal(xs[0].full_tensor(), fulls[0] * 2 + fulls[0])
        and torch.equal(xs[1], fulls[1] + grads[1]))
    return res


def test_foreach_ops_on_lists_mixing_ragged_and_plain_tensors():
    for res in get_pool(2).run(_mixed_lists):
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, bad
