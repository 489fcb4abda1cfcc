"""Reductions with a `dim` on RaggedShard DTensors against torch on the full tensor.

[Note: reductions over ragged-sharded dims] (veragged/placement/ragged_dim_reduce.py): `sum`,
`mean`, `amax`, `amin`, `all`, `any` and `torch.linalg.vector_norm` over dims inside the ragged
rows (per-box partials, one all-reduce per combined mesh dim, a Replicate result) and after them
(a RaggedShard result), through the torch functions, Tensor methods and aten overloads (also via
`__torch_dispatch__`), keepdim both ways, on a 4-rank 1-D mesh and a 2x2 mesh next to Shard /
StridedRaggedShard / Replicate placements, with ranks holding no rows and one rank holding all.

`result.full_tensor()` must equal torch's op on the full tensor bitwise for amax/amin/all/any,
integer sums and the 0/inf/-inf norms (each partial is exact, and max/min/counts combine exactly
in any order). Float sums, means and p-norms are compared within 1e-6 relative: veragged adds the
partials in float64 and rounds once, torch adds float32 in its own order, so the two differ by
torch's round-off. For sums and means that tolerance is taken relative to the same reduction of
|x| (the terms' magnitude, what bounds any summation's round-off): random data can cancel to a
sum near zero, where an error relative to the result would be meaningless; norms add |x|^p > 0,
so there it is relative to the result. Each reduction over ragged rows must also run exactly one
all-reduce per combined mesh dim and no other collective (no gather of the input).

Many cases run in one spawned function per mesh; failures come back by name.
"""

import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh, run_on_ranks

aten = torch.ops.aten
TIMEOUT = 600  # shared machines; each spawn normally takes seconds
ORDS = (2, 1, 3, 0.5, -1, math.inf, -math.inf, 0)
EXACT_ORDS = (math.inf, -math.inf, 0)
RTOL = 1e-6


def _d(dims):
    return dims[0] if len(dims) == 1 else dims


# name -> entry points (t, dims, keepdim) -> result; run on the DTensor, cycled through cases.
ENTRIES = {
    "sum": (
        lambda t, d, k: torch.sum(t, _d(d), keepdim=k),
        lambda t, d, k: t.sum(dim=d, keepdim=k),
        lambda t, d, k: aten.sum.dim_IntList(t, list(d), k),
    ),
    "mean": (
        lambda t, d, k: t.mean(_d(d), keepdim=k),
        lambda t, d, k: torch.mean(t, d, k),
        lambda t, d, k: aten.mean.dim(t, list(d), k),
    ),
    "amax": (
        lambda t, d, k: torch.amax(t, d, k),
        lambda t, d, k: t.amax(_d(d), keepdim=k),
        lambda t, d, k: aten.amax.default(t, list(d), k),
    ),
    "amin": (
        lambda t, d, k: t.amin(d, k),
        lambda t, d, k: torch.amin(t, _d(d), keepdim=k),
        lambda t, d, k: aten.amin.default(t, list(d), k),
    ),
    "all": (
        lambda t, d, k: t.all(_d(d), keepdim=k),
        lambda t, d, k: torch.all(t, d, k),
        lambda t, d, k: aten.all.dim(t, d[0], k) if len(d) == 1 else aten.all.dims(t, list(d), k),
    ),
    "any": (
        lambda t, d, k: torch.any(t, _d(d), keepdim=k),
        lambda t, d, k: t.any(d, k),
        lambda t, d, k: aten.any.dim(t, d[0], k) if len(d) == 1 else aten.any.dims(t, list(d), k),
    ),
}
ATEN = {name: fns[2] for name, fns in ENTRIES.items()}


def _norm_entries(ord):
    return (
        lambda t, d, k: torch.linalg.vector_norm(t, ord, _d(d), k),
        lambda t, d, k: t.norm(ord, d, k),
        lambda t, d, k: aten.linalg_vector_norm.default(t, ord, list(d), k),
    )


def _dispatch_reached() -> bool:
    """Whether aten ops on a RaggedShard DTensor, torch functions off, reach its
    `__torch_dispatch__` (torch 2.11's C++ DTensor fast path serves subclasses itself)."""
    from test_norms import _subclass_dispatch_reached

    return _subclass_dispatch_reached(get_mesh())


def _want_placements(placements, mesh_dim, dims, keepdim, inside):
    """The result's placements on the non-ragged mesh dims (and the ragged one when inside)."""
    out = []
    for j, p in enumerate(placements):
        if j == mesh_dim:
            out.append(Replicate() if inside else None)
        elif type(p) is Shard:
            if p.dim in dims:
                out.append(Replicate())
            else:
                out.append(p if keepdim else Shard(p.dim - sum(r < p.dim for r in dims)))
        else:
            out.append(p)
    return out


def _compare(got, want, how, mag=None):
    """None if `got` (a DTensor) holds `want`; else a short reason."""
    if not isinstance(got, DTensor):
        return f"not a DTensor: {type(got).__name__}"
    value = got.full_tensor()
    if (value.shape, value.dtype) != (want.shape, want.dtype):
        return f"shape/dtype {list(value.shape)} {value.dtype} != {list(want.shape)} {want.dtype}"
    if how == "exact":
        ok = torch.equal(value, want) or (
            want.is_floating_point() and torch.equal(value.isnan(), want.isnan())
            and torch.equal(value.nan_to_num(), want.nan_to_num())
        )
    elif how == "magnitude":  # sums and means: relative to the reduction of |x|
        ok = bool(((value - want).abs() <= RTOL * mag + 1e-30).all())
    else:
        ok = torch.allclose(value, want, rtol=RTOL, atol=0, equal_nan=True)
    return None if ok else f"{value.flatten()[:6].tolist()} != {want.flatten()[:6].tolist()}"


def _run_cases(cases, seed):
    mesh = get_mesh()
    dispatch = _dispatch_reached()
    g = torch.Generator().manual_seed(seed)
    bad, count = {}, [0]

    def check(key, make, want, how, mag, placements, mesh_dim, dims, keepdim, k, combine_dims):
        count[0] += 1
        inside = dims[0] < k and want.numel() != 1
        comm = CommDebugMode()
        try:
            with comm:
                got = make()
        except Exception as e:  # noqa: BLE001 - reported by name
            bad[key] = f"{type(e).__name__}: {e}"[:300]
            return
        reason = _compare(got, want, how, mag)
        if reason is None and want.numel() != 1:
            expect = _want_placements(placements, mesh_dim, dims, keepdim, inside)
            for j, (p, e) in enumerate(zip(got.placements, expect)):
                if (e is None and not isinstance(p, RaggedShard)) or (e is not None and p != e):
                    reason = f"placements {got.placements}, want {expect}"
            if inside and type(got) is not DTensor:
                reason = f"{type(got).__name__}, want a torch DTensor"
        if reason is None and inside and ".dispatch." not in key:
            # (CommDebugMode, a dispatch mode, does not see inside a subclass's dispatch)
            counts = comm.get_comm_counts()
            want_counts = sum(mesh.size(j) > 1 for j in combine_dims(dims))
            if sum(counts.values()) != want_counts or any(
                    "all_reduce" not in str(op) and "allreduce" not in str(op) for op in counts):
                reason = f"collectives {dict(counts)}, want {want_counts} all-reduce(s)"
        if reason is not None:
            bad[key] = reason

    turn = 0
    for shape, given in cases:
        nd = len(shape)
        full = torch.randn(shape, generator=g)
        ints = torch.randint(-9, 10, shape, generator=g)
        bools = {"all": torch.randint(0, 6, shape, generator=g) > 0,
                 "any": torch.randint(0, 6, shape, generator=g) == 0}
        x = veragged.distribute_tensor(full, mesh, given)
        xi = veragged.distribute_tensor(ints, mesh, given)
        xb = {n: veragged.distribute_tensor(b, mesh, given) for n, b in bools.items()}
        placements = x.placements
        mesh_dim = next(j for j, p in enumerate(placements) if isinstance(p, RaggedShard))
        k = len(placements[mesh_dim].dims)

        def combine_dims(dims):
            return [j for j, p in enumerate(placements)
                    if j == mesh_dim or (type(p) is Shard and p.dim in dims)]

        pairs = [(a, b) for a in range(nd) for b in range(a + 1, nd)] if nd > 2 else []
        dim_sets = [(d,) for d in range(nd)] + pairs
        tag = f"{list(shape)}{placements}"
        for dims in dim_sets:
            for keepdim in (False, True):
                turn += 1
                sub = f"{tag}.dim{dims}.keep{int(keepdim)}"
                args = (placements, mesh_dim, dims, keepdim, k, combine_dims)
                plain = (placements, mesh_dim, dims, False, k, combine_dims)  # no keepdim given
                for name, fns in ENTRIES.items():
                    fn = fns[turn % len(fns)]
                    ref = getattr(torch, name)
                    if name in ("sum", "mean"):
                        want = ref(full, dims, keepdim)
                        mag = ref(full.abs(), dims, keepdim)
                        check(f"{sub}.{name}.f32.{turn % 3}", lambda: fn(x, dims, keepdim),
                              want, "magnitude", mag, *args)
                    elif name in ("amax", "amin"):
                        check(f"{sub}.{name}.f32.{turn % 3}", lambda: fn(x, dims, keepdim),
                              ref(full, dims, keepdim), "exact", None, *args)
                    if name in ("sum", "amax", "amin") and not keepdim:
                        check(f"{sub}.{name}.int64.{turn % 3}", lambda: fn(xi, dims, keepdim),
                              ref(ints, dims, keepdim), "exact", None, *args)
                    if name in ("all", "any"):
                        check(f"{sub}.{name}.bool.{turn % 3}",
                              lambda: fn(xb[name], dims, keepdim),
                              ref(bools[name], dims, keepdim), "exact", None, *args)
                        if not keepdim:
                            check(f"{sub}.{name}.int64.{turn % 3}",
                                  lambda: fn(xi, dims, keepdim), ref(ints, dims, keepdim),
                                  "exact", None, *args)
                for ord in ORDS[keepdim::2]:  # every ord per dims, half with keepdim
                    fn = _norm_entries(ord)[turn % 3]
                    want = torch.linalg.vector_norm(full, ord, dims, keepdim)
                    how = "exact" if ord in EXACT_ORDS else "close"
                    check(f"{sub}.norm{ord}.{turn % 3}", lambda: fn(x, dims, keepdim),
                          want, how, None, *args)
                if keepdim:  # dtype arguments
                    check(f"{sub}.sum.dtype64", lambda: torch.sum(x, dims, dtype=torch.float64),
                          torch.sum(full, dims, dtype=torch.float64), "magnitude",
                          torch.sum(full.abs(), dims, dtype=torch.float64), *plain)
                    check(f"{sub}.norm.dtype64",
                          lambda: torch.linalg.vector_norm(x, 3, dims, dtype=torch.float64),
                          torch.linalg.vector_norm(full, 3, dims, dtype=torch.float64), "close",
                          None, *plain)
                    check(f"{sub}.sum.bool", lambda: xb["all"].sum(dims),
                          bools["all"].sum(dims), "exact", None, *plain)
                    if dispatch:  # aten ops reaching RaggedDTensor.__torch_dispatch__
                        for name, fn in ATEN.items():
                            src, t = ((bools[name], xb[name]) if name in ("all", "any")
                                      else (full, x))
                            with torch._C.DisableTorchFunctionSubclass():
                                want = getattr(torch, name)(src, dims, True)
                            check(f"{sub}.dispatch.{name}", lambda: _no_tf(fn, t, dims),
                                  want, "magnitude" if name in ("sum", "mean") else "exact",
                                  getattr(torch, name)(src.abs(), dims, True)
                                  if name in ("sum", "mean") else None, *args)
                        check(f"{sub}.dispatch.norm",
                              lambda: _no_tf(_norm_entries(2)[2], x, dims),
                              torch.linalg.vector_norm(full, 2, dims, True), "close", None, *args)
    return bad, count[0]


def _no_tf(fn, t, dims):
    with torch._C.DisableTorchFunctionSubclass():
        return fn(t, dims, True)


def _special(seed):
    """NaN, an empty reduced dim, unsupported reductions and autograd."""
    mesh = get_mesh()
    bad = {}
    full = torch.randn(8, 5)
    full[4, 2] = math.nan
    p = RaggedShard((0, 1), (1,) * mesh.size(0))
    x = veragged.distribute_tensor(full, mesh, [p] + [Replicate()] * (mesh.ndim - 1))
    for name in ("amax", "amin", "sum"):
        got = getattr(torch, name)(x, 0).full_tensor()
        want = getattr(torch, name)(full, 0)
        if not torch.equal(got.isnan(), want.isnan()):
            bad[f"nan.{name}"] = f"{got} != {want}"
    got = torch.linalg.vector_norm(x, math.inf, 0).full_tensor()
    if not torch.equal(got.isnan(), torch.linalg.vector_norm(full, math.inf, 0).isnan()):
        bad["nan.norm_inf"] = str(got)
    empty = veragged.distribute_tensor(torch.zeros(0, 4), mesh, x.placements)
    got = empty.sum(0).full_tensor()
    if not torch.equal(got, torch.zeros(4)):
        bad["empty.sum"] = str(got)
    for key, fn, text in (
        ("empty.amax", lambda: empty.amax(0), "reduction"),
        ("prod", lambda: x.prod(0), "prod"),
        ("max_dim", lambda: x.max(0), "indices"),
        ("mean_int", lambda: x.long().mean(0), "mean"),
    ):
        try:
            fn()
            bad[key] = "no error"
        except (RuntimeError, NotImplementedError, IndexError) as e:
            if text not in str(e):
                bad[key] = str(e)
    if mesh.ndim == 2:  # a Partial(sum) mesh dim stays Partial for sum and mean only
        rep = veragged.distribute_tensor(full, mesh, [Replicate(), RaggedShard((0, 1), (3, 1))])
        scale = mesh.get_local_rank(0) + 1  # the two partial ranks hold 1x and 2x: 3x in all
        part = veragged.DTensor.from_local(rep.to_local() * scale, mesh,
                                           [Partial(), rep.placements[1]], shape=full.shape)
        for name in ("sum", "mean"):
            got = getattr(torch, name)(part, 0)
            want = getattr(torch, name)(full * 3, 0)
            if got.placements != (Partial(), Replicate()) or not torch.allclose(
                    got.full_tensor(), want, rtol=1e-6, atol=1e-6, equal_nan=True):
                bad[f"partial.{name}"] = f"{got.placements} {got.full_tensor()} != {want}"
        try:
            part.amax(0)
            bad["partial.amax"] = "no error"
        except NotImplementedError as e:
            if "Partial" not in str(e):
                bad["partial.amax"] = str(e)
    leaf = torch.nn.Parameter(veragged.distribute_tensor(full, mesh, x.placements))
    try:
        leaf.sum(0)
        bad["grad"] = "no error"
    except NotImplementedError as e:
        if "no_grad" not in str(e):
            bad["grad"] = str(e)
    return bad


def _one_d():
    cases = [
        ((6, 5), [RaggedShard((0,), (1, 0, 3, 2))]),
        ((7, 13), [RaggedShard((0, 1), (30, 0, 51, 10))]),
        ((4, 3, 5), [RaggedShard((0,), (0, 4, 0, 0))]),
        ((3, 4, 5), [RaggedShard((0, 1), (2, 1, 0, 3))]),
        ((2, 3, 4), [RaggedShard((0, 1, 2), (5, 0, 7, 12))]),
        ((3, 4, 5), [RaggedShard((0, 1, 2), (0, 0, 1, 0))]),
        ((3, 4, 5), [RaggedShard((), (0, 1, 0, 0))]),
    ]
    bad, count = _run_cases(cases, 11)
    bad.update(_special(12))
    return bad, count


def _two_d():
    cases = [
        ((4, 6), [RaggedShard((0,), (1, 3)), Shard(1)]),  # FSDP over TP (column)
        ((8, 3), [RaggedShard((0,), (1, 3)), Shard(0)]),  # StridedRaggedShard (FSDP over EP)
        ((4, 3, 5), [RaggedShard((0, 1), (2, 1)), Shard(0)]),  # strided, ragged dims (0, 1)
        ((5, 4), [RaggedShard((0,), (0, 1)), Shard(0)]),  # uneven Shard(0): one holder
        ((6, 5), [Shard(0), RaggedShard((0, 1), (4, 11))]),
        ((6, 5, 2), [Replicate(), RaggedShard((0, 1), (0, 1))]),  # HSDP, one holder
        ((4, 2, 6), [RaggedShard((0, 1), (3, 1)), Shard(2)]),
    ]
    bad, count = _run_cases(cases, 21)
    bad.update(_special(22))
    return bad, count


def _assert_all_pass(results):
    for rank, (bad, count) in enumerate(results):
        assert count > 500, count
        assert not bad, (rank, len(bad), dict(list(bad.items())[:20]))


def test_reductions_over_dims_on_a_1d_mesh():
    _assert_all_pass(run_on_ranks(_one_d, 4, timeout=TIMEOUT))


def test_reductions_over_dims_on_a_2x2_mesh():
    _assert_all_pass(run_on_ranks(_two_d, 4, mesh_shape=(2, 2), timeout=TIMEOUT))

