"""Which torch ops run on RaggedShard DTensors, and how.

[Note: ops on RaggedShard DTensors]
Torch's sharding propagation does not know RaggedShard: depending on the version an op on one
fails, or silently returns a Replicate DTensor holding only local data. `RaggedDTensor` therefore
takes every op itself through `__torch_function__` (which all supported torch versions call for a
DTensor subclass; 2.11's C++ dispatch fast path skips a subclass's `__torch_dispatch__`):
- Metadata (`shape`, `dtype`, `grad`, `size()`, ...) is answered by torch as for any DTensor.
- Element-wise ops (aten ops tagged `pointwise`), `_foreach_*` ops, fused optimizer kernels and
  the `*_like` factories run on the local tensors, because elementwise math on the local shards is
  the shard of elementwise math on the whole tensor. The RaggedShard arguments must have
  identical layouts (per list position for `_foreach_*`); other tensors are 0-dim, or held whole
  by every rank (Replicate DTensors, plain tensors under `implicit_replication()`) and
  broadcastable to the ragged shape, cut to the local rows: [Note: replicated operands of
  ragged ops]. The Python function runs on the local tensors under `_Allowlist`, a dispatch mode
  that lets only those aten ops through, so a composite function that reduces or reshapes
  inside raises instead of computing on one shard.
- Element-wise, `_foreach_*` and fused optimizer calls whose operands are RaggedShard DTensors of
  matching layouts and 0-dim scalars (what optimizer steps and clipping run) take a fast path
  with the same results and less Python per call: [Note: the ops fast path] (fastpath.py).
- `_foreach_*` and fused optimizer ops whose lists hold RaggedShard DTensors at some positions
  and other tensors at others (torch's optimizers group FSDP parameters with `replicate()`d or
  ignored plain ones): the op runs twice, on the positions holding a RaggedShard DTensor (as
  above) and on the others (torch's op on them: the plain op for plain tensors, torch's DTensor
  for other DTensors), and the outputs are put back in order. As torch's DTensor treats plain
  tensors next to DTensors as replicated only under `implicit_replication()`, a plain tensor of
  more than one element at such a position raises outside it.
- Vector norms (`torch.linalg.vector_norm`, `torch.linalg.norm`, `Tensor.norm`, ...) over all
  dims or some dims, and `torch._foreach_norm` (what `clip_grad_norm_` calls): [Note: norms on
  RaggedShard] (norms.py).
- Full reductions (`sum`, `mean`, `max`, `all`, ..., `torch.equal`, `torch.allclose`) work the
  same way: [Note: reductions on RaggedShard] (reductions.py); `sum`, `mean`, `amax`, `amin`,
  `all`, `any` and vector norms over some dims, ragged-sharded ones included: [Note: reductions
  over ragged-sharded dims] (ragged_dim_reduce.py).
- `GradScaler`'s non-finite check and unscale: [Note: GradScaler on RaggedShard] (amp.py).
- Random ops (`normal_`, `uniform_`, ..., `rand_like`) and `torch.nn.init` give bitwise the
  one-process result: [Note: random ops on RaggedShard] (random_ops.py). `new_tensor` returns a
  plain tensor, as torch's DTensor does.
- `new_empty`/`new_zeros`/`new_ones`/`new_full`/`new_empty_strided` give what torch's DTensor
  gives (the same layout for the same shape, else a Replicate DTensor): [Note: new_* factories
  on RaggedShard]; `x[i]` on dim 0 is a RaggedShard view that in-place ops write through:
  [Note: integer indexing of RaggedShard] (factories.py).
- `copy_` into a RaggedShard DTensor also takes a plain full-size source outside
  `implicit_replication()` (each rank keeps its part); an in-place op whose destination is not
  the RaggedShard DTensor raises: [Note: replicated operands of ragged ops] (operands.py).
- The same handlers serve aten ops that reach `__torch_dispatch__` without a torch function call
  (code run under `torch._C.DisableTorchFunctionSubclass()`, the autograd engine), on torch
  versions that call a subclass's `__torch_dispatch__` (not 2.11's fast path): random ops draw
  the same values there, the factories and `copy_` behave the same.
- Everything else raises NotImplementedError naming the op (so does `aten.equal` reached below
  `torch.equal`, whose result depends on every shard). Autograd does not flow through
  these ops: a differentiable op on an input that requires grad, with grad mode on, raises too.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from veragged.placement import factories, fastpath
from veragged.placement.amp import AMP_FUNCTIONS, AMP_PACKETS
from veragged.placement.layout import ragged_mesh_dim
from veragged.placement.norms import NORM_FUNCTIONS, NORM_PACKETS
from veragged.placement.operands import unwrap as _unwrap
from veragged.placement.operands import wrap as _wrap
from veragged.placement.random_ops import (
    RANDOM_FUNCTIONS,
    RANDOM_PACKETS,
    patched_init,
    random_op,
)
from veragged.placement.reductions import REDUCTION_FUNCTIONS, REDUCTION_PACKETS
from veragged.placement.tensor import META as _META
from veragged.placement.tensor import OP_KINDS as _KINDS
from veragged.placement.tensor import RaggedDTensor, accumulate_grads_locally
from veragged.runtime import caches

__all__ = ["handle_torch_function"]

aten = torch.ops.aten

# Tensor properties and methods that only read DTensor metadata: torch answers them.
_META_PROPERTIES = frozenset(
    "shape dtype device requires_grad grad _grad is_leaf ndim layout grad_fn is_cuda is_cpu "
    "is_meta _base is_sparse is_quantized is_nested names itemsize nbytes retains_grad output_nr "
    "_version "
    "_post_accumulate_grad_hooks _backward_hooks".split()
)
_META_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "size dim numel stride nelement element_size requires_grad_ register_hook retain_grad "
        "backward get_device is_floating_point is_complex __format__ "
        "register_post_accumulate_grad_hook "
        "_is_view is_contiguous storage_offset is_conj is_neg is_inference "
        # What torch's DTensor answers from its wrapper, which has no storage ([Note: a
        # RaggedDTensor has no storage], tensor.py).
        "untyped_storage _typed_storage storage __reduce_ex__"
    ).split()
) | {torch.is_complex, torch.is_floating_point, torch.numel, torch.is_conj, torch.is_neg,
     torch.is_inference}
_FACTORIES = frozenset(
    op.default
    for op in (
        aten.empty_like,
        aten.zeros_like,
        aten.ones_like,
        aten.full_like,
        aten.detach,
        aten.alias,
    )
) | {
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.copy_.default,
    aten._to_copy.default,
}
# Filled `*_like` factories: their values do not depend on the input's, so, as torch's DTensor
# rule says (`create_like_single_dim_strategy`), a Partial input gives a Replicate output (ones
# summed over a Partial dim would not be ones); `empty_like` keeps the placements.
_FILLED_LIKE = frozenset(
    {torch.zeros_like, torch.ones_like, torch.full_like, aten.zeros_like.default,
     aten.ones_like.default, aten.full_like.default}
)
_FUSED_OPTIMIZER_PREFIXES = ("_fused_adam", "_fused_sgd", "_fused_adagrad")
_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})
# Aten ops whose outputs carry no gradient, so they may run while inputs require grad.
_NON_DIFFERENTIABLE = _FACTORIES - {aten.copy_.default, aten._to_copy.default, aten.alias.default}
# Functions with a boolean result that compute in floating point inside (isclose: |a - b| <=
# atol + rtol * |b|): no gradient flows, so they run while inputs require grad. torch 2.11's
# `torch.testing.assert_close` and `TestCase.assertEqual` call isclose on two DTensors (a
# parameter against its reference, grad mode on); later versions compare the local shards.
_BOOLEAN_RESULT = frozenset({torch.isclose, torch.Tensor.isclose})


def _allowed(func) -> bool:
    if func in _FACTORIES:
        return True
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.data_dependent_output in tags:
        return False  # random ops and aten.equal: see random_ops.py and reductions.py
    if torch.Tag.pointwise in tags:
        return True
    name = func._schema.name.split("::", 1)[-1]
    if name.startswith("_foreach_"):
        return name not in _FOREACH_REDUCTIONS
    return name.startswith(_FUSED_OPTIMIZER_PREFIXES)


def _unsupported(func, placements) -> NotImplementedError:
    return NotImplementedError(
        f"{func} is not supported on RaggedShard DTensors (placements {tuple(placements)}): only "
        "element-wise ops, _foreach_* ops, fused optimizer ops, *_like factories, random ops, "
        "reductions over all dims, sum/mean/amax/amin/all/any and vector norms over any dims, "
        "new_* factories, integer indexing on dim 0 and clip_grad_norm_ run on them; "
        "redistribute to Replicate or Shard first"
    )


class _Allowlist(TorchDispatchMode):
    """Let through only the aten ops that are correct on local shards; see the Note above."""

    def __init__(self, placements, needs_grad: bool):
        super().__init__()
        self.placements = placements
        self.needs_grad = needs_grad  # grad mode is on and a DTensor operand requires grad

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _allowed(func):
            raise _unsupported(func, self.placements)
        out = func(*args, **(kwargs or {}))
        if self.needs_grad and func not in _NON_DIFFERENTIABLE:
            flat, _ = tree_flatten(out)
            if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in flat):
                raise NotImplementedError(
                    f"{func}: autograd does not flow through ops on RaggedShard DTensors; run it "
                    "under torch.no_grad() or redistribute to Replicate/Shard first"
                )
        return out


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _holds_ragged(x) -> bool:
    return isinstance(x, DTensor) and ragged_mesh_dim(x._spec.placements) is not None


_PER_POSITION = ("_foreach_", *_FUSED_OPTIMIZER_PREFIXES)


def _split_mixed(func, args, kwargs):
    """A `_foreach_*` or fused optimizer call whose lists hold RaggedShard DTensors at some
    positions only: one call on those positions and one on the others, outputs put back in list
    order (see [Note: ops on RaggedShard DTensors]). NotImplemented for any other call."""
    name = _name(func)
    if not name.startswith(_PER_POSITION):
        return NotImplemented
    values = (*args, *kwargs.values())
    n = next(
        (len(v) for v in values
         if isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v)),
        None,
    )
    if n is None:
        return NotImplemented
    # Per-position arguments: the lists of that length (tensors, or scalars such as Adam's
    # step sizes); other arguments (scalars, a 0-dim coefficient, an empty list) go to both.
    lists = [v for v in values if isinstance(v, (list, tuple)) and len(v) == n]
    if all(isinstance(e, RaggedDTensor) for e in lists[0]):
        return NotImplemented  # every position holds a RaggedShard DTensor
    ragged = [i for i in range(n) if any(_holds_ragged(v[i]) for v in lists)]
    if not ragged or len(ragged) == n:
        return NotImplemented
    others = sorted(set(range(n)) - set(ragged))
    if not DTensor._op_dispatcher._allow_implicit_replication:
        for v in lists:
            for i in others:
                plain = isinstance(v[i], torch.Tensor) and not isinstance(v[i], DTensor)
                if plain and v[i].numel() != 1:
                    raise RuntimeError(
                        f"{name}: list position {i} holds a plain tensor of shape "
                        f"{list(v[i].shape)} while other positions hold RaggedShard DTensors; "
                        "as with torch's DTensor, plain tensors are combined with DTensors only "
                        "under torch.distributed.tensor.experimental.implicit_replication()"
                    )

    def call(index):
        def pick(v):
            if isinstance(v, (list, tuple)) and len(v) == n:
                return type(v)(v[i] for i in index)
            return v

        return func(*map(pick, args), **{k: pick(v) for k, v in kwargs.items()})

    return _merge(call(ragged), call(others), ragged, others)


def _merge(a, b, first: list[int], second: list[int]):
    """The outputs `a` (of list positions `first`) and `b` (of `second`) of the two calls of
    `_split_mixed` as one output in list order."""
    if not isinstance(a, (list, tuple)):
        return a  # None: an in-place op
    if a and isinstance(a[0], (list, tuple)):  # one list per output (out-of-place fused ops)
        return type(a)(_merge(x, y, first, second) for x, y in zip(a, b))
    out = [None] * (len(first) + len(second))
    for index, values in ((first, a), (second, b)):
        for i, v in zip(index, values):
            out[i] = v
    return type(a)(out)


def _new_tensor(x, *args, **kwargs):
    """`x.new_tensor(data)`: a plain tensor, as torch's DTensor gives (dtype/device from x)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.new_tensor(x._local_tensor, *args, **kwargs)


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)

_SPECIAL = {
    torch.Tensor.new_tensor: _new_tensor,
    **factories.FACTORY_FUNCTIONS,
    **RANDOM_FUNCTIONS,
    **REDUCTION_FUNCTIONS,
    **NORM_FUNCTIONS,
    **AMP_FUNCTIONS,
}
_PACKETS = {**REDUCTION_PACKETS, **NORM_PACKETS, **AMP_PACKETS, **factories.FACTORY_PACKETS}


def _classify(func) -> int:
    """Which path `func` takes in `handle_torch_function` (cached per func by `_kind`)."""
    if func in _META_METHODS or (
        _name(func) in ("__get__", "__set__")
        and getattr(getattr(func, "__self__", None), "__name__", None) in _META_PROPERTIES
    ):
        setter = func is torch.Tensor.requires_grad_ or _name(func) == "__set__"
        return _META_SET if setter else _META
    if (
        func in _SPECIAL
        or getattr(func, "overloadpacket", None) in _PACKETS
        or func in _INDEXING
        or not _elementwise(func)
    ):
        return _GENERAL
    name = _name(func)
    if name.startswith(_PER_POSITION):
        return _GENERAL if name in _FOREACH_REDUCTIONS else _LISTS
    return _ELEMENTWISE_OP


_META_SET, _LISTS, _ELEMENTWISE_OP, _GENERAL = range(1, 5)  # _META is 0 (tensor.py)
_no_subclass_function = torch._C.DisableTorchFunctionSubclass


def _kind(func) -> int:
    try:
        kind = _KINDS.get(func)
    except TypeError:  # an unhashable callable
        return _classify(func)
    if kind is None:
        kind = _KINDS[func] = _classify(func)
    return kind


def _no_partial(out):
    """A filled `*_like` factory's result: Partial placements become Replicate (`_FILLED_LIKE`)."""
    if isinstance(out, DTensor) and any(isinstance(p, Partial) for p in out.placements):
        spec = out._spec
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
        out = type(out)(out._local_tensor, DTensorSpec(spec.mesh, placements, spec.tensor_meta),
                        requires_grad=out.requires_grad)
    return out


def handle_torch_function(func, args, kwargs):
    """`RaggedDTensor.__torch_function__`; see [Note: ops on RaggedShard DTensors] and, for
    element-wise and `_foreach_*` ops, [Note: the ops fast path] (fastpath.py)."""
    if func in _FILLED_LIKE:
        return _no_partial(_handle_torch_function(func, args, kwargs))
    return _handle_torch_function(func, args, kwargs)


def _handle_torch_function(func, args, kwargs):
    kind = _kind(func)
    if kind is _META:  # metadata (`x.grad`, `x.shape`, ...): the most frequent calls
        with _no_subclass_function():
            return func(*args, **kwargs)
    if kind is _LISTS:
        out = fastpath.per_position(func, args, kwargs)
        if out is not fastpath.SLOW:
            return out
    elif kind is _ELEMENTWISE_OP:
        out = fastpath.elementwise(func, args, kwargs)
        if out is not fastpath.SLOW:
            return out
    elif kind is _META_SET:
        with _no_subclass_function():
            out = func(*args, **kwargs)
        accumulate_grads_locally(args[0])
        return out
    out = _split_mixed(func, args, kwargs)
    if out is not NotImplemented:
        return out
    # An aten overload called directly (`torch.ops.aten.sum.default(x)`) takes its packet's handler.
    special = (_SPECIAL.get(func) or _PACKETS.get(getattr(func, "overloadpacket", None))
               or patched_init(func))
    if special is not None:
        out = special(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if func in _INDEXING and len(args) > 1 and isinstance(args[0], RaggedDTensor):
        out = (factories.getitem(args[0], args[1]) if func is torch.Tensor.__getitem__
               else factories.setitem(args[0], args[1], args[2]))
        if out is not NotImplemented:
            return out
    if func in _INDEXING and len(args) > 1 and args[1] is not Ellipsis:
        # The local tensor is the flat shard: only x[...] (all elements) means the same on it.
        # (nn.init.sparse_ and dirac_ index, for example.)
        raise NotImplementedError(
            f"indexing a RaggedShard DTensor ({_name(func)} with index {args[1]!r}) is not "
            "supported; redistribute to Replicate or Shard first"
        )
    uargs, ukwargs, refs, locals_to_dt = _unwrap(_name(func), args, kwargs, func)
    needs_grad = (
        torch.is_grad_enabled()
        and func not in _BOOLEAN_RESULT
        and any(dt.requires_grad for dt in locals_to_dt.values())
    )
    if not needs_grad and _elementwise(func):  # fast path: every overload is allowed
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*uargs, **ukwargs)
    else:
        placements = next(iter(refs.values())).placements if refs else ()
        with torch._C.DisableTorchFunctionSubclass(), _Allowlist(placements, needs_grad):
            out = func(*uargs, **ukwargs)
    return _wrap(out, refs, locals_to_dt)


_ELEMENTWISE: dict = caches.register("placement.ops element-wise verdicts", {})


def _takes_tensors(t) -> bool:
    """Whether a schema argument type holds tensors (TorchScript-only overloads, such as
    `mul_.t` on lists, have none and never run on tensors)."""
    return "Tensor" in str(t)


# Tensor dunders (by `__name__`) -> the aten packets their body runs (`__rdiv__`, which is also
# `__rtruediv__`, is Python: `self.reciprocal() * other`).
_DUNDERS = {
    "__add__": ("add",), "__radd__": ("add",), "__iadd__": ("add_",),
    "__sub__": ("sub",), "__isub__": ("sub_",),
    "__mul__": ("mul",), "__rmul__": ("mul",), "__imul__": ("mul_",),
    "__truediv__": ("div",), "__div__": ("div",), "__idiv__": ("div_",),
    "__rdiv__": ("reciprocal", "mul"), "__rpow__": ("pow",),
}


def _overload_allowed(packet, name: str) -> bool:
    """`_allowed`, also for an `X_out` overload (`add.Scalar_out`, untagged) of an allowed `X`."""
    if _allowed(getattr(packet, name)):
        return True
    base = name[:-4] if name.endswith("_out") else None
    return base in packet.overloads() and _allowed(getattr(packet, base))


def _elementwise(func) -> bool:
    """Whether every aten overload that `func` (by name, e.g. `Tensor.mul_`, or a dunder in
    `_DUNDERS`) can run is allowed.

    Such a call can skip the `_Allowlist` mode, which costs more than the op on small shards.
    Names without an aten packet (other dunders, composites) take the checked path.
    """
    known = _ELEMENTWISE.get(func)
    if known is None:
        name = getattr(func, "__name__", "")
        known = False
        for packet_name in _DUNDERS.get(name, (name,)):
            packet = getattr(aten, packet_name, None)
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                known = False
                break
            names = [
                o for o in packet.overloads()
                if any(_takes_tensors(a.type) for a in getattr(packet, o)._schema.arguments)
            ]
            known = bool(names) and all(_overload_allowed(packet, o) for o in names)
            if not known:
                break
        _ELEMENTWISE[func] = known
    return known


def handle_torch_dispatch(func, args, kwargs):
    """`RaggedDTensor.__torch_dispatch__`: aten ops that reach the subclass without a torch function
    call (e.g. gradient accumulation in the autograd engine, on torch versions that call it)."""
    if func in _FILLED_LIKE:
        return _no_partial(_handle_torch_dispatch(func, args, kwargs))
    return _handle_torch_dispatch(func, args, kwargs)


def _handle_torch_dispatch(func, args, kwargs):
    out = _split_mixed(func, args, kwargs)
    if out is not NotImplemented:
        return out
    packet = getattr(func, "overloadpacket", None)
    if packet in RANDOM_PACKETS:
        return random_op(func, args, kwargs)
    if packet in _PACKETS:
        out = _PACKETS[packet](*args, **kwargs)
        if out is not NotImplemented:
            return out
    if not _allowed(func):
        flat, _ = tree_flatten((args, kwargs))
        dt = next(x for x in flat if isinstance(x, RaggedDTensor))
        raise _unsupported(func, dt.placements)
    uargs, ukwargs, refs, locals_to_dt = _unwrap(str(func), args, kwargs, func)
    return _wrap(func(*uargs, **ukwargs), refs, locals_to_dt)
