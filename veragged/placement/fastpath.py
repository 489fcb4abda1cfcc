"""The fast path of ops on RaggedShard DTensors (see [Note: ops on RaggedShard DTensors]).

[Note: the ops fast path]
An optimizer step or `clip_grad_norm_` runs a few element-wise and `_foreach_*` ops per
parameter, each entering `RaggedDTensor.__torch_function__`, so the Python around the kernel is
most of their cost on small shards. `handle_torch_function` (ops.py) classifies each `func` once
(`classify`, cached per func) and sends the element-wise ones here:
- `elementwise`: an op whose every aten overload is element-wise (`ops._elementwise`), whose
  tensor operands are RaggedDTensors of one layout (the same spec object, or equal mesh,
  placements and shape) and 0-dim plain tensors or 0-dim Replicate DTensors;
- `per_position`: a `_foreach_*` (not a reduction) or fused optimizer op whose first tensor list
  holds only RaggedDTensors, and whose other tensor lists hold, at each position, a RaggedDTensor
  of that position's layout or a 0-dim plain tensor (Adam's `state_steps`); lone tensor operands
  are 0-dim plain tensors or 0-dim Replicate DTensors;
- `foreach_norm`: `torch._foreach_norm` of RaggedShard DTensors, clipping's per-parameter norms
  (this rank's norm of each shard, partial over the sharded mesh dims: [Note: norms on
  RaggedShard], norms.py).
They read only `type(x)`, `x._spec` and `x._local_tensor` (no DTensor property that would enter
`__torch_function__` again), call the op on the local tensors, and wrap outputs under the input
specs (an output that is an input's local tensor gives back that DTensor). Anything else, and
any call that needs autograd (grad mode on and an operand requiring grad), returns `SLOW`
before running the op, and ops.py takes its general path, which gives the same results and
raises the errors (layouts, shapes, Partial operands, autograd).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops import _math_ops
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from veragged.placement.reduce_parts import check_grad
from veragged.placement.tensor import RaggedDTensor, as_ragged, cached_spec
from veragged.runtime import caches

__all__ = ["SLOW", "elementwise", "foreach_norm", "per_position"]

SLOW = object()  # "take the general path"; returned before the op has run
_RAGGED = RaggedDTensor
_Tensor = torch.Tensor
_DTensor = DTensor
_no_subclass_function = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled


def _same_spec(a, b) -> bool:
    """Same layout for element-wise ops: mesh, placements and global shape (dtype may differ)."""
    return (
        a.mesh == b.mesh
        and a.placements == b.placements
        and a.tensor_meta.shape == b.tensor_meta.shape
    )


def _scalar(x):
    """A lone non-ragged tensor operand: a 0-dim plain tensor (itself) or a 0-dim DTensor whose
    placements are all Replicate (its local tensor); anything else SLOW."""
    if type(x) is _DTensor:
        spec = x._spec
        if spec.tensor_meta.shape or not all(p.is_replicate() for p in spec.placements):
            return SLOW
        return x._local_tensor
    if isinstance(x, _DTensor) or x.dim() != 0:
        return SLOW
    return x


def _wrap(t, spec):
    if t.dtype is not spec.tensor_meta.dtype:
        spec = _retype(spec, t.dtype)
    return _RAGGED(t, spec, requires_grad=False)


def _retype(spec, dtype):
    """`spec` for an output of another dtype (a comparison's bool, a cast)."""
    meta = spec.tensor_meta
    return cached_spec(spec.mesh, spec.placements, meta.shape, dtype, meta.stride)


def _requires_grad(dts) -> bool:
    with _no_subclass_function():
        return any(x.requires_grad for x in dts)


def elementwise(func, args, kwargs):
    """An element-wise op on operands of one layout; see [Note: the ops fast path]."""
    R = _RAGGED
    spec = None
    inputs = []  # the RaggedDTensor operands, in order
    uargs = []
    for a in args:
        if type(a) is R:
            s = a._spec
            if spec is None:
                spec = s
            elif s is not spec and not _same_spec(s, spec):
                return SLOW
            inputs.append(a)
            uargs.append(a._local_tensor)
        elif isinstance(a, _Tensor):
            a = _scalar(a)
            if a is SLOW:
                return SLOW
            uargs.append(a)
        elif type(a) in (list, tuple):
            return SLOW
        else:
            uargs.append(a)
    ukwargs = kwargs
    if kwargs:
        ukwargs = {}
        for k, a in kwargs.items():
            if type(a) is R:
                s = a._spec
                if spec is None:
                    spec = s
                elif s is not spec and not _same_spec(s, spec):
                    return SLOW
                inputs.append(a)
                a = a._local_tensor
            elif isinstance(a, _Tensor):
                a = _scalar(a)
                if a is SLOW:
                    return SLOW
            elif type(a) in (list, tuple):
                return SLOW
            ukwargs[k] = a
    if spec is None or (_grad_enabled() and _requires_grad(inputs)):
        return SLOW
    with _no_subclass_function():
        out = func(*uargs, **ukwargs)
    local = inputs[0]._local_tensor
    if isinstance(out, _Tensor):
        return _one(out, inputs, local, spec)
    if type(out) in (list, tuple):
        return type(out)(_one(t, inputs, local, spec) for t in out)
    return out


def _one(t, inputs, local, spec):
    if not isinstance(t, _Tensor):
        return t
    for x in inputs:
        if x._local_tensor is t:
            return x  # in-place (or out=): the DTensor itself
    if t.shape != local.shape:
        raise RuntimeError(
            f"internal error: output of shape {list(t.shape)} cannot be wrapped as a RaggedShard "
            f"DTensor of local shape {list(local.shape)}"
        )
    return _wrap(t, spec)


def _tensor_list(a) -> bool:
    if type(a) not in (list, tuple):
        return False
    for e in a:
        if isinstance(e, _Tensor):
            return True
    return False


def per_position(func, args, kwargs):
    """A `_foreach_*`/fused optimizer op, layouts per list position; see the Note above."""
    R = _RAGGED
    first = None  # the first tensor list (RaggedDTensors only)
    specs = locals_ = None
    others = []  # RaggedDTensors of the other lists (for the autograd check)
    values = list(args)
    keys = list(kwargs)
    values.extend(kwargs.values())
    out_values = []
    for a in values:
        if _tensor_list(a):
            if first is None:
                for e in a:
                    if type(e) is not R:
                        return SLOW
                first = a
                specs = [e._spec for e in a]
                locals_ = [e._local_tensor for e in a]
                out_values.append(locals_)
                continue
            if len(a) != len(first):
                return SLOW
            loc = []
            for e, s in zip(a, specs):
                if type(e) is R:
                    es = e._spec
                    if es is not s and not _same_spec(es, s):
                        return SLOW
                    others.append(e)
                    loc.append(e._local_tensor)
                elif isinstance(e, _Tensor) and not isinstance(e, _DTensor) and e.dim() == 0:
                    loc.append(e)
                else:
                    return SLOW
            out_values.append(loc)
        elif isinstance(a, _Tensor):
            a = _scalar(a)
            if a is SLOW:
                return SLOW
            out_values.append(a)
        else:
            out_values.append(a)
    if first is None:
        return SLOW
    if _grad_enabled() and (_requires_grad(first) or _requires_grad(others)):
        return SLOW
    n = len(args)
    uargs = out_values[:n]
    ukwargs = dict(zip(keys, out_values[n:]))
    with _no_subclass_function():
        out = func(*uargs, **ukwargs)
    if type(out) not in (list, tuple):
        return out  # None (in-place fused ops)
    if out and type(out[0]) in (list, tuple):  # one list per output (functional fused ops)
        return type(out)(_wrap_list(o, first, specs, locals_) for o in out)
    return _wrap_list(out, first, specs, locals_)


def _wrap_list(out, first, specs, locals_):
    if len(out) != len(first):
        raise RuntimeError(
            f"internal error: {len(out)} outputs for lists of {len(first)} RaggedShard DTensors"
        )
    res = []
    for t, x, s, loc in zip(out, first, specs, locals_):
        if t is loc:
            res.append(x)  # in-place: the DTensor itself
        elif t.shape != loc.shape:
            raise RuntimeError(
                f"internal error: output of shape {list(t.shape)} cannot be wrapped as a "
                f"RaggedShard DTensor of local shape {list(loc.shape)}"
            )
        else:
            res.append(_wrap(t, s))
    return type(out)(res)


# --- clipping's norms ----------------------------------------------------------------------


def foreach_norm(tensors, ord=2, dtype=None):
    """`torch._foreach_norm` of RaggedShard DTensors: per tensor, this rank's norm as a 0-dim
    DTensor, partial over the sharded mesh dims ([Note: norms on RaggedShard])."""
    ragged = RaggedDTensor
    # All RaggedShard: ops.py splits mixed lists.
    tensors = [t if type(t) is ragged else as_ragged(t) for t in tensors]
    ord = float(ord)
    if torch.is_grad_enabled():
        for t in tensors:
            check_grad("_foreach_norm", t, dtype or t.dtype.to_real())
    # A shard with no element (of a tensor with some) holds the reduction's identity; the others
    # (and tensors with no element anywhere: torch's result or error) take torch's kernel.
    # Every read below is of the local tensor or the spec: a metadata read of the DTensor itself
    # (`t.numel()`, `t.device`) would enter its `__torch_function__`, per tensor.
    locals_ = [t._local_tensor for t in tensors]
    if all(x.numel() for x in locals_):
        values = torch._foreach_norm(locals_, ord, dtype=dtype) if locals_ else []
    else:
        computed = [i for i, (t, x) in enumerate(zip(tensors, locals_))
                    if x.numel() or not t._spec.tensor_meta.shape.numel()]
        some = [locals_[i] for i in computed]
        norms = dict(zip(computed, torch._foreach_norm(some, ord, dtype=dtype) if some else ()))
        # The identities: one fill per (dtype, device), unbound into 0-dim views (one launch,
        # and no copy from host memory, where a device would sync)
        empty: dict = {}
        for i, x in enumerate(locals_):
            if i not in norms:
                empty.setdefault((dtype or x.dtype.to_real(), x.device), []).append(i)
        for (dt, device), idx in empty.items():
            filled = torch.full((len(idx),), math.inf if ord < 0 else 0.0, dtype=dt,
                                device=device)
            norms.update(zip(idx, filled.unbind()))
        values = [norms[i] for i in range(len(tensors))]
    out = []
    specs = _NORM_SPECS
    for t, value in zip(tensors, values):
        spec = t._spec
        given, mesh = spec.placements, spec.mesh
        key = (id(given), id(mesh), ord, value.dtype)
        entry = specs.get(key)
        if entry is None or entry[0] is not given or entry[1] is not mesh:
            if len(specs) > 4096:
                specs.clear()
            entry = specs[key] = (given, mesh, _norm_spec(given, mesh, ord, value.dtype))
        out.append(DTensor(value, entry[2], requires_grad=False))
    return out


# (id(placements), id(mesh), ord, dtype) -> (placements, mesh, the norms' spec): the entry keeps
# the placements and mesh alive, so their ids are not reused while it is there.
_NORM_SPECS: dict = caches.register("placement.fastpath norm specs", {})
# (output placements, mesh, dtype) -> the one spec of norms with them
_SHARED_NORM_SPECS: dict = caches.register("placement.fastpath shared norm specs", {})


def _norm_placement(ord: float) -> Placement:
    """The placement torch's sharding propagation gives the norm of a tensor sharded on a mesh dim,
    so that our norms stack and reduce with torch's (ord inf/-inf/0: Partial max/min/sum)."""
    if hasattr(_math_ops, "_get_norm_reduction_op"):
        return _math_ops.get_placement_from_reduction_op(_math_ops._get_norm_reduction_op(ord))
    return _math_ops._NormPartial(ord)  # older torch: one placement that reduces every ord


def _norm_spec(given: tuple, mesh, ord: float, dtype) -> DTensorSpec:
    """The spec of `_foreach_norm`'s 0-dim output for an input with placements `given`: partial
    over the sharded mesh dims, Replicate on the others (what `DTensor.from_local` builds)."""
    if any(isinstance(p, Partial) for p in given):
        raise NotImplementedError(
            f"torch._foreach_norm of a RaggedShard DTensor with Partial placements {given}: "
            "reduce the Partial mesh dim first"
        )
    partial = _norm_placement(ord)
    placements = tuple(p if isinstance(p, Replicate) else partial for p in given)
    # One spec object per distinct result: torch.stack of the norms then finds every input's spec
    # identical to the first by identity, not by a Python `__eq__` per tensor.
    key = (placements, mesh, dtype)
    spec = _SHARED_NORM_SPECS.get(key)
    if spec is None:
        if len(_SHARED_NORM_SPECS) > 256:
            _SHARED_NORM_SPECS.clear()
        spec = _SHARED_NORM_SPECS[key] = DTensorSpec(mesh, placements,
                                                     TensorMeta(torch.Size(()), (), dtype))
    return spec
