"""Vector norms of RaggedShard DTensors.

[Note: norms on RaggedShard]
`torch.linalg.vector_norm` (and `aten.linalg_vector_norm` below it), every `ord` (p > 0, p < 0,
0, inf, -inf), `keepdim` and `dtype`:
- over all dims (no `dim`, `dim=None`, every dim, or dims that leave one element): each rank
  reduces its shard to a float64 partial, one all-reduce per sharded mesh dim combines them (sum
  of |x|^p, max or min of |x|, count of nonzeros), and the result is a Replicate DTensor, as for
  the other full reductions ([Note: reductions on RaggedShard]). A Partial placement raises.
- over some dims (inside or after the ragged-sharded dims, the RaggedShard's `dims`):
  [Note: reductions over ragged-sharded dims] (ragged_dim_reduce.py). Over dims after them every
  row of the result is the norm of one row of the input, so each rank runs torch's own kernel on
  its rows and the result stays RaggedShard, with the same `dims` and `local_units` on the kept
  dims; a `Shard(d)` on another mesh dim keeps sharding dim d when d is kept, and when d is
  reduced the partials are all-reduced over that mesh dim (as above) and it becomes Replicate.
  Over a ragged-sharded dim each rank reduces its rows box by box into the block's reduced
  shape, one all-reduce per combined mesh dim gives a Replicate result on those mesh dims.
`torch.linalg.norm`, `torch.norm`, `Tensor.norm` and `torch.linalg.matrix_norm` are composites:
torch's own argument handling runs on a meta tensor of the global shape, and when it computes one
vector norm of the whole input (vector norms, 'fro'), that vector norm runs as above; the other
matrix norms ('nuc', ord=2, ...) need whole matrices and raise.

`torch._foreach_norm` (what `clip_grad_norm_` calls on its foreach path; `fastpath.foreach_norm`,
beside the other per-parameter ops of a step) communicates nothing, as torch's does on Shard
DTensors: output i is a 0-dim torch DTensor holding this rank's norm of tensor i's shard (torch's
kernel; a shard with no element holds the identity, inf for ord < 0 and 0 otherwise), with the
placement torch gives a norm over a sharded mesh dim on every RaggedShard/Shard mesh dim (torch
2.15: `_NormPartial(ord)`, or Partial max/min/sum for inf/-inf/0) and Replicate on Replicate ones
(a Partial input raises). So `clip_grad_norm_` stacks and reduces them with torch's own DTensor ops
and turns the total into Replicate with one functional all-reduce per sharded mesh dim, as with
torch's FSDP. Unlike the reductions above, the outputs are partial: `.full_tensor()` gives the norm
of the full tensor, `.to_local()` and `.item()` this rank's part (as with torch's Shard DTensors);
the all-reduce is torch's, whose max/min may drop a NaN on some backends (gloo).

Numbers, compared with torch's norm of the full tensor:
- inf, -inf and 0 are exact (NaN propagates as in torch);
- over all dims with finite p, each rank's partial is torch's norm n of its shard (computed in
  float32 for half/bf16), raised to p in float64; the sum's p-th root is rounded once to the
  output dtype. When one rank holds every element, this is torch's result bitwise for p = 1 and
  2 (n^2 is exact in float64 for float32 n, and sqrt(n^2) = n). Otherwise the summation order
  differs from torch's single-process one and the result can differ in the last ulp (about 1e-7
  relative for float32; float64 partials can round n^p too);
- over kept ragged dims without a reduced Shard, each output element is computed by torch's own
  kernel on the same row, so it is torch's result; over a ragged-sharded dim or a reduced Shard,
  as over all dims (p-th powers of per-box norms summed in float64, root taken once);
- `torch._foreach_norm(...)[i].full_tensor()`: torch combines the ranks' norms in the output
  dtype (n^p, sum, p-th root), within a few ulps of its norm of the full tensor for finite p.
Autograd does not flow through these ops; with grad mode on, an input that requires grad raises.
"""

from __future__ import annotations

import torch

from veragged.placement.fastpath import foreach_norm
from veragged.placement.ragged_dim_reduce import _Record, norm_reduction, reduce_over_dims
from veragged.placement.reduce_parts import (
    all_reduce,
    check_grad,
    norm_finish,
    norm_part,
    norm_reduce_op,
    reduce_mesh_dims,
    result_dtensor,
    split_input,
)
from veragged.placement.tensor import as_ragged
from veragged.runtime import caches

__all__ = ["NORM_FUNCTIONS", "NORM_PACKETS"]

aten = torch.ops.aten

# argument key -> torch's meta result (cached: it only depends on them)
_META_NORMS: dict = caches.register("placement.norms meta results", {})


def _meta_norm(dt, ord, dim, keepdim, dtype) -> torch.Tensor:
    """torch's argument checks, output shape and dtype, on a meta tensor of the global shape."""
    meta = dt._spec.tensor_meta
    try:
        key = (meta.shape, meta.dtype, ord, dim if not isinstance(dim, list) else tuple(dim),
               keepdim, dtype)
        hash(key)
    except TypeError:  # an unhashable argument: no cache (torch raises or handles it)
        key = None
    out = _META_NORMS.get(key) if key is not None else None
    if out is None:
        out = torch.linalg.vector_norm(
            torch.empty(meta.shape, dtype=meta.dtype, device="meta"), ord, dim, keepdim,
            dtype=dtype,
        )
        if key is not None:
            if len(_META_NORMS) > 4096:
                _META_NORMS.clear()
            _META_NORMS[key] = out
    return out


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    """`torch.linalg.vector_norm` / `aten.linalg_vector_norm`; see [Note: norms on RaggedShard]."""
    dt = as_ragged(x)
    if out is not None:
        raise NotImplementedError(
            "torch.linalg.vector_norm(out=...) is not supported on RaggedShard DTensors"
        )
    meta = _meta_norm(dt, ord, dim, keepdim, dtype)
    check_grad("linalg.vector_norm", dt, meta.dtype)
    ord = float(ord)
    ndim = len(dt._spec.tensor_meta.shape)
    given = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    dims = sorted({d % ndim for d in given}) if ndim else []
    if meta.numel() == 1 or not dims or len(dims) == ndim:
        mesh_dims, placements = reduce_mesh_dims("linalg.vector_norm", dt)
        part = norm_part(dt._local_tensor, ord, dtype=dtype)
        norm = norm_finish(all_reduce(part, norm_reduce_op(ord), dt.device_mesh, mesh_dims), ord)
        value = norm.to(meta.dtype).reshape(meta.shape)
        return result_dtensor(value, dt.device_mesh, placements)
    # [Note: reductions over ragged-sharded dims] (inside or after the ragged-sharded rows)
    return reduce_over_dims(norm_reduction(ord, dtype), dt, dims, keepdim, meta,
                            f"torch.linalg.vector_norm(dim={dim})")




def _composite(name: str, fn):
    """A norm function built on `aten.linalg_vector_norm` (`torch.linalg.norm`, ...): torch's own
    code runs on a meta tensor of the global shape; if it is one vector norm of the input, that
    norm runs on the DTensor."""

    def handler(*args, **kwargs):
        x, rest, kw = split_input(args, kwargs)
        dt = as_ragged(x)
        meta = torch.empty(dt.shape, dtype=dt.dtype, device="meta")
        with _Record() as record:
            fn(meta, *rest, **kw)  # raises torch's own errors for bad arguments
        calls = record.calls
        if (
            len(calls) != 1
            or calls[0][0] is not aten.linalg_vector_norm.default
            or calls[0][1][0] is not meta
        ):
            ops = ", ".join(str(c[0]) for c in calls)
            raise NotImplementedError(
                f"{name} with arguments {rest} {kw} on a RaggedShard DTensor runs {ops}, not one "
                "vector norm of its input (matrix norms other than 'fro' need whole matrices); "
                "redistribute to Replicate or Shard first"
            )
        _, call_args, call_kwargs = calls[0]
        return _vector_norm(dt, *call_args[1:], **call_kwargs)

    return handler


# `__torch_function__` entries (func -> handler(*args, **kwargs)), and aten packets for
# `__torch_dispatch__`.
NORM_FUNCTIONS = {
    torch.linalg.vector_norm: _vector_norm,
    torch._foreach_norm: foreach_norm,
    torch.linalg.norm: _composite("torch.linalg.norm", torch.linalg.norm),
    torch.linalg.matrix_norm: _composite("torch.linalg.matrix_norm", torch.linalg.matrix_norm),
    torch.norm: _composite("torch.norm", torch.norm),
    torch.Tensor.norm: _composite("Tensor.norm", torch.Tensor.norm),
}
NORM_PACKETS = {aten.linalg_vector_norm: _vector_norm, aten._foreach_norm: foreach_norm}
