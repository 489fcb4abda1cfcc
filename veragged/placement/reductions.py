"""Full reductions and comparisons of RaggedShard DTensors.

[Note: reductions on RaggedShard]
`sum`, `nansum`, `mean`, `prod`, `max`, `min`, `amax`, `amin`, `all` and `any` over all dims (no
dim, `dim=None`, every dim listed, or any dims that leave one element; `keepdim` is honoured)
reduce the local shard and then all-reduce once per sharded mesh dim. `sum`, `mean`, `amax`,
`amin`, `all` and `any` over some dims (inside or after the ragged-sharded rows) are handed to
ragged_dim_reduce.py: [Note: reductions over ragged-sharded dims]; `nansum` and `prod` over some
dims, and `max`/`min` with a dim (values and indices), raise NotImplementedError. A full
reduction's result is a plain torch `DTensor`, `Replicate` on every mesh dim whose placement was
RaggedShard/Shard/Replicate (a `Partial` sum/avg mesh dim stays Partial for `sum`/`mean`; other
reductions of Partial inputs raise).

Why Replicate and not `Partial`: torch (2.15) answers `.item()`, `bool()`, `float()` of a Partial
DTensor with the *local* value (`_local_scalar_dense` skips sharding propagation), so
`if not mask.any():` (in `nn.init.trunc_normal_`), `assert (a == b).all()` or `x.max().item()`
would silently see one rank's part and ranks could take different branches. Reducing eagerly
costs one all-reduce of a few bytes per call and makes every use of the result right.

Semantics, compared with the single-process reduction of the full tensor:
- an empty local shard contributes the reduction's identity (0 for sums, 1 for prod, -inf/+inf
  or the integer dtype's min/max for max/min, True for all, False for any); a tensor whose global
  numel is 0 gives what torch gives (max/min/amax/amin raise the same error, sum 0, mean nan);
- the result's shape and dtype are torch's (int sums are int64, all/any of uint8 is uint8, ...);
- max/min/amax/amin/all/any are bitwise equal: each rank's partial is exact, the all-reduce runs
  in float64/int64 (exact for every float/int dtype; NaN propagates through a separate flag, so a
  NaN on any rank gives NaN as in torch; a zero result may differ from torch's in its sign, as
  -0.0 and 0.0 compare equal);
- sum/nansum/mean/prod of floating tensors are equal within round-off: the local partials are
  computed in the output dtype (float32 for half/bfloat16) and combined in float64, then rounded
  once, so the result can differ from torch's own summation order in the last bits (about
  1e-7 relative for float32); integer sums and products are exact (products wrap like torch's).
`torch.equal` and `torch.allclose` of two RaggedShard DTensors compare the local shards (after one
redistribution if the layouts differ) and return the same Python bool on every rank; with a
non-0-dim plain tensor they raise ValueError (compare `.full_tensor()` instead).
`torch.testing.assert_close` and `TestCase.assertEqual` unwrap two DTensors to their local shards
when the placements are equal (each rank checks its shard), and raise for a DTensor against a
plain tensor; that is torch's code and works unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from veragged.placement.ragged_dim_reduce import reduce_dims
from veragged.placement.redistribute import redistribute
from veragged.placement.reduce_parts import (
    acc_dtype,
    all_reduce,
    check_grad,
    identity,
    local_float_dtype,
    reduce_mesh_dims,
    result_dtensor,
    split_input,
)
from veragged.placement.tensor import RaggedDTensor, as_ragged

__all__ = ["REDUCTION_FUNCTIONS", "REDUCTION_PACKETS", "all_reduce"]

aten = torch.ops.aten

_SUM_LIKE = ("sum", "nansum", "mean")


def _reduce(name: str, fn, x, args: tuple, kwargs: dict):
    """`fn(x, *args, **kwargs)` for a reduction `name` that must cover every element."""
    dt = as_ragged(x)
    if kwargs.get("out") is not None:
        raise NotImplementedError(f"torch.{name}(out=...) is not supported on RaggedShard DTensors")
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    # torch's own argument parsing, shape and dtype: a meta dry run on the global shape, and a real
    # run on a tensor clipped to at most one element per dim (empty iff the global tensor is), so
    # every rank raises torch's own error (max of an empty tensor, mean of ints, ...) together.
    local = dt._local_tensor
    tiny = torch.zeros([min(s, 1) for s in dt.shape], dtype=dt.dtype, device=local.device)
    out = fn(tiny, *args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise NotImplementedError(
            f"torch.{name} with arguments {args} {kwargs} on a RaggedShard DTensor: only "
            "reductions over all dims are supported (values and indices are not)"
        )
    out_dtype = out.dtype
    meta = fn(torch.empty(dt.shape, dtype=dt.dtype, device="meta"), *args, **kwargs)
    check_grad(name, dt, out_dtype)
    if meta.numel() != 1:  # some dims: [Note: reductions over ragged-sharded dims]
        return reduce_dims(name, fn, dt, args, kwargs, meta)
    mesh_dims, placements = reduce_mesh_dims(name, dt)
    acc = acc_dtype(out_dtype)
    if name in _SUM_LIKE:
        sum_fn = torch.nansum if name == "nansum" else torch.sum
        part = sum_fn(local, dtype=local_float_dtype(out_dtype)).to(acc)
        op = dist.ReduceOp.SUM
    elif name == "prod":
        part = torch.prod(local, dtype=local_float_dtype(out_dtype)).to(acc)
        op = dist.ReduceOp.PRODUCT
    elif name in ("all", "any"):
        part = fn(local).to(torch.int64)  # empty: True / False
        op = dist.ReduceOp.MIN if name == "all" else dist.ReduceOp.MAX
    else:  # max, min, amax, amin
        high = name in ("min", "amin")
        if local.numel():
            part = (torch.amin if high else torch.amax)(local).to(acc)
        else:
            part = torch.tensor(identity(name, out_dtype), dtype=acc, device=local.device)
        op = dist.ReduceOp.MIN if high else dist.ReduceOp.MAX
    part = all_reduce(part, op, dt.device_mesh, mesh_dims)
    if name == "mean":
        part = part / dt.numel() if dt.numel() else part / 0.0
    value = part.to(out_dtype).reshape(meta.shape)
    return result_dtensor(value, dt.device_mesh, placements)


def _reduction(name: str, fn):
    def handler(*args, **kwargs):
        x, args, kwargs = split_input(args, kwargs)
        return _reduce(name, fn, x, args, kwargs)

    return handler


def _extremum(name: str, fn):
    """max/min: the full reduction, or NotImplemented for the binary (element-wise) form."""

    def handler(*args, **kwargs):
        x, args, kwargs = split_input(args, kwargs)
        other = args[0] if args else kwargs.get("other")
        if isinstance(other, torch.Tensor):
            return NotImplemented  # torch.max(a, b): element-wise, served by the generic path
        if args or "dim" in kwargs:
            raise NotImplementedError(
                f"torch.{name}(dim=...) on a RaggedShard DTensor returns values and indices, "
                f"which are not supported; use torch.a{name} for values over all dims or "
                "redistribute to Replicate or Shard first"
            )
        return _reduce(name, fn, x, (), kwargs)

    return handler


def _pair(name: str, input, other):
    """(x, y, ref): both operands as DTensors with the layout of the RaggedShard one (`ref`), one
    redistribution if they differ; y is None if the shapes differ."""
    x, y = as_ragged(input), as_ragged(other)
    ref = x if isinstance(x, RaggedDTensor) else y
    for t in (x, y):
        if not isinstance(t, DTensor):
            raise ValueError(
                f"torch.{name} between a RaggedShard DTensor and a {type(t).__name__} is "
                "ambiguous: compare x.full_tensor() with the full tensor, or x.to_local() with "
                "the local shard"
            )
    if x.device_mesh != y.device_mesh:
        raise ValueError(
            f"torch.{name}: DTensors on different meshes ({x.device_mesh}, {y.device_mesh})"
        )
    for p in x.placements + y.placements:
        if isinstance(p, Partial):
            raise ValueError(f"torch.{name}: Partial DTensors must be reduced first")
    if x.shape != y.shape:
        return x, None, ref
    if x.placements != ref.placements:
        x = redistribute(x, ref.device_mesh, ref.placements)
    if y.placements != ref.placements:
        y = redistribute(y, ref.device_mesh, ref.placements)
    return x, y, ref


def _all_ranks(dt: DTensor, ok: bool) -> bool:
    """`ok` and-ed over the ranks that hold other parts of `dt`; the same bool on every rank."""
    flag = torch.tensor(int(ok), dtype=torch.int64, device=dt._local_tensor.device)
    for j, p in enumerate(dt.placements):
        if not isinstance(p, Replicate):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=dt.device_mesh.get_group(j))
    return bool(flag.item())


def _equal(input, other):
    x, y, ref = _pair("equal", input, other)
    if y is None:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        ok = torch.equal(x._local_tensor, y._local_tensor)
    return _all_ranks(ref, ok)


def _allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    def scalar(t):
        if not isinstance(t, torch.Tensor):
            return t  # a Python number
        if t.dim() == 0 and not _ragged_instance(t):
            if isinstance(t, DTensor):
                if any(isinstance(p, Partial) for p in t.placements):
                    raise ValueError("torch.allclose: a 0-dim Partial DTensor must be reduced")
                return t._local_tensor
            return t
        return None

    sx, sy = scalar(input), scalar(other)
    if sx is not None or sy is not None:
        ref = as_ragged(other if sx is not None else input)
        lx = sx if sx is not None else ref._local_tensor
        ly = sy if sy is not None else ref._local_tensor
    else:
        x, y, ref = _pair("allclose", input, other)
        if y is None:
            raise RuntimeError(
                f"torch.allclose: shapes {list(x.shape)} and {list(as_ragged(other).shape)} differ"
            )
        lx, ly = x._local_tensor, y._local_tensor
    with torch._C.DisableTorchFunctionSubclass():
        ok = torch.allclose(lx, ly, rtol=rtol, atol=atol, equal_nan=equal_nan)
    return _all_ranks(ref, ok)


def _ragged_instance(t) -> bool:
    return isinstance(as_ragged(t), RaggedDTensor)


def _tables():
    torch_level, packets = {}, {}
    for name in ("sum", "nansum", "mean", "prod", "amax", "amin", "all", "any"):
        fn = getattr(torch, name)
        handler = _reduction(name, fn)
        torch_level[fn] = torch_level[getattr(torch.Tensor, name)] = handler
        packets[getattr(aten, name)] = handler
    for name in ("max", "min"):
        fn = getattr(torch, name)
        handler = _extremum(name, fn)
        torch_level[fn] = torch_level[getattr(torch.Tensor, name)] = handler
        packets[getattr(aten, name)] = handler
    for fn, handler in ((torch.equal, _equal), (torch.allclose, _allclose)):
        torch_level[fn] = torch_level[getattr(torch.Tensor, fn.__name__)] = handler
        packets[getattr(aten, fn.__name__)] = handler
    return torch_level, packets


# `__torch_function__` entries (func -> handler(*args, **kwargs)), and aten packets for
# `__torch_dispatch__`; a handler returns NotImplemented to leave the call to the generic path.
REDUCTION_FUNCTIONS, REDUCTION_PACKETS = _tables()
