"""Reductions of RaggedShard DTensors over some of their dims.

[Note: reductions over ragged-sharded dims]
`sum`, `mean`, `amax`, `amin`, `all`, `any` and `torch.linalg.vector_norm` with a `dim` (int or
tuple, `keepdim`, `dtype`) that leaves more than one element; both the torch functions and the
aten overloads below them (`aten.sum.dim_IntList`, `aten.mean.dim`, `aten.amax.default`,
`aten.all.dim`/`.dims`, `aten.linalg_vector_norm.default`, ...) come here from reductions.py and
norms.py. torch's own argument handling runs on a meta tensor of the global shape (recorded as
the one aten call it makes), so dims, keepdim, dtype and errors are torch's. Let k be the number
of ragged-sharded dims (the RaggedShard's `dims`) and R the reduced dims.
- R outside the rows (every d in R >= k): every output row is the reduction of one input row, so
  each rank reduces its local rows and the result stays RaggedShard, with the same `dims` and
  `local_units` on the kept dims. With nothing to combine this is torch's own kernel on the same
  rows (torch's result, bitwise); a `Shard(d)` on another mesh dim with d in R is combined as
  below and becomes Replicate; a kept Shard(e) stays, renumbered when a dim before e is dropped.
- R meets the rows (some d in R < k): a rank's rows [begin, end) of its block (the block it holds
  under the other placements, [Note: ragged layout on an N-D mesh]) are at most 2k-1 rectangular
  boxes of the block (`row_boxes`, the checkpoint's box math, [Note: flat range boxes]), each a
  contiguous slice of the local tensor. Each box is reduced over R with keepdim and combined into
  a tensor of the block's reduced shape (R set to 1) that starts as the reduction's identity (0
  for sums and counts, -inf/+inf or the integer dtype's min/max for amax/amin, True/False for
  all/any as an int64 1/0). Then ONE all-reduce per mesh dim that must combine, in mesh-dim
  order: the ragged mesh dim, and every mesh dim whose `Shard(d)` shards a reduced d; SUM for
  sum/mean/p-norm powers/count_nonzero, MAX for amax/any/inf-norm, MIN for amin/all/-inf-norm
  (all/any on an int64 tensor; float MAX/MIN carry NaN as a flag, `all_reduce` in
  reductions.py). The input is never gathered: each rank sends and receives only its block's
  reduced shape. Ranks with no local rows contribute the identity and still take part, and which
  collectives run depends only on shapes and placements, so every rank runs the same sequence.
  The ranks along a combined mesh dim hold blocks that differ only in dims it shards, which are
  reduced, so their reduced blocks have the same shape. The result is a torch DTensor, Replicate
  on the combined mesh dims, keeping other mesh dims' Replicate and Shard(e) (renumbered as above).
Like the full reductions ([Note: reductions on RaggedShard]) the combined result is reduced
(Replicate), not `Partial`: torch answers `.item()`, `bool()` and `.tolist()` of a Partial DTensor
with the local value, so `if x.any(0).all():` would see one rank's part. A `Partial(sum/avg)`
input mesh dim stays Partial for sum and mean (they are linear); other Partial inputs raise.
Numbers: float sums are taken per box in float64 (complex128; int64 for integer and bool sums),
combined and all-reduced in float64 and rounded once to the output dtype; mean divides the sum by
the product of the reduced dims' global sizes before that rounding. Norms sum |x|^p (each box's
norm raised to p in float64, as over all dims) and take the p-th root after the all-reduce;
inf/-inf are the max/min of |x|, ord 0 counts nonzeros. So amax/amin/all/any, count_nonzero and
inf/-inf/0 norms are torch's result bitwise; float sums, means and p-norms differ from torch's
single-process float32 summation order by round-off (a few ulps of the terms' magnitude).
Autograd does not flow through these ops (an input that requires grad raises in grad mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from veragged.placement.boxes import row_boxes
from veragged.placement.layout import normalize_placements, spec_layout
from veragged.placement.reduce_parts import (
    acc_dtype,
    all_reduce,
    identity,
    norm_finish,
    norm_part,
    norm_reduce_op,
)
from veragged.placement.tensor import RaggedDTensor, make_spec

__all__ = ["DIM_REDUCTIONS", "Reduction", "norm_reduction", "reduce_dims", "reduce_over_dims"]

DIM_REDUCTIONS = ("sum", "mean", "amax", "amin", "all", "any")


@dataclass(frozen=True)
class Reduction:
    """One reduction over dims, split into its per-box partial and its cross-rank combine.

    Attributes:
        name: the torch call, for messages.
        part: `part(t, dims)`: `t` reduced over `dims` with keepdim, in `acc`.
        direct: `direct(t, dims, keepdim)`: torch's own op (used when nothing is combined).
        combine: the element-wise combine of two partials (`torch.add`, `torch.maximum`, ...).
        op: the matching all-reduce op.
        identity: the partial of no element.
        acc: the partials' dtype.
        finish: the result (still `acc`) from the combined partial.
        linear: whether a Partial(sum/avg) mesh dim may stay Partial.
    """

    name: str
    part: Callable
    direct: Callable
    combine: Callable
    op: object
    identity: float | int
    acc: torch.dtype
    finish: Callable = lambda t: t  # noqa: E731
    linear: bool = False


def _sum_acc(out_dtype: torch.dtype) -> torch.dtype:
    if out_dtype.is_complex:
        return torch.complex128
    return torch.float64 if out_dtype.is_floating_point else torch.int64


def _reduction(name: str, dims: list[int], shape, dtype, out_dtype) -> Reduction:
    """The Reduction of `torch.<name>` over `dims` of a tensor of global `shape`; `dtype` is the
    call's dtype argument (sum/mean), `out_dtype` torch's output dtype."""
    fn = getattr(torch, name)
    if name in ("sum", "mean"):
        acc = _sum_acc(out_dtype)

        def part(t, d):
            return torch.sum(t if dtype is None else t.to(dtype), d, keepdim=True, dtype=acc)

        count = math.prod(shape[d] for d in dims)
        return Reduction(
            name, part, lambda t, d, keep: fn(t, d, keep, dtype=dtype), torch.add,
            dist.ReduceOp.SUM, 0, acc,
            (lambda t: t / count) if name == "mean" else (lambda t: t), linear=True,
        )
    if name in ("amax", "amin"):
        high = name == "amin"
        return Reduction(
            name, lambda t, d: fn(t, d, keepdim=True).to(acc_dtype(out_dtype)),
            lambda t, d, keep: fn(t, d, keep), torch.minimum if high else torch.maximum,
            dist.ReduceOp.MIN if high else dist.ReduceOp.MAX,
            int(identity(name, out_dtype)) if out_dtype == torch.bool
            else identity(name, out_dtype), acc_dtype(out_dtype),
        )
    if name in ("all", "any"):
        every = name == "all"
        return Reduction(
            name, lambda t, d: fn(t, d, keepdim=True).to(torch.int64),
            lambda t, d, keep: fn(t, d, keep), torch.minimum if every else torch.maximum,
            dist.ReduceOp.MIN if every else dist.ReduceOp.MAX, int(every), torch.int64,
        )
    raise NotImplementedError(f"torch.{name} over some dims of a RaggedShard DTensor")


def norm_reduction(ord: float, dtype) -> Reduction:
    """`torch.linalg.vector_norm(ord, dtype=dtype)` as a Reduction (partials from norms.py)."""
    combine = {math.inf: torch.maximum, -math.inf: torch.minimum}.get(ord, torch.add)
    return Reduction(
        "linalg.vector_norm",
        lambda t, d: norm_part(t, ord, d, dtype, keepdim=True),
        lambda t, d, keep: torch.linalg.vector_norm(t, ord, d, keep, dtype=dtype),
        combine, norm_reduce_op(ord), math.inf if ord == -math.inf else 0.0, torch.float64,
        lambda t: norm_finish(t, ord),
    )


class _Record(TorchDispatchMode):
    """Records the aten ops a function runs (on meta tensors)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _bind(func, args, kwargs) -> dict:
    """The arguments of aten overload `func` by schema name, defaults filled in."""
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def reduce_dims(name: str, fn, dt, args: tuple, kwargs: dict, meta: torch.Tensor):
    """`fn(dt, *args, **kwargs)` (torch.<name> or its Tensor method) reducing some dims of
    RaggedShard DTensor `dt`, torch's output on the global meta tensor being `meta`; see
    [Note: reductions over ragged-sharded dims]."""
    if name not in DIM_REDUCTIONS:
        raise NotImplementedError(
            f"torch.{name} with arguments {args} {kwargs} on a RaggedShard DTensor of shape "
            f"{list(dt.shape)}: over some dims only {', '.join(DIM_REDUCTIONS)} and vector "
            "norms are supported; redistribute to Replicate or Shard first"
        )
    shape = tuple(dt._spec.tensor_meta.shape)
    probe = torch.empty(shape, dtype=dt.dtype, device="meta")
    with _Record() as record:
        fn(probe, *args, **kwargs)
    calls = [c for c in record.calls if c[1] and c[1][0] is probe]
    if len(calls) != 1 or calls[0][0].overloadpacket is not getattr(torch.ops.aten, name):
        raise NotImplementedError(
            f"torch.{name} with arguments {args} {kwargs} on a RaggedShard DTensor runs "
            f"{[str(c[0]) for c in record.calls]}, not one aten.{name}"
        )
    bound = _bind(calls[0][0], calls[0][1], calls[0][2])
    dims = normalize_dims(bound.get("dim"), len(shape))
    kind = _reduction(name, dims, shape, bound.get("dtype"), meta.dtype)
    return reduce_over_dims(kind, dt, dims, bool(bound.get("keepdim", False)), meta,
                            f"torch.{name}(dim={bound.get('dim')})")


def normalize_dims(dim, ndim: int) -> list[int]:
    """`dim` (None, an int or a sequence; empty or None: every dim) as sorted non-negative dims."""
    if dim is None:
        return list(range(ndim))
    given = (dim,) if isinstance(dim, int) else tuple(dim)
    if not given:
        return list(range(ndim))
    return sorted({d % ndim for d in given}) if ndim else []


def reduce_over_dims(kind: Reduction, dt, dims: list[int], keepdim: bool, meta, call: str):
    """`kind` over `dims` (sorted, non-negative, not every dim) of RaggedShard DTensor `dt`; `meta`
    is torch's output on the global meta tensor. See [Note: reductions over ragged-sharded dims]."""
    layout = spec_layout(dt._spec)
    k = len(layout.placement.dims)
    inside = dims[0] < k
    ndim = dt.dim()
    placements, combine = [], []
    for j, p in enumerate(dt.placements):
        if j == layout.mesh_dim:
            if inside:
                combine.append(j)
                p = Replicate()
        elif isinstance(p, Partial):
            if not (kind.linear and p.reduce_op in ("sum", "avg")):
                raise NotImplementedError(
                    f"{call} of a RaggedShard DTensor with Partial placements {dt.placements}: "
                    "only sum and mean keep a Partial(sum/avg) mesh dim; reduce it first"
                )
        elif type(p) is Shard:
            d = p.dim % ndim
            if d in dims:  # the partials of this mesh dim's ranks are combined
                combine.append(j)
                p = Replicate()
            elif not keepdim:
                p = Shard(d - sum(r < d for r in dims))
        placements.append(p)
    if inside:
        return _over_rows(kind, dt, layout, dims, keepdim, meta, placements, combine)
    return _after_rows(kind, dt, layout, dims, keepdim, meta, placements, combine)


def _combined(kind: Reduction, part: torch.Tensor, mesh, combine: list[int], out_dtype):
    """The partials all-reduced over the `combine` mesh dims, finished, in `out_dtype`."""
    if part.numel():  # the same shape on every rank of each combined mesh dim (see the Note)
        part = all_reduce(part, kind.op, mesh, combine)
    return kind.finish(part).to(out_dtype)


def _after_rows(kind, dt, layout, dims, keepdim, meta, placements, combine):
    """R outside the rows: this rank's rows reduced locally, still RaggedShard."""
    k = len(layout.placement.dims)
    view = dt._local_tensor.reshape(layout.end - layout.begin, *layout.block_shape[k:])
    local_dims = tuple(d - k + 1 for d in dims)
    if not combine:
        local = kind.direct(view, local_dims, keepdim)
    else:
        local = _combined(kind, kind.part(view, local_dims), dt.device_mesh, combine, meta.dtype)
    placements = normalize_placements(meta.shape, dt.device_mesh, placements)
    spec = make_spec(dt.device_mesh, placements, meta.shape, meta.dtype)
    return RaggedDTensor._wrap(local.reshape(-1), spec)


def _over_rows(kind, dt, layout, dims, keepdim, meta, placements, combine):
    """R meets the rows: per-box partials, one all-reduce per combined mesh dim."""
    k = len(layout.placement.dims)
    block, rest = layout.block_shape, layout.block_shape[k:]
    reduced = set(dims)
    local = dt._local_tensor.reshape(-1)
    out = torch.full([1 if d in reduced else s for d, s in enumerate(block)], kind.identity,
                     dtype=kind.acc, device=local.device)
    per_row = layout.row_numel
    for offsets, sizes, first in row_boxes(tuple(block[:k]), layout.begin, layout.end):
        n = math.prod(sizes) * per_row
        if n == 0:
            continue  # rows without elements: the identity
        box = local[first * per_row : first * per_row + n].view(*sizes, *rest)
        index = tuple(
            slice(0, 1) if d in reduced else slice(o, o + s)
            for d, (o, s) in enumerate(zip(offsets, sizes))
        )
        out[index] = kind.combine(out[index], kind.part(box, tuple(dims)))
    value = _combined(kind, out, dt.device_mesh, combine, meta.dtype)
    if not keepdim:
        value = value.reshape([s for d, s in enumerate(block) if d not in reduced])
    spec = make_spec(dt.device_mesh, tuple(placements), meta.shape, meta.dtype)
    return DTensor(value, spec, requires_grad=False)
