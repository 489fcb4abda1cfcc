"""Random ops, torch.nn.init and full reductions on RaggedShard DTensors against one process.

Random ops must give bitwise the one-process result and leave the generator where one process
leaves it ([Note: random ops on RaggedShard]); reductions must equal the one-process reduction
(bitwise for max/min/all/any and integers, within round-off for float sums)
([Note: reductions on RaggedShard]). One spawn per world size (2 and 4 ranks) serves several
tests through a module-scoped fixture, and one spawn covers a 2x2 mesh.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import veragged
from veragged import RaggedShard, StridedRaggedShard
from tests.harness import get_mesh, run_on_ranks

from test_ops import _raises  # a sibling test module (pytest puts its folder on the path)

TIMEOUT = 600  # the CI machines are shared; a spawn normally takes seconds
# torch.testing.assert_close compares two DTensors' local shards (placements and meshes must be
# equal) and rejects a DTensor against a plain tensor: torch's own code on versions that have
# `_unwrap_dtensor_for_comparison` (2.15, not 2.11, where it runs isclose and its error report
# on the DTensors themselves); the checks of those semantics run only there.
_ASSERT_CLOSE_UNWRAPS_DTENSORS = hasattr(
    torch.testing._comparison, "_unwrap_dtensor_for_comparison"
)


def _cases(world):
    """(shape, placement): an element-wise cut with an empty rank, rows with an empty rank, the
    whole tensor on one rank (dims=()), odd rows, a 1-D tensor on one rank."""
    if world == 4:
        return [
            ((7, 13), RaggedShard((0, 1), (30, 0, 51, 10))),
            ((18, 5), RaggedShard((0,), (5, 0, 9, 4))),
            ((3, 4, 5), RaggedShard((), (0, 0, 1, 0))),
            ((5, 3, 2), RaggedShard((0,), (1, 1, 1, 2))),
            ((37,), RaggedShard((0,), (0, 37, 0, 0))),
        ]
    return [
        ((7, 13), RaggedShard((0, 1), (40, 51))),
        ((18, 5), RaggedShard((0,), (0, 1))),
        ((3, 4, 5), RaggedShard((), (0, 1))),
        ((5, 3, 2), RaggedShard((0,), (2, 3))),
        ((37,), RaggedShard((0,), (1, 0))),
    ]


def _dist(full, placements):
    return veragged.distribute_tensor(full, get_mesh(), placements, src_data_rank=None)


def _same_as_one_process(fn, shape, placements, dtype=torch.float32, seed=0):
    """`fn(tensor, generator)` on a RaggedShard DTensor and on the full tensor, from the same
    default and explicit generator states: same values, same local shard, same states after."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ref = torch.zeros(shape, dtype=dtype)
    with torch.no_grad():
        ref_out = fn(ref, g)
    want_state, want_g = torch.get_rng_state(), g.get_state()
    dt = _dist(torch.zeros(shape, dtype=dtype), placements)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        out = fn(dt, g)
    ok = torch.equal(torch.get_rng_state(), want_state) and torch.equal(g.get_state(), want_g)
    ok &= torch.equal(dt.full_tensor(), ref)
    ok &= torch.equal(dt.to_local(), _dist(ref, dt.placements).to_local())
    if ref_out is ref:
        return ok and out is dt  # in-place ops return the DTensor itself
    ok &= type(out).__name__ == "RaggedDTensor" and out.placements == dt.placements
    return ok and torch.equal(out.full_tensor(), ref_out)


_RANDOM = {
    "normal_": lambda t, g: t.normal_(0.5, 2.0),
    "uniform_": lambda t, g: t.uniform_(-1.0, 3.0),
    "bernoulli_": lambda t, g: t.bernoulli_(0.3),
    "bernoulli_0dim_p": lambda t, g: t.bernoulli_(torch.tensor(0.7)),
    "exponential_": lambda t, g: t.exponential_(1.5),
    "random_": lambda t, g: t.random_(0, 100),
    "log_normal_": lambda t, g: t.log_normal_(0.1, 0.5),
    "cauchy_": lambda t, g: t.cauchy_(),
    "geometric_": lambda t, g: t.geometric_(0.2),
    "generator": lambda t, g: t.normal_(generator=g).uniform_(generator=g),
    "rand_like": lambda t, g: torch.rand_like(t),
    "randn_like": lambda t, g: torch.randn_like(t, dtype=torch.float64),
    "randint_like": lambda t, g: torch.randint_like(t, 3, 9),
}

_INIT = {  # what nn.Linear / nn.Embedding / LayerNorm / Hugging Face init call
    "normal_": lambda t, g: nn.init.normal_(t, 0.0, 0.02, generator=g),
    "uniform_": lambda t, g: nn.init.uniform_(t, -0.1, 0.1),
    "trunc_normal_hf": lambda t, g: nn.init.trunc_normal_(t, std=0.02),
    "trunc_normal_redraws": lambda t, g: nn.init.trunc_normal_(t, std=1.0, a=-1.0, b=1.5),
    "trunc_normal_narrow": lambda t, g: nn.init.trunc_normal_(t, a=-0.2, b=0.3, generator=g),
    "zeros_": lambda t, g: nn.init.zeros_(t),
    "ones_": lambda t, g: nn.init.ones_(t),
    "constant_": lambda t, g: nn.init.constant_(t, 0.25),
}
_INIT_2D = {
    "kaiming_uniform_": lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t, g: nn.init.kaiming_normal_(t, mode="fan_out", generator=g),
    "xavier_uniform_": lambda t, g: nn.init.xavier_uniform_(t),
    "xavier_normal_": lambda t, g: nn.init.xavier_normal_(t, gain=2.0),
}


def _random_checks(world):
    res = {}
    for i, (shape, p) in enumerate(_cases(world)):
        for name, fn in _RANDOM.items():
            res[f"random.{name}.{shape}"] = _same_as_one_process(fn, shape, [p], seed=i)
        for name, fn in {**_INIT, **(_INIT_2D if len(shape) >= 2 else {})}.items():
            res[f"init.{name}.{shape}"] = _same_as_one_process(fn, shape, [p], seed=i)
    shape, p = _cases(world)[0]
    for dtype in (torch.bfloat16, torch.float64):
        res[f"random.normal_.{dtype}"] = _same_as_one_process(_RANDOM["normal_"], shape, [p], dtype)
    return res


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(18, 5)
        self.proj = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 13, bias=False)


def _hf_init(module):
    """The Hugging Face `_init_weights` pattern: in-place ops on `.data`."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        module.bias.data.zero_()
        module.weight.data.fill_(1.0)


def _module_checks(world):
    """reset_parameters() and HF init of modules whose parameters are RaggedShard DTensors."""
    torch.manual_seed(0)
    ref, model = _Block(), _Block()
    for mod in model.modules():
        for name, param in list(mod.named_parameters(recurse=False)):
            units = [0] * world
            if param.dim() >= 2:  # elements cut unevenly, ranks in between empty
                units[0] = param.numel() // 3
                units[-1] = param.numel() - units[0]
                placement = RaggedShard(tuple(range(param.dim())), units)
            else:  # the whole tensor on one rank
                units[1] = 1
                placement = RaggedShard((), units)
            setattr(mod, name, nn.Parameter(_dist(param.detach(), [placement])))
    res = {}
    for label, init in (
        ("reset_parameters", lambda m: [x.reset_parameters() for x in list(m.children())]),
        ("hf_init", lambda m: m.apply(_hf_init)),
    ):
        torch.manual_seed(3)
        init(ref)
        want = torch.get_rng_state()
        torch.manual_seed(3)
        init(model)
        res[f"module.{label}.state"] = torch.equal(torch.get_rng_state(), want)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            res[f"module.{label}.{name}"] = type(p).__name__ == "RaggedDTensor" and torch.equal(
                p.full_tensor(), q.detach()
            )
    return res


def _reduction_checks(world):
    mesh = get_mesh()
    g = torch.Generator().manual_seed(5)
    res = {}

    def exact(key, fn, full, x):
        got, want = fn(x), fn(full)
        res[key] = (
            type(got) is DTensor
            and got.placements == (Replicate(),) * mesh.ndim
            and (got.shape, got.dtype) == (want.shape, want.dtype)
            and torch.equal(got.full_tensor(), want)
            and torch.equal(got.to_local(), want)
            and got.item() == want.item()
        ) or f"{got.to_local()!r} != {want!r}"

    def close(key, fn, full, x, rtol=1e-6, atol=1e-6):
        got, want = fn(x), fn(full)
        res[key] = (
            type(got) is DTensor
            and (got.shape, got.dtype) == (want.shape, want.dtype)
            and torch.allclose(got.full_tensor(), want, rtol=rtol, atol=atol)
        ) or f"{got.to_local()!r} != {want!r}"

    for shape, p in _cases(world):
        full = torch.randn(shape, generator=g)
        x = _dist(full, [p])
        nd = len(shape)
        exact(f"max.{shape}", lambda t: t.max(), full, x)
        exact(f"min.{shape}", lambda t: torch.min(t), full, x)
        exact(f"amax.{shape}", lambda t: torch.amax(t), full, x)
        exact(f"amin_keepdim.{shape}", lambda t: t.amin(tuple(range(nd)), keepdim=True), full, x)
        exact(f"abs_max.{shape}", lambda t: t.abs().max(), full, x)
        exact(f"all.{shape}", lambda t: (t > -10).all(), full, x)
        exact(f"all_false.{shape}", lambda t: (t > 0).all(), full, x)
        exact(f"any.{shape}", lambda t: torch.any(t > 1.0), full, x)
        exact(f"any_false.{shape}", lambda t: (t > 100).any(), full, x)
        exact(f"eq_all.{shape}", lambda t: (t == t).all(), full, x)
        close(f"sum.{shape}", lambda t: t.sum(), full, x)
        close(f"sum_dims.{shape}", lambda t: t.sum(tuple(range(nd)), keepdim=True), full, x)
        close(f"sum_none.{shape}", lambda t: torch.sum(t, dim=None), full, x)
        close(f"sum_f64.{shape}", lambda t: t.sum(dtype=torch.float64), full, x, 1e-12, 1e-12)
        close(f"mean.{shape}", lambda t: t.mean(), full, x)
        close(f"nansum.{shape}", lambda t: torch.nansum(t), full, x)
        close(f"prod.{shape}", lambda t: (t * 0.01 + 1).prod(), full, x)
        close(f"sum_bf16.{shape}", lambda t: t.bfloat16().sum(), full, x, 1e-2, 1e-2)
        close(f"mean_bf16.{shape}", lambda t: t.bfloat16().mean(), full, x, 1e-2, 1e-2)
        ints = (full * 10).to(torch.int32)
        xi = _dist(ints, [p])
        for name, fn in (
            ("sum", lambda t: t.sum()),
            ("max", lambda t: t.max()),
            ("min", lambda t: t.min()),
            ("prod_wraps", lambda t: (t % 7 + 2).prod()),  # overflows int64: wraps like torch
        ):
            exact(f"int.{name}.{shape}", fn, ints, xi)
        bools = full > 0.3
        xb = _dist(bools, [p])
        for name, fn in (
            ("all", lambda t: t.all()),
            ("any", lambda t: t.any()),
            ("max", lambda t: t.max()),
            ("min", lambda t: t.min()),
            ("sum", lambda t: t.sum()),
        ):
            exact(f"bool.{name}.{shape}", fn, bools, xb)
        # A NaN in the last rank's shard: max/min/sum give NaN as in torch, nansum skips it.
        nan = full.clone()
        nan.view(-1)[-1] = math.nan
        xn = _dist(nan, [p])
        res[f"nan.{shape}"] = all(
            bool(torch.isnan(fn(xn).full_tensor()))
            for fn in (torch.max, torch.min, torch.amax, torch.sum, torch.mean)
        ) and torch.allclose(torch.nansum(xn).full_tensor(), torch.nansum(nan), rtol=1e-6)
    # Global numel 0 (every shard empty): identities, and max raises like torch.
    empty = torch.zeros(0, 5)
    xe = _dist(empty, [RaggedShard((0,), (1,) * world)])
    res["empty.sum"] = xe.sum().item() == 0.0 and xe.sum().shape == torch.Size([])
    res["empty.mean"] = math.isnan(xe.mean().item())
    res["empty.all_any"] = xe.all().item() is True and xe.any().item() is False
    res["empty.prod"] = xe.prod().item() == 1.0
    for fn in (torch.max, torch.amax):
        try:
            fn(empty)
        except RuntimeError as e:
            want = str(e)
        res[f"empty.{fn.__name__}"] = _raises(lambda: fn(xe), RuntimeError, want)
    return res


def _comparison_checks(world):
    mesh = get_mesh()
    shape, p = _cases(world)[0]
    full = torch.randn(shape)
    x, y = _dist(full, [p]), _dist(full.clone(), [p])
    flat = _dist(torch.zeros(91), [RaggedShard((0,), p.local_units)])  # 91 = 7 * 13 elements
    other_units = tuple(reversed(p.local_units))
    z = _dist(full, [RaggedShard(p.dims, other_units)])
    changed = full.clone()
    changed.view(-1)[-1] += 1  # held by one rank only
    w = _dist(changed, [p])
    res = {
        "equal": torch.equal(x, y) is True,
        "equal_method": x.equal(y) is True,
        "equal_changed": torch.equal(x, w) is False,  # on every rank, not only the holder
        "equal_other_layout": torch.equal(x, z) is True,
        "equal_other_shape": torch.equal(x, flat) is False,
        "equal_plain": _raises(lambda: torch.equal(x, full), ValueError, "full_tensor()"),
        "allclose": torch.allclose(x, y + 1e-7) is True,
        "allclose_changed": torch.allclose(x, w) is False,
        "allclose_scalar": torch.allclose(x * 0 + 2, torch.tensor(2.0)) is True,
        "if_all": bool((x == y).all()) and not bool((x == w).all()),
        "max_binary": torch.equal(torch.max(x, w).full_tensor(), torch.maximum(full, changed)),
    }
    torch.testing.assert_close(x, y)  # same placements: each rank compares its shard
    if not _ASSERT_CLOSE_UNWRAPS_DTENSORS:
        return res
    res["assert_close_placements"] = _raises(
        lambda: torch.testing.assert_close(x, z), AssertionError, "placements do not match"
    )
    res["assert_close_plain"] = _raises(
        lambda: torch.testing.assert_close(x, full), TypeError, "full_tensor()"
    )
    # Only the rank holding the changed element sees a mismatch: torch compares local shards.
    differs = dist.get_rank() == max(r for r, u in enumerate(p.local_units) if u)
    res["assert_close_local"] = (
        _raises(lambda: torch.testing.assert_close(x, w), AssertionError, "Mismatched")
        if differs
        else torch.testing.assert_close(x, w) is None
    )
    return res


def _error_checks(world):
    shape, p = _cases(world)[0]
    full = torch.randn(shape)
    x = _dist(full, [p])
    leaf = nn.Parameter(_dist(full, [p]))
    cube = _cases(world)[2][1]  # dims=(): the whole tensor on one rank
    return {
        # Over some dims: [Note: reductions over ragged-sharded dims] (tested in
        # test_reductions_over_ragged_dims.py); prod over some dims still raises.
        "sum_dim": torch.allclose(x.sum(0).full_tensor(), full.sum(0), rtol=1e-6, atol=1e-6),
        "mean_dim": torch.allclose(x.mean(dim=1).full_tensor(), full.mean(1), rtol=1e-6,
                                   atol=1e-6),
        "prod_dim": _raises(lambda: x.prod(0), NotImplementedError, "torch.prod"),
        "max_dim": _raises(lambda: x.max(0), NotImplementedError, "indices"),
        "sum_out": _raises(
            lambda: torch.sum(x, (0, 1), out=torch.empty(())), NotImplementedError, "out"
        ),
        "mean_int": _raises(lambda: x.int().mean(), (RuntimeError, NotImplementedError), "mean"),
        "orthogonal_": _raises(lambda: nn.init.orthogonal_(x), NotImplementedError, "aten.t_"),
        "sparse_": _raises(
            lambda: _no_grad(nn.init.sparse_, x, 0.5),
            NotImplementedError,
            "indexing",
        ),
        "eye_": _raises(lambda: _no_grad(nn.init.eye_, x), NotImplementedError, "eye"),
        "dirac_": _raises(
            lambda: _no_grad(nn.init.dirac_, _dist(torch.zeros(3, 4, 5), [cube])),
            NotImplementedError,
            "indexing",
        ),
        "bernoulli_tensor_p": _raises(
            lambda: _no_grad(x.bernoulli_, x * 0 + 0.5), NotImplementedError, "scalar"
        ),
        "bernoulli": _raises(lambda: torch.bernoulli(x * 0), NotImplementedError, "bernoulli"),
        "normal_grad": _raises(lambda: leaf.normal_(), NotImplementedError, "no_grad"),
        "sum_grad": _raises(lambda: leaf.sum(), NotImplementedError, "no_grad"),
        "all_grad_ok": bool((leaf == leaf).all()),
        "isclose_grad_ok": bool(torch.isclose(leaf, leaf).all() & leaf.isclose(leaf).all()),
    }


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def _one_d(world):
    res = {**_random_checks(world), **_module_checks(world)}  # keys: random.*, init.*, module.*
    for group, checks in (
        ("reduce", _reduction_checks),
        ("compare", _comparison_checks),
        ("error", _error_checks),
    ):
        res.update({f"{group}.{k}": v for k, v in checks(world).items()})
    return res


_RESULTS = {}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request):
    world = request.param
    if world not in _RESULTS:  # one spawn per world size, shared by the tests below
        try:
            _RESULTS[world] = run_on_ranks(_one_d, world, args=(world,), timeout=TIMEOUT)
        except Exception as e:  # report it once per test without spawning again
            _RESULTS[world] = e
    if isinstance(_RESULTS[world], Exception):
        raise _RESULTS[world]
    return _RESULTS[world]


def _check(results, prefixes):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if k.startswith(prefixes) and v is not True}
        assert not bad, (rank, bad)
        assert any(k.startswith(prefixes) for k in res)


def test_random_ops_are_bitwise_the_one_process_draw(results):
    _check(results, ("random.",))


def test_nn_init_and_module_init_match_one_process(results):
    _check(results, ("init.", "module."))


def test_full_reductions_match_one_process(results):
    _check(results, ("reduce.",))


def test_equal_allclose_and_assert_close(results):
    _check(results, ("compare.",))


def test_unsupported_forms_raise(results):
    _check(results, ("error.",))


def _mesh2d():
    mesh = get_mesh()
    layouts = [
        ((9, 5), [Replicate(), RaggedShard((0,), (1, 2))]),  # HSDP
        ((7, 3), [RaggedShard((0,), (0, 1)), Replicate()]),
        ((8, 6), [Shard(0), RaggedShard((0, 1), (3, 1))]),
        ((8, 6), [RaggedShard((0,), (1, 3)), Shard(0)]),  # -> StridedRaggedShard
        ((4, 6), [RaggedShard((0, 1), (1, 1)), Shard(1)]),  # LCM rule: dims=(0,)
    ]
    res = {}
    g = torch.Generator().manual_seed(7)
    for i, (shape, placements) in enumerate(layouts):
        key = f"{shape}{placements}"
        for name in ("normal_", "uniform_", "bernoulli_", "randn_like"):
            fn = _RANDOM[name]
            res[f"random.{name}.{key}"] = _same_as_one_process(fn, shape, placements, seed=i)
        for name in ("trunc_normal_hf", "trunc_normal_redraws", "normal_"):
            res[f"init.{name}.{key}"] = _same_as_one_process(_INIT[name], shape, placements, seed=i)
        res[f"init.kaiming_uniform_.{key}"] = _same_as_one_process(
            _INIT_2D["kaiming_uniform_"], shape, placements, seed=i
        )
        full = torch.randn(shape, generator=g)
        x = _dist(full, placements)
        res[f"strided.{key}"] = (i != 3) or isinstance(x.placements[0], StridedRaggedShard)
        for name, fn in (("max", torch.max), ("amin", torch.amin), ("any", _any_gt1)):
            got, want = fn(x), fn(full)
            res[f"reduce.{name}.{key}"] = (
                got.placements == (Replicate(), Replicate())
                and torch.equal(got.full_tensor(), want)
                and got.item() == want.item()
            )
        res[f"reduce.sum.{key}"] = torch.allclose(x.sum().full_tensor(), full.sum(), rtol=1e-6)
        res[f"reduce.mean.{key}"] = abs(x.mean().item() - full.mean().item()) <= 1e-6
        changed = full.clone()
        changed.view(-1)[0] -= 1
        res[f"equal.{key}"] = torch.equal(x, _dist(full, placements)) and not torch.equal(
            x, _dist(changed, placements)
        )
    return res


def _any_gt1(t):
    return (t > 1).any()


def test_2d_mesh_random_ops_and_reductions():
    for rank, res in enumerate(run_on_ranks(_mesh2d, 4, mesh_shape=(2, 2), timeout=TIMEOUT)):
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, (rank, bad)
