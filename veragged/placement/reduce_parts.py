"""What full reductions, reductions over some dims and norms of RaggedShard DTensors share:
the mesh dims to all-reduce over, the dtypes partials are combined in, identities of empty
shards, the cross-rank all-reduce and the norms' partials ([Note: reductions on RaggedShard],
reductions.py; [Note: reductions over ragged-sharded dims], ragged_dim_reduce.py; [Note: norms
on RaggedShard], norms.py)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from veragged.placement.tensor import cached_spec

__all__ = [
    "acc_dtype", "all_reduce", "check_grad", "identity", "local_float_dtype", "norm_finish",
    "norm_part", "norm_reduce_op", "reduce_mesh_dims", "result_dtensor", "split_input",
]


def reduce_mesh_dims(name: str, dt: DTensor) -> tuple[list[int], tuple]:
    """Mesh dims to all-reduce over, and the output placements."""
    dims, placements = [], []
    for j, p in enumerate(dt.placements):
        if isinstance(p, Replicate):
            placements.append(p)
        elif isinstance(p, Partial):
            if name not in ("sum", "mean") or p.reduce_op not in ("sum", "avg"):
                raise NotImplementedError(
                    f"{name} of a RaggedShard DTensor with Partial placements {dt.placements}: "
                    "only sum and mean keep a Partial(sum/avg) mesh dim; reduce it first"
                )
            placements.append(p)
        else:
            dims.append(j)
            placements.append(Replicate())
    return dims, tuple(placements)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cross-rank all-reduce runs in (exact for max/min of every real dtype)."""
    if dtype.is_floating_point:
        return torch.float64
    if dtype.is_complex or dtype == torch.uint64:
        return dtype
    return torch.int64


def local_float_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def identity(name: str, dtype: torch.dtype) -> float | int | bool:
    """The value an empty shard contributes to max/min (`dtype` is the output dtype)."""
    high = name in ("min", "amin")
    if dtype == torch.bool:
        return high
    if dtype.is_floating_point:
        return math.inf if high else -math.inf
    info = torch.iinfo(dtype)
    return info.max if high else info.min


def check_grad(name: str, dt: DTensor, out_dtype: torch.dtype) -> None:
    if torch.is_grad_enabled() and dt.requires_grad and (
        out_dtype.is_floating_point or out_dtype.is_complex
    ):
        raise NotImplementedError(
            f"{name}: autograd does not flow through reductions of RaggedShard DTensors; run it "
            "under torch.no_grad() or redistribute to Replicate/Shard first"
        )


def result_dtensor(value: torch.Tensor, mesh, placements) -> DTensor:
    """`DTensor.from_local(value, mesh, placements, run_check=False)` for a reduction's result
    (Replicate or Partial placements, so its global shape is its local one), built directly:
    these results carry no autograd, so from_local's autograd function is not needed."""
    spec = cached_spec(mesh, placements, value.shape, value.dtype, value.stride())
    return DTensor(value, spec, requires_grad=False)


def all_reduce(part: torch.Tensor, op, mesh, mesh_dims) -> torch.Tensor:
    """`part` all-reduced with `op` over `mesh_dims` of `mesh`, one collective per mesh dim.

    A floating MAX/MIN carries NaN as a separate flag, since gloo's max/min may drop a NaN: a NaN
    on any rank gives NaN, as torch's max/min of the whole tensor does.
    """
    # A mesh dim of one rank has nothing to combine (torch's redistribute skips it too).
    mesh_dims = [j for j in mesh_dims if mesh.size(j) > 1]
    extremum = op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)
    if not (mesh_dims and extremum and part.is_floating_point()):
        for j in mesh_dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(j))
        return part
    sign = 1.0 if op == dist.ReduceOp.MAX else -1.0
    nan = torch.isnan(part)
    both = torch.stack([part.masked_fill(nan, -sign * math.inf), nan.to(part.dtype) * sign])
    for j in mesh_dims:
        dist.all_reduce(both, op=op, group=mesh.get_group(j))
    return both[0].masked_fill(both[1] != 0, math.nan)


def split_input(args: tuple, kwargs: dict):
    """(input, other args, other kwargs), with `input=` (or aten's `self=`) given by keyword."""
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("input", kwargs.pop("self", None)), (), kwargs


_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def norm_reduce_op(ord: float):
    return {math.inf: dist.ReduceOp.MAX, -math.inf: dist.ReduceOp.MIN}.get(ord, dist.ReduceOp.SUM)


def norm_part(t: torch.Tensor, ord: float, dims=None, dtype=None, keepdim=False) -> torch.Tensor:
    """The float64 partial of `t` over `dims` (None: all) whose all-reduce gives the norm:
    sum |x|^ord, max |x| (inf), min |x| (-inf) or the count of nonzeros (0)."""
    if dtype is not None:
        t = t.to(dtype)  # torch casts the input first
    if dims is None and t.numel() == 0:  # the identity; torch's norm of an empty shard raises
        # a fill, not torch.tensor(..., device=): that copies from pageable host memory and
        # syncs the host with an accelerator's stream
        return torch.full((), math.inf if ord == -math.inf else 0.0, dtype=torch.float64,
                          device=t.device)
    if ord == 0:
        count = torch.count_nonzero(t, dims).to(torch.float64)
        if keepdim and dims is not None:
            count = count.reshape([1 if d in dims else s for d, s in enumerate(t.shape)])
        return count
    if ord in (math.inf, -math.inf):
        return torch.linalg.vector_norm(t, ord, dims, keepdim).to(torch.float64)
    norm = torch.linalg.vector_norm(t, ord, dims, keepdim, dtype=_WIDE.get(t.dtype))
    return norm.to(torch.float64).pow(ord)


def norm_finish(part: torch.Tensor, ord: float) -> torch.Tensor:
    """The norm from an all-reduced partial (still float64)."""
    if ord in (0, math.inf, -math.inf):
        return part
    return part.sqrt() if ord == 2 else part.pow(1.0 / ord)
