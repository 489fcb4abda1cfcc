"""Vector norms of RaggedShard DTensors against torch's norm of the full tensor.

[Note: norms on RaggedShard] (veragged/placement/norms.py): over all dims a Replicate DTensor,
exact for inf/-inf/0 and when one rank holds everything (ord 1, 2), within a few ulps otherwise;
over dims after the ragged-sharded ones a RaggedShard DTensor, bitwise torch's. `_foreach_norm`
gives torch's partial placements (as on Shard DTensors) and `clip_grad_norm_` one all-reduce per
mesh dim. The checks run on the persistent gloo pools (2 and 4 ranks, a 2x2 mesh on 4), one job
per test.
"""

import math

import pytest
import torch
import torch.nn as nn
from test_ops_reductions_random import _cases  # the same layouts: empty ranks, whole tensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from veragged import RaggedShard, StridedRaggedShard
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

ORDS = (2, 1, 3, 0.5, -1, math.inf, -math.inf, 0)
funcol_all_reduce = torch.ops.c10d_functional.all_reduce
EXACT = (math.inf, -math.inf, 0)


def _subclass_dispatch_reached(mesh) -> bool:
    """Whether an aten op on a DTensor subclass, reached with torch functions off, calls the
    subclass's `__torch_dispatch__`. torch 2.11's C++ DTensor fast path serves every DTensor
    itself, subclasses included (torch's sharding propagation, which rejects RaggedShard), so
    there only `__torch_function__` reaches veragged's ops; later versions call the subclass."""
    reached = []

    class Probe(DTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            reached.append(func)
            return torch.zeros(1)

    local = torch.zeros(1)
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    probe = Probe(local, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta), requires_grad=False)
    with torch._C.DisableTorchFunctionSubclass():
        torch.ops.aten.alias.default(probe)
    return bool(reached)


def _raises(fn, exc, *texts):
    try:
        fn()
    except exc as e:
        return all(t in str(e) for t in texts) or str(e)
    return f"no {exc.__name__}"


def _replicated(got, want, exact, rtol=2e-6):
    """A Replicate DTensor holding `want` (bitwise if `exact`)."""
    ok = (
        type(got) is DTensor
        and all(isinstance(p, Replicate) for p in got.placements)
        and (got.shape, got.dtype) == (want.shape, want.dtype)
    )
    value = got.to_local()
    rtol = 0 if exact else rtol
    ok = ok and torch.allclose(value, want, rtol=rtol, atol=0, equal_nan=True)
    return ok or f"{value!r} != {want!r}"


def _ragged(got, want, placements):
    """A RaggedShard DTensor with `placements` holding bitwise `want`."""
    ok = (
        type(got).__name__ == "RaggedDTensor"
        and got.placements == tuple(placements)
        and (got.shape, got.dtype) == (want.shape, want.dtype)
        and torch.equal(got.full_tensor(), want)
    )
    return ok or f"{got.placements} {got.full_tensor()!r} != {want!r}"


def _one_d(world):
    mesh = init_device_mesh(rank_device_type(), (world,))
    g = torch.Generator().manual_seed(3)
    res = {}
    for shape, p in _cases(world):
        full = torch.randn(shape, generator=g)
        x = veragged.distribute_tensor(full, mesh, [p])
        one_holder = sum(u > 0 for u in p.local_units) == 1
        for ord in ORDS:
            want = torch.linalg.vector_norm(full, ord)
            exact = ord in EXACT or (one_holder and ord in (1, 2))
            res[f"full.{shape}.{ord}"] = _replicated(torch.linalg.vector_norm(x, ord), want, exact)
        nd, k = len(shape), len(p.dims)
        res[f"keepdim.{shape}"] = _replicated(
            torch.linalg.vector_norm(x, 3, tuple(range(nd)), keepdim=True),
            torch.linalg.vector_norm(full, 3, tuple(range(nd)), keepdim=True), False,
        )
        res[f"dtype.{shape}"] = _replicated(
            torch.linalg.vector_norm(x, dtype=torch.float64),
            torch.linalg.vector_norm(full, dtype=torch.float64), False, 1e-13,
        )
        res[f"bf16.{shape}"] = _replicated(
            torch.linalg.vector_norm(x.bfloat16(), 1),
            torch.linalg.vector_norm(full.bfloat16(), 1), False, 1e-2,
        )
        res[f"complex.{shape}"] = _replicated(
            torch.linalg.vector_norm(x * (1 + 2j)), torch.linalg.vector_norm(full * (1 + 2j)),
            False,
        )
        # Composites built on the vector norm.
        res[f"linalg.norm.{shape}"] = _replicated(
            torch.linalg.norm(x), torch.linalg.norm(full), one_holder
        )
        res[f"Tensor.norm.{shape}"] = _replicated(x.norm(p=1), full.norm(p=1), one_holder)
        res[f"torch.norm.fro.{shape}"] = _replicated(
            torch.norm(x, "fro"), torch.norm(full, "fro"), one_holder
        )
        res[f"aten.{shape}"] = _replicated(
            torch.ops.aten.linalg_vector_norm.default(x, math.inf),
            torch.linalg.vector_norm(full, math.inf), True,
        )
        if nd == 2:
            res[f"matrix_norm.fro.{shape}"] = _replicated(
                torch.linalg.matrix_norm(x), torch.linalg.matrix_norm(full), one_holder
            )
            res[f"matrix_norm.nuc.{shape}"] = _raises(
                lambda: torch.linalg.norm(x, "nuc"), NotImplementedError, "matrix norms"
            )
        # Over the dims after the ragged-sharded ones: RaggedShard rows, torch's values.
        if k < nd:
            for ord in ORDS:
                res[f"dim.{shape}.{ord}"] = _ragged(
                    torch.linalg.vector_norm(x, ord, dim=-1),
                    torch.linalg.vector_norm(full, ord, dim=-1), [p],
                )
            if k > 0:  # (k = 0 reduces every dim: the full norm)
                trailing = tuple(range(k, nd))
                res[f"dims_keepdim.{shape}"] = _ragged(
                    torch.linalg.vector_norm(x, dim=trailing, keepdim=True),
                    torch.linalg.vector_norm(full, dim=trailing, keepdim=True), [p],
                )
            res[f"dim_dtype.{shape}"] = _ragged(
                torch.linalg.vector_norm(x, 1, -1, dtype=torch.float64),
                torch.linalg.vector_norm(full, 1, -1, dtype=torch.float64), [p],
            )
            res[f"Tensor.norm.dim.{shape}"] = _ragged(x.norm(dim=nd - 1), full.norm(dim=nd - 1), [p])
            if _subclass_dispatch_reached(mesh):
                with torch._C.DisableTorchFunctionSubclass():  # the aten op below linalg.norm
                    below = torch.linalg.norm(x, dim=-1)
                res[f"dispatch.dim.{shape}"] = _ragged(below, torch.linalg.norm(full, dim=-1), [p])
        if k > 0 and nd > 1:  # (a 1-D tensor's dim 0 is every dim: the full norm)
            # A ragged-sharded dim: a Replicate result ([Note: reductions over ragged-sharded
            # dims]; test_reductions_over_ragged_dims.py covers it).
            res[f"ragged_dim.{shape}"] = _replicated(
                torch.linalg.vector_norm(x, dim=k - 1),
                torch.linalg.vector_norm(full, dim=k - 1), False,
            )
    res.update(_special_values(mesh, world))
    res.update(_foreach_and_clip(mesh, world))
    return res


def _special_values(mesh, world):
    res = {}
    shape, p = _cases(world)[0]
    full = torch.randn(shape)
    # NaN in the last rank's shard: every norm but ord=0 is NaN, as in torch.
    nan = full.clone()
    nan.view(-1)[-1] = math.nan
    xn = veragged.distribute_tensor(nan, mesh, [p])
    for ord in ORDS:
        res[f"nan.{ord}"] = _replicated(
            torch.linalg.vector_norm(xn, ord), torch.linalg.vector_norm(nan, ord), ord in EXACT
        )
    # Zeros: negative ord gives 0, -inf gives 0.
    zeros = full.clone()
    zeros.view(-1)[::7] = 0
    xz = veragged.distribute_tensor(zeros, mesh, [p])
    for ord in (-1, -math.inf, 0):
        res[f"zeros.{ord}"] = _replicated(
            torch.linalg.vector_norm(xz, ord), torch.linalg.vector_norm(zeros, ord), True
        )
    # No element anywhere: ord 2 gives 0, inf raises torch's own error.
    empty = torch.zeros(0, 5)
    xe = veragged.distribute_tensor(empty, mesh, [RaggedShard((0,), (1,) * world)])
    res["empty.2"] = _replicated(torch.linalg.vector_norm(xe), torch.linalg.vector_norm(empty), True)
    res["empty.inf"] = _raises(lambda: torch.linalg.vector_norm(xe, math.inf), RuntimeError, "inf")
    xi = veragged.distribute_tensor(torch.ones(shape, dtype=torch.int64), mesh, [p])
    res["int"] = _raises(lambda: torch.linalg.vector_norm(xi), RuntimeError, "floating point")
    x = veragged.distribute_tensor(full, mesh, [p])
    res["out"] = _raises(
        lambda: torch.linalg.vector_norm(x, out=torch.empty(())), NotImplementedError, "out="
    )
    leaf = nn.Parameter(veragged.distribute_tensor(full, mesh, [p]))
    res["grad"] = _raises(lambda: torch.linalg.vector_norm(leaf), NotImplementedError, "no_grad")
    with torch.no_grad():
        res["no_grad"] = _replicated(
            torch.linalg.vector_norm(leaf, math.inf), torch.linalg.vector_norm(full, math.inf), True
        )
    return res


def _torch_norm_placements(mesh, placements, ord):
    """The placements of torch's `_foreach_norm` of a DTensor sharded (Shard, every rank holding
    elements) where `placements` shard, and replicated where they replicate."""
    shards = [p if isinstance(p, Replicate) else Shard(j) for j, p in enumerate(placements)]
    probe = torch.distributed.tensor.distribute_tensor(torch.ones([4] * mesh.ndim), mesh, shards)
    return torch._foreach_norm([probe], ord)[0].placements


def _partial_norm(got, x, full, ord, dtype=None, rtol=5e-6):
    """`_foreach_norm` output `got` of RaggedShard `x`: a 0-dim torch DTensor with torch's
    placements, holding torch's norm of this rank's shard (the identity on an empty shard:
    inf for ord < 0, else 0) and reducing to torch's norm of `full`."""
    local = x.to_local()
    if local.numel():
        want_local = torch._foreach_norm([local], ord, dtype=dtype)[0]
    else:
        out_dtype = dtype or full.dtype.to_real()
        want_local = torch.tensor(math.inf if ord < 0 else 0.0, dtype=out_dtype)
    want = torch.linalg.vector_norm(full, ord, dtype=dtype)
    ok = (
        type(got) is DTensor
        and got.placements == _torch_norm_placements(x.device_mesh, x.placements, ord)
        and (got.shape, got.dtype) == (torch.Size([]), want.dtype)
        and torch.equal(got.to_local(), want_local)
    )
    value = got.full_tensor()
    rtol = 0 if ord in EXACT else rtol
    ok = ok and torch.allclose(value, want, rtol=rtol, atol=0)
    return ok or f"{got.placements} {got.to_local()!r} {value!r} != {want_local!r} {want!r}"


def _clip(mesh, fulls, placements, norm_type, foreach):
    """clip_grad_norm_ on RaggedShard gradients against torch on the full ones; with foreach,
    one functional all-reduce per sharded mesh dim and nothing else (torch's count for Shard)."""
    ref = [nn.Parameter(f.clone()) for f in fulls]
    params = [
        nn.Parameter(veragged.distribute_tensor(f, mesh, p)) for f, p in zip(fulls, placements)
    ]
    for r, x, p in zip(ref, params, placements):
        r.grad = r.detach() * 3
        x.grad = veragged.distribute_tensor(r.grad, mesh, p)
    want = nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    comm = CommDebugMode()
    with comm:
        got = nn.utils.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type, foreach=foreach)
    rtol = 0 if norm_type == math.inf else 2e-6
    ok = torch.allclose(got.full_tensor(), want, rtol=rtol) and all(
        torch.allclose(x.grad.full_tensor(), r.grad, rtol=2e-6, atol=1e-7)
        for x, r in zip(params, ref)
    )
    if foreach:
        counts = comm.get_comm_counts()
        sharded = sum(any(not p[j].is_replicate() for p in placements) for j in range(mesh.ndim))
        ok = ok and counts == {funcol_all_reduce: sharded}
        return ok or f"{counts} {got.placements} {got.full_tensor()} != {want}"
    return ok or f"{got.full_tensor()} != {want}"


def _foreach_and_clip(mesh, world):
    """`_foreach_norm`: per tensor this rank's norm, partial like torch's on Shard DTensors (no
    communication); clip_grad_norm_ reduces the total once per mesh dim."""
    res = {}
    fulls = [torch.randn(shape) for shape, _ in _cases(world)]
    placements = [[p] for _, p in _cases(world)]
    xs = [veragged.distribute_tensor(f, mesh, p) for f, p in zip(fulls, placements)]
    for ord in ORDS:
        comm = CommDebugMode()
        with comm:
            got = torch._foreach_norm(xs, ord)
        res[f"foreach.comm.{ord}"] = comm.get_total_counts() == 0
        for i, (a, x, f) in enumerate(zip(got, xs, fulls)):
            res[f"foreach.{i}.{ord}"] = _partial_norm(a, x, f, ord)
    for i, (a, x, f) in enumerate(zip(torch._foreach_norm(xs, 2, dtype=torch.float64), xs, fulls)):
        res[f"foreach.dtype.{i}"] = _partial_norm(a, x, f, 2, torch.float64, 1e-13)
    bf16 = [x.bfloat16() for x in xs]
    for i, (a, x, f) in enumerate(zip(torch._foreach_norm(bf16, 1), bf16, fulls)):
        res[f"foreach.bf16.{i}"] = _partial_norm(a, x, f.bfloat16(), 1, rtol=1e-2)
    # No element anywhere: torch's result (0) or error (inf), on every rank.
    xe = veragged.distribute_tensor(torch.zeros(0, 5), mesh, [RaggedShard((0,), (1,) * world)])
    res["foreach.empty.2"] = torch._foreach_norm([xe])[0].full_tensor().item() == 0
    res["foreach.empty.inf"] = _raises(
        lambda: torch._foreach_norm([xe], math.inf), RuntimeError, "inf"
    )
    leaf = nn.Parameter(xs[0].clone())
    res["foreach.grad"] = _raises(
        lambda: torch._foreach_norm([leaf]), NotImplementedError, "no_grad"
    )
    for norm_type in (2, 1, math.inf):
        for foreach in (True, False):
            res[f"clip.{norm_type}.{foreach}"] = _clip(mesh, fulls, placements, norm_type, foreach)
    return res


def _two_d():
    """2x2 mesh: the ragged split next to TP/EP Shard placements."""
    mesh = init_device_mesh(rank_device_type(), (2, 2))
    g = torch.Generator().manual_seed(7)
    res = {}

    def check(key, shape, placements, dim, want_placements, exact=True):
        full = torch.randn(shape, generator=g)
        x = veragged.distribute_tensor(full, mesh, placements)
        res[f"{key}.full"] = _replicated(
            torch.linalg.vector_norm(x), torch.linalg.vector_norm(full), False
        )
        res[f"{key}.inf"] = _replicated(
            torch.linalg.vector_norm(x, math.inf), torch.linalg.vector_norm(full, math.inf), True
        )
        for ord in ORDS:
            got = torch.linalg.vector_norm(x, ord, dim)
            want = torch.linalg.vector_norm(full, ord, dim)
            if exact or ord in EXACT:
                res[f"{key}.{ord}"] = _ragged(got, want, want_placements)
            else:
                res[f"{key}.{ord}"] = (
                    got.placements == tuple(want_placements)
                    and torch.allclose(got.full_tensor(), want, rtol=2e-6, atol=0)
                ) or f"{got.placements} {got.full_tensor()} != {want}"

    # FSDP over EP/TP (StridedRaggedShard): dim 0 stays cut by both; dim 1 is local.
    check("strided", (8, 3), [RaggedShard((0,), (1, 3)), Shard(0)], 1,
          [StridedRaggedShard((0,), (1, 3), 2), Shard(0)])
    # TP Shard(1) reduced: the tp ranks' partials are all-reduced and it becomes Replicate.
    check("tp_reduced", (4, 6), [RaggedShard((0,), (1, 1)), Shard(1)], 1,
          [RaggedShard((0,), (1, 1)), Replicate()], exact=False)
    # TP Shard(1) kept (dim 2 reduced), and renumbered when a dim before it goes.
    check("tp_kept", (4, 6, 5), [RaggedShard((0,), (3, 1)), Shard(1)], 2,
          [RaggedShard((0,), (3, 1)), Shard(1)])
    check("tp_renumbered", (4, 5, 6), [RaggedShard((0,), (1, 0)), Shard(2)], 1,
          [RaggedShard((0,), (1, 0)), Shard(1)])
    # The whole tensor on one dp rank per tp piece; reducing dim 0 removes the Shard(0).
    check("strided_dims0", (4, 3), [RaggedShard((), (1, 0)), Shard(0)], 0,
          [RaggedShard((), (1, 0)), Replicate()], exact=False)
    # HSDP: Replicate next to the RaggedShard.
    check("hsdp", (6, 5), [Replicate(), RaggedShard((0,), (0, 1))], -1,
          [Replicate(), RaggedShard((0,), (0, 1))])
    full = torch.randn(6, 5)
    x = veragged.distribute_tensor(full, mesh, [Shard(0), RaggedShard((0, 1), (4, 11))])
    got = torch.linalg.vector_norm(x, dim=1)  # a ragged-sharded dim, next to Shard(0)
    res["ragged_dims"] = (
        got.placements == (Shard(0), Replicate())
        and torch.allclose(got.full_tensor(), torch.linalg.vector_norm(full, dim=1), rtol=2e-6)
    ) or f"{got.placements}"
    # _foreach_norm and clip_grad_norm_ next to TP/EP (Shard) and HSDP (Replicate) mesh dims.
    fulls = [torch.randn(8, 3, generator=g), torch.randn(6, 5, generator=g),
             torch.randn(6, 5, generator=g)]
    placements = [[RaggedShard((0,), (1, 3)), Shard(0)], [Shard(0), RaggedShard((0, 1), (4, 11))],
                  [Replicate(), RaggedShard((0,), (0, 1))]]
    xs = [veragged.distribute_tensor(f, mesh, p) for f, p in zip(fulls, placements)]
    for ord in ORDS:
        for i, (a, x, f) in enumerate(zip(torch._foreach_norm(xs, ord), xs, fulls)):
            res[f"foreach.{i}.{ord}"] = _partial_norm(a, x, f, ord)
    for norm_type in (2, math.inf):
        res[f"clip.tp.{norm_type}"] = _clip(mesh, fulls[:2], placements[:2], norm_type, True)
        res[f"clip.hsdp.{norm_type}"] = _clip(mesh, fulls[2:], placements[2:], norm_type, True)
    local = torch.randn(3 if mesh.get_local_rank(1) else 9)
    partial = veragged.DTensor.from_local(
        local, mesh, [Partial(), RaggedShard((0,), (3, 1))], shape=(4, 3)
    )
    res["foreach.partial"] = _raises(
        lambda: torch._foreach_norm([partial]), NotImplementedError, "Partial"
    )
    return res


def _check(results):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, (rank, bad)


@pytest.mark.parametrize("world", [2, 4])
def test_norms_match_the_full_tensor_on_a_1d_mesh(world):
    _check(get_pool(world).run(_one_d, world))


def test_norms_next_to_shard_placements_on_a_2x2_mesh():
    _check(get_pool(4).run(_two_d))
