"""What parameter-initialisation code calls on RaggedShard parameters (issue 25, item 2).

torchtitan, Hugging Face transformers, PEFT and `torch.nn.init` treat sharded parameters as
DTensors; each op they call must behave as on torch's DTensor, at the Python level
(`__torch_function__`) and at the dispatch level (code run under
`torch._C.DisableTorchFunctionSubclass()`, which reaches `__torch_dispatch__`):
- `new_*` factories follow torch's rule (same shape: same placements, else Replicate), checked
  against torch's own `Shard(0)` DTensor in the same run; `*_like` keep the placement
  ([Note: new_* factories on RaggedShard]);
- random init (`torch.nn.init.*`, HF's `.data.normal_()` pattern, `trunc_normal_`'s
  `uniform_/erfinv_/mul_/add_/clamp_`) gives bitwise the one-process values and generator state,
  at both levels, under `torch._dynamo.disable` and under a transformers-style patch of
  `torch.nn.init` ([Note: random ops on RaggedShard]);
- `copy_` from plain full-size tensors, Replicate DTensors and RaggedShard DTensors of the same
  layout; `fill_`/`zero_`/`mul_`/`add_`/`clamp_` with scalars; in-place writes into a non-ragged
  destination raise ([Note: replicated operands of ragged ops]);
- `w[i]` is a writable view: `init.zeros_(emb.weight[padding_idx])` zeroes the row as in one
  process ([Note: integer indexing of RaggedShard]);
- torchtitan's fused-QKV init and a transformers-style `_init_weights` on a meta-initialised
  `veragged.fully_shard` model after `to_empty` give the one-process parameters bitwise;
- `orthogonal_` raises naming the op that needs the whole matrix; the documented workaround
  (initialise a full tensor, `copy_` it in) gives the one-process values.
One 4-rank pool runs the 1-D jobs, one the 2x2-mesh job.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import veragged
from veragged import RaggedShard
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

WORLD = 4
TIMEOUT = 300
# (shape, placement): rows cut unevenly with an empty rank, elements cut anywhere (rows split
# between ranks), the whole tensor on one rank, rows inside dim 1 of a 3-D tensor.
LAYOUTS = [
    ((18, 5), RaggedShard((0,), (5, 0, 9, 4))),
    ((7, 13), RaggedShard((0, 1), (30, 0, 51, 10))),
    ((6, 4), RaggedShard((), (0, 0, 1, 0))),
    ((4, 6, 5), RaggedShard((0, 1), (3, 1, 0, 2))),
]


def _raises(fn, exc, text):
    try:
        fn()
    except exc as e:
        return text in str(e) or str(e)
    return f"no {exc.__name__}"


def _dispatch_level(fn, *args, **kwargs):
    """`fn` with torch functions off for subclasses: its aten ops reach `__torch_dispatch__`."""
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        return fn(*args, **kwargs)


def _python_level(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def _dynamo_disabled(fn, *args, **kwargs):
    @torch._dynamo.disable
    def run():
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run()


@contextlib.contextmanager
def _hf_guard():
    """What transformers' `guard_torch_init_functions` does: `torch.nn.init`'s functions replaced
    by wrappers that skip tensors marked `_is_hf_initialized` and call torch's original."""
    init = torch.nn.init
    names = ("normal_", "uniform_", "constant_", "ones_", "zeros_", "xavier_uniform_",
             "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_")
    originals = {name: getattr(init, name) for name in names}

    def guarded(original):
        @functools.wraps(original)
        def wrapper(tensor, *args, **kwargs):
            if getattr(tensor, "_is_hf_initialized", False):
                return tensor
            return original(tensor, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(init, name, guarded(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(init, name, original)


def _hf_patched(fn, *args, **kwargs):
    with _hf_guard(), torch.no_grad():
        return fn(*args, **kwargs)


LEVELS = {
    "python": _python_level,
    "dispatch": _dispatch_level,
    "dynamo_disable": _dynamo_disabled,
    "hf_patched": _hf_patched,
}


def _levels(mesh, *names):
    """`names` less "dispatch" where an aten op run with torch functions off does not reach a
    DTensor subclass's `__torch_dispatch__`: torch 2.11's C++ DTensor fast path serves
    subclasses itself (torch's sharding propagation), so there only the Python level reaches
    veragged ([Note: ops on RaggedShard DTensors])."""
    from test_norms import _subclass_dispatch_reached

    if _subclass_dispatch_reached(mesh):
        return names
    return tuple(name for name in names if name != "dispatch")


def _mesh(shape=(WORLD,)):
    return init_device_mesh(rank_device_type(), shape)


def _ragged(full, mesh, placements):
    return nn.Parameter(veragged.distribute_tensor(full, mesh, placements, src_data_rank=None))


# --- factories ---------------------------------------------------------------------------------


def _factory_calls(x, shape):
    other = (shape[0] + 1, *shape[1:])
    return {
        "new_empty": (lambda: x.new_empty(shape), lambda: x.new_empty(other)),
        "new_empty_varargs": (lambda: x.new_empty(*shape), lambda: x.new_empty(*other)),
        "new_zeros": (lambda: x.new_zeros(shape), lambda: x.new_zeros(other)),
        "new_ones": (lambda: x.new_ones(shape, dtype=torch.float64),
                     lambda: x.new_ones(other, dtype=torch.float64)),
        "new_full": (lambda: x.new_full(shape, 2.5), lambda: x.new_full(other, 2.5)),
        "new_empty_strided": (
            lambda: x.new_empty_strided(shape, torch.empty(shape).stride()),
            lambda: x.new_empty_strided(other, torch.empty(other).stride()),
        ),
    }


def _expected_values(name, shape, dtype):
    if name == "new_zeros":
        return torch.zeros(shape, dtype=dtype)
    if name == "new_ones":
        return torch.ones(shape, dtype=torch.float64)
    if name == "new_full":
        return torch.full(shape, 2.5, dtype=dtype)
    return None  # uninitialised


def _factory_checks():
    mesh, res = _mesh(), {}
    for shape, placement in LAYOUTS:
        full = torch.randn(shape)
        x = _ragged(full, mesh, [placement])
        ref = nn.Parameter(torch_distribute_tensor(full, mesh, [Shard(0)]))
        torch_calls = _factory_calls(ref, shape)
        for name, (same, other) in _factory_calls(x, shape).items():
            for level in _levels(mesh, "python", "dispatch"):
                key = f"factory.{name}.{level}.{shape}"
                want_same = LEVELS[level](torch_calls[name][0])
                want_other = LEVELS[level](torch_calls[name][1])
                got_same, got_other = LEVELS[level](same), LEVELS[level](other)
                # torch keeps its Shard(0) for the same shape and replicates otherwise; we keep
                # the RaggedShard where torch keeps its placement. torch 2.11 keeps it in
                # new_empty_strided only when dim 0 divides evenly (its new_factory_strategy),
                # later versions always; veragged keeps the RaggedShard as the later ones do.
                keeps = want_same.placements == ref.placements or (
                    name == "new_empty_strided" and shape[0] % WORLD != 0
                )
                values = _expected_values(name, shape, got_same.dtype)
                res[key + ".same"] = (
                    keeps
                    and type(got_same) is veragged.RaggedDTensor
                    and got_same.placements == x.placements
                    and got_same.shape == full.shape
                    and got_same.dtype == want_same.dtype
                    and got_same.to_local().numel() == x.to_local().numel()
                    and not got_same.requires_grad
                    and (values is None or torch.equal(got_same.full_tensor(), values))
                )
                other_shape = (shape[0] + 1, *shape[1:])
                values = _expected_values(name, other_shape, got_other.dtype)
                res[key + ".other"] = (
                    want_other.placements == (Replicate(),)
                    and type(got_other) is DTensor
                    and got_other.placements == (Replicate(),)
                    and got_other.device_mesh == mesh
                    and tuple(got_other.shape) == other_shape
                    and got_other.to_local().shape == got_other.shape
                    and got_other.dtype == want_other.dtype
                    and (values is None or torch.equal(got_other.to_local(), values))
                )
        grad = x.new_zeros(shape, requires_grad=True)
        res[f"factory.requires_grad.{shape}"] = grad.requires_grad and grad.is_leaf
        for name in ("empty_like", "zeros_like", "ones_like", "rand_like", "randn_like"):
            for level in _levels(mesh, "python", "dispatch"):
                fn = getattr(torch, name)
                got, want = LEVELS[level](fn, x), LEVELS[level](fn, ref)
                res[f"like.{name}.{level}.{shape}"] = (
                    want.placements == ref.placements
                    and type(got) is veragged.RaggedDTensor
                    and got.placements == x.placements
                )
        for level in _levels(mesh, "python", "dispatch"):
            got = LEVELS[level](torch.full_like, x, 3.0)
            res[f"like.full_like.{level}.{shape}"] = (
                got.placements == x.placements
                and torch.equal(got.full_tensor(), torch.full(shape, 3.0))
            )
    return res


# --- random init at every level against one process --------------------------------------------

INITS = {
    "nn.init.normal_": lambda t: nn.init.normal_(t, 0.0, 0.02),
    "nn.init.uniform_": lambda t: nn.init.uniform_(t, -0.1, 0.1),
    "nn.init.trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "nn.init.trunc_normal_redraws": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-1.0, b=1.5),
    "nn.init.kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "nn.init.kaiming_normal_": lambda t: nn.init.kaiming_normal_(t, mode="fan_out"),
    "nn.init.xavier_uniform_": lambda t: nn.init.xavier_uniform_(t),
    "nn.init.xavier_normal_": lambda t: nn.init.xavier_normal_(t, gain=2.0),
    "nn.init.zeros_": lambda t: nn.init.zeros_(t),
    "nn.init.ones_": lambda t: nn.init.ones_(t),
    "nn.init.constant_": lambda t: nn.init.constant_(t, 0.25),
    "data.normal_": lambda t: t.data.normal_(mean=0.0, std=0.02),
    "normal_": lambda t: t.normal_(0.5, 2.0),
    "trunc_normal_by_hand": lambda t: t.uniform_(-0.9, 0.95).erfinv_().mul_(0.02 * math.sqrt(2.0))
    .add_(0.1).clamp_(-0.04, 0.05),
    "fill_zero_mul_add_clamp": lambda t: t.fill_(3.0).mul_(2.0).add_(-1.0).clamp_(0.0, 4.0),
    "zero_": lambda t: t.zero_(),
}


def _init_checks():
    mesh, res = _mesh(), {}
    for i, (shape, placement) in enumerate(LAYOUTS):
        x = _ragged(torch.zeros(shape), mesh, [placement])
        fan = nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
        res[f"fan.{shape}"] = nn.init._calculate_fan_in_and_fan_out(x) == fan
        for name, fn in INITS.items():
            torch.manual_seed(i)
            ref = torch.zeros(shape)
            _python_level(fn, ref)
            want_state = torch.get_rng_state()
            for level in _levels(mesh, *LEVELS):
                run = LEVELS[level]
                _python_level(x.zero_)
                torch.manual_seed(i)
                out = run(fn, x)
                res[f"init.{name}.{level}.{shape}"] = (
                    isinstance(out, veragged.RaggedDTensor)  # x, or x.data: in place
                    and out.placements == x.placements
                    and torch.equal(torch.get_rng_state(), want_state)
                    and torch.equal(x.full_tensor(), ref)
                ) or f"max diff {(x.full_tensor() - ref).abs().max()}"
    return res


# --- copy_ and in-place ops with scalars -------------------------------------------------------


def _copy_checks():
    mesh, res = _mesh(), {}
    g = torch.Generator().manual_seed(3)
    for shape, placement in LAYOUTS:
        full = torch.randn(shape, generator=g)
        row = torch.randn(shape[-1], generator=g)
        sources = {
            "plain_full": (lambda: full, full),
            "plain_broadcast": (lambda: row, row.expand(shape)),
            "replicate": (lambda: torch_distribute_tensor(full, mesh, [Replicate()]), full),
            "ragged_same_layout": (lambda: veragged.distribute_tensor(full, mesh, [placement]),
                                   full),
            "ragged_float64": (lambda: veragged.distribute_tensor(full.double(), mesh,
                                                                  [placement]), full),
        }
        for level in _levels(mesh, "python", "dispatch"):
            for name, (make, want) in sources.items():
                x = _ragged(torch.zeros(shape), mesh, [placement])
                src = make()
                out = LEVELS[level](lambda: x.copy_(src))
                res[f"copy_.{name}.{level}.{shape}"] = (
                    (out is x or out._local_tensor is x._local_tensor)
                    and torch.equal(x.full_tensor(), want)
                )
            x = _ragged(torch.zeros(shape), mesh, [placement])
            other = RaggedShard(placement.dims, tuple(reversed(placement.local_units)))
            moved = veragged.distribute_tensor(full, mesh, [other])
            res[f"copy_.other_layout.{level}.{shape}"] = _raises(
                lambda: LEVELS[level](lambda: x.copy_(moved)), ValueError, "identical layouts")
            res[f"copy_.into_plain.{level}.{shape}"] = _raises(
                lambda: LEVELS[level](lambda: torch.zeros(shape).copy_(x)), ValueError,
                ".full_tensor()")
            rep = torch_distribute_tensor(torch.zeros(shape), mesh, [Replicate()])
            res[f"copy_.into_replicate.{level}.{shape}"] = _raises(
                lambda: LEVELS[level](lambda: rep.copy_(x)), ValueError, ".full_tensor()")
            res[f"copy_.bad_shape.{level}.{shape}"] = _raises(
                lambda: LEVELS[level](lambda: x.copy_(torch.zeros(shape[-1] + 1))), ValueError,
                "does not broadcast")
    return res


# --- integer indexing ----------------------------------------------------------------------------


def _index_checks():
    mesh, res = _mesh(), {}
    for i, (shape, placement) in enumerate(LAYOUTS):
        full = torch.randn(shape)
        for level in _levels(mesh, "python", "dispatch", "hf_patched"):
            for index in (0, 1, shape[0] - 1, -2):
                x = _ragged(full, mesh, [placement])
                want = full.clone()
                want[index] = 0
                LEVELS[level](lambda: nn.init.zeros_(x[index]))
                res[f"index.zeros_.{level}.{index}.{shape}"] = torch.equal(x.full_tensor(), want)
            x = _ragged(full, mesh, [placement])
            view = LEVELS[level](lambda: x[1])
            res[f"index.view.{level}.{shape}"] = (
                type(view) is veragged.RaggedDTensor
                and tuple(view.shape) == shape[1:]
                and torch.equal(view.full_tensor(), full[1])
            )
            torch.manual_seed(i)
            ref = full.clone()
            ref[2].normal_(0.0, 0.02)
            want_state = torch.get_rng_state()
            torch.manual_seed(i)
            LEVELS[level](lambda: x.data[2].normal_(0.0, 0.02))
            res[f"index.normal_.{level}.{shape}"] = torch.equal(
                x.full_tensor(), ref) and torch.equal(torch.get_rng_state(), want_state)
        x = _ragged(full, mesh, [placement])
        want = full.clone()
        with torch.no_grad():
            x[0] = 3.0
            x[-1] = torch.arange(math.prod(shape[1:]), dtype=torch.float32).view(shape[1:])
        want[0] = 3.0
        want[-1] = torch.arange(math.prod(shape[1:]), dtype=torch.float32).view(shape[1:])
        res[f"index.setitem.{shape}"] = torch.equal(x.full_tensor(), want)
        res[f"index.out_of_range.{shape}"] = _raises(
            lambda: _python_level(lambda: x[shape[0]]), IndexError, "out of bounds")
        res[f"index.tuple.{shape}"] = _raises(
            lambda: _python_level(lambda: x[0, 1]), NotImplementedError, "indexing")
        for level in _levels(mesh, "python", "dispatch"):
            res[f"index.dim1.{level}.{shape}"] = _raises(
                lambda: LEVELS[level](lambda: x.select(1, 0)), NotImplementedError, "dim=1")
        res[f"index.grad.{shape}"] = _raises(lambda: x[0], NotImplementedError, "no_grad")
    return res


# --- orthogonal_ ------------------------------------------------------------------------------


def _orthogonal_checks():
    mesh, res = _mesh(), {}
    for shape, op in (((18, 5), "linalg_qr"), ((7, 13), "aten.t_")):
        placement = dict(LAYOUTS)[shape]
        x = _ragged(torch.zeros(shape), mesh, [placement])
        for level in _levels(mesh, "python", "dispatch"):
            res[f"orthogonal_.raises.{level}.{shape}"] = _raises(
                lambda: LEVELS[level](nn.init.orthogonal_, x), NotImplementedError, op)
        # The documented way: initialise a full tensor and copy it in.
        torch.manual_seed(5)
        ref = nn.init.orthogonal_(torch.empty(shape))
        torch.manual_seed(5)
        with torch.no_grad():
            x.copy_(nn.init.orthogonal_(torch.empty(x.shape)))
        res[f"orthogonal_.via_copy.{shape}"] = torch.equal(x.full_tensor(), ref)
    return res


# --- torchtitan's fused-QKV init, and a model built on the meta device --------------------------


def _fused_qkv_init(t, n_heads, n_kv_heads, head_dim, base_init):
    """The steps of torchtitan's `_fused_qkv_param_init` (models/common/config_utils.py): q, k, v
    drawn on `new_empty` tensors of the unfused shapes, concatenated per kv head, copied in."""
    tail = t.shape[1:]
    per_kv = n_heads // n_kv_heads
    q = t.new_empty(n_heads * head_dim, *tail)
    k = t.new_empty(n_kv_heads * head_dim, *tail)
    v = t.new_empty(n_kv_heads * head_dim, *tail)
    base_init(q)
    base_init(k)
    base_init(v)
    fused = torch.cat(
        [q.view(n_kv_heads, per_kv, head_dim, *tail), k.view(n_kv_heads, 1, head_dim, *tail),
         v.view(n_kv_heads, 1, head_dim, *tail)], dim=1,
    ).view(-1, *tail)
    with torch.no_grad():
        t.copy_(fused)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=1)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(8, 4 * 2 + 2 * 2 * 2, bias=False)  # 4 heads, 2 kv heads, dim 2
        self.wo = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


def _hf_init_weights(module, fused_level):
    """transformers' `PreTrainedModel._init_weights` for these module types, plus the fused QKV."""
    init = torch.nn.init
    std = 0.02
    if isinstance(module, _Block):
        _fused_qkv_init(module.wqkv.weight, 4, 2, 2,
                        functools.partial(init.trunc_normal_, std=std))
    elif isinstance(module, nn.Linear) and not getattr(module.weight, "_fused", False):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            init.zeros_(module.weight[module.padding_idx])
    elif isinstance(module, nn.LayerNorm):
        init.ones_(module.weight)
        init.zeros_(module.bias)


def _init_model(model, level):
    for block in model.blocks:
        block.wqkv.weight._fused = True

    def apply(m):
        m.apply(lambda mod: _hf_init_weights(mod, level))

    LEVELS[level](apply, model)


def _model_checks():
    mesh, res = _mesh(), {}
    torch.manual_seed(0)
    ref = _Model()
    torch.manual_seed(11)
    _init_model(ref, "python")
    for level in _levels(mesh, "python", "dispatch", "hf_patched"):
        with torch.device("meta"):
            model = _Model()
        for block in model.blocks:
            veragged.fully_shard(block, mesh=mesh)
        veragged.fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        w = model.blocks[0].wo.weight
        fresh = w.new_empty(3, 8)
        res[f"model.new_empty_after_to_empty.{level}"] = (
            type(fresh) is DTensor and fresh.placements == (Replicate(),)
            and tuple(fresh.shape) == (3, 8)
        )
        torch.manual_seed(11)
        _init_model(model, level)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            res[f"model.{level}.{name}"] = (
                type(p) is veragged.RaggedDTensor and torch.equal(p.full_tensor(), q.detach())
            )
    return res


def _one_dim_jobs():
    res = {}
    for checks in (_factory_checks, _init_checks, _copy_checks, _index_checks,
                   _orthogonal_checks, _model_checks):
        res.update(checks())
    return res


# --- a 2x2 mesh ---------------------------------------------------------------------------------


def _mesh2d_checks():
    mesh, res = _mesh((2, 2)), {}
    full = torch.randn(8, 6)
    layouts = {
        "hsdp": [Replicate(), RaggedShard((0, 1), (17, 31))],
        "fsdp_tp": [RaggedShard((0,), (1, 3)), Shard(1)],
    }
    for key, placements in layouts.items():
        for level in _levels(mesh, "python", "dispatch"):
            x = _ragged(full, mesh, placements)
            same, other = LEVELS[level](lambda: (x.new_zeros(8, 6), x.new_zeros(2, 6)))
            res[f"2d.new_zeros.{key}.{level}"] = (
                type(same) is veragged.RaggedDTensor and same.placements == x.placements
                and torch.equal(same.full_tensor(), torch.zeros(8, 6))
                and other.placements == (Replicate(), Replicate())
                and torch.equal(other.to_local(), torch.zeros(2, 6))
            )
            src = torch.randn(8, 6)
            LEVELS[level](lambda: x.copy_(src))
            res[f"2d.copy_.{key}.{level}"] = torch.equal(x.full_tensor(), src)
            torch.manual_seed(4)
            ref = nn.init.trunc_normal_(torch.empty(8, 6), std=0.02)
            torch.manual_seed(4)
            LEVELS[level](nn.init.trunc_normal_, x, std=0.02)
            res[f"2d.trunc_normal_.{key}.{level}"] = torch.equal(x.full_tensor(), ref)
            if key == "hsdp":
                want = x.full_tensor().clone()
                want[3] = 0
                LEVELS[level](lambda: nn.init.zeros_(x[3]))
                res[f"2d.index.{key}.{level}"] = torch.equal(x.full_tensor(), want)
            else:
                res[f"2d.index.{key}.{level}"] = _raises(
                    lambda: LEVELS[level](lambda: x[3]), NotImplementedError, "Replicate on the")
    # A Partial on the other mesh dim (a gradient before its all-reduce): the filled *_like
    # factories give Replicate there, empty_like keeps Partial, as torch's DTensor rule does.
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    ragged = _ragged(full, mesh, [Replicate(), RaggedShard((0, 1), (17, 31))])
    ref = torch_distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    partial = []
    for t in (ragged, ref):
        spec = t._spec
        placements = (Partial(),) + tuple(spec.placements[1:])
        partial.append(type(t)(t._local_tensor, DTensorSpec(spec.mesh, placements,
                                                           spec.tensor_meta),
                               requires_grad=False))
    for name, args in (("zeros_like", ()), ("ones_like", ()), ("full_like", (2.0,)),
                       ("empty_like", ())):
        for level in _levels(mesh, "python", "dispatch"):
            got, want = (LEVELS[level](getattr(torch, name), t, *args) for t in partial)
            res[f"2d.partial.{name}.{level}"] = (
                got.placements[0] == want.placements[0]
                and got.placements[1] == partial[0].placements[1]
            )
    return res


def _check(results):
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, (rank, bad)


def test_init_ops_on_a_1d_mesh():
    _check(get_pool(WORLD).run(_one_dim_jobs, timeout=TIMEOUT))


def test_init_ops_on_a_2d_mesh():
    _check(get_pool(WORLD).run(_mesh2d_checks, timeout=TIMEOUT))
