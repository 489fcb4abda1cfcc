"""`new_*` factories and integer indexing on RaggedShard DTensors.

[Note: new_* factories on RaggedShard]
`x.new_empty(size)`, `new_zeros`, `new_ones`, `new_full` and `new_empty_strided` give what torch's
DTensor gives for a sharded `x` (its sharding rule for these ops, `new_factory_single_dim_strategy`
in torch/distributed/tensor/_ops/_tensor_ops.py):
- `size` equal to `x`'s global shape: a DTensor of `x`'s placements, so a RaggedDTensor of the
  same layout whose local tensor is the local factory of the flat local shape (a Partial on
  another mesh dim stays Partial for `new_empty*` and becomes Replicate for the filled ones, as
  in torch; `new_empty_strided`'s stride is not kept: local shards are flat);
- any other size: a Replicate DTensor on `x`'s mesh of that global shape, every rank holding the
  whole tensor (a plain torch DTensor, as torch returns).
No communication. torchtitan's fused-QKV init relies on the second form: `param.new_empty(rows,
cols)` is replicated, initialised on every rank alike, concatenated and `copy_`d into the sharded
parameter, each rank keeping its part ([Note: replicated operands of ragged ops], ops.py). Both
forms are served from `__torch_function__` (the Tensor methods, with `requires_grad=`) and from
`__torch_dispatch__` (the aten ops, reached under `DisableTorchFunctionSubclass`).

[Note: integer indexing of RaggedShard]
`x[i]` (`aten.select.int` on dim 0) of a RaggedShard DTensor whose other placements are all
Replicate is a RaggedDTensor *view*: row `i` of the global tensor is a contiguous range of the
row-major elements, so each rank's part of it is a contiguous range of its flat local shard. The
result has shape `shape[1:]` and placement `RaggedShard(dims[1:], counts)`, `counts[r]` being the
number of rows of rank r inside row `i` (with `dims=()` or `dims=(0,)` the row sits whole on one
rank). In-place ops on it write into `x`'s shard: Hugging Face's
`init.zeros_(embedding.weight[padding_idx])` zeroes the padding row as it does in one process.
(torch's DTensor gathers a `Shard(0)` parameter for `select` and returns a Replicate copy, so there
the zeroing is lost.) `x[i] = value` is `x[i].copy_(value)`. Other indices, dims, a
StridedRaggedShard or `Shard` placements on other mesh dims raise NotImplementedError naming them.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from veragged.placement.layout import spec_layout
from veragged.placement.ragged_shard import RaggedShard, StridedRaggedShard
from veragged.placement.tensor import RaggedDTensor, as_ragged, cached_spec, make_spec

__all__ = ["FACTORY_FUNCTIONS", "FACTORY_PACKETS", "getitem", "select", "setitem"]

aten = torch.ops.aten

_NAMES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")
_VARARGS = frozenset({"new_empty", "new_zeros", "new_ones"})  # Tensor.new_zeros(3, 4)
_UNFILLED = frozenset({"new_empty", "new_empty_strided"})


def _split_size(name: str, rest: tuple, kwargs: dict):
    """(size, the other positional arguments) of a `new_*` call, whatever its spelling."""
    if "size" in kwargs:
        return kwargs.pop("size"), rest
    if not rest:
        raise TypeError(f"{name}() missing the size argument")
    if name in _VARARGS and not isinstance(rest[0], (list, tuple, torch.Size)):
        return rest, ()  # sizes given as separate ints
    return rest[0], rest[1:]


def _size(name: str, size) -> tuple[int, ...]:
    if isinstance(size, (numbers.Integral, torch.SymInt)):
        size = (size,)
    try:
        return tuple(int(s) for s in size)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: size must be a sequence of ints, got {size!r}") from None


def new_factory(func, name: str, args, kwargs):
    """`func` (`Tensor.new_*` or `aten.new_*`) on the RaggedDTensor `args[0]`; see
    [Note: new_* factories on RaggedShard]."""
    dt = as_ragged(args[0])
    kwargs = dict(kwargs)
    requires_grad = bool(kwargs.pop("requires_grad", False))
    size, extra = _split_size(name, tuple(args[1:]), kwargs)
    size = _size(name, size)
    local = dt._local_tensor
    spec = dt._spec
    if size == tuple(spec.tensor_meta.shape):
        local_size = tuple(local.shape)
        if name == "new_empty_strided":
            extra = ((1,) * len(local_size), *extra[1:])  # the flat local shard's stride
        with torch._C.DisableTorchFunctionSubclass():
            out = func(local, local_size, *extra, **kwargs)
        placements = spec.placements
        if name not in _UNFILLED and any(isinstance(p, Partial) for p in placements):
            placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        out_spec = cached_spec(spec.mesh, placements, size, out.dtype)
        return RaggedDTensor(out, out_spec, requires_grad=requires_grad)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(local, size, *extra, **kwargs)
    mesh = spec.mesh
    out_spec = make_spec(mesh, [Replicate()] * mesh.ndim, size, out.dtype, out.stride())
    return DTensor(out, out_spec, requires_grad=requires_grad)


def _tables():
    functions, packets = {}, {}
    for name in _NAMES:
        method = getattr(torch.Tensor, name)
        functions[method] = lambda *a, _f=method, _n=name, **k: new_factory(_f, _n, a, k)
        packet = getattr(aten, name)
        packets[packet] = lambda *a, _f=packet.default, _n=name, **k: new_factory(_f, _n, a, k)
    functions[torch.Tensor.select] = functions[torch.select] = _select_op
    packets[aten.select] = _select_op
    return functions, packets


# --- integer indexing ----------------------------------------------------------------------------


def _select_unsupported(dt, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} of a RaggedShard DTensor (shape {list(dt.shape)}, placements {dt.placements}) is "
        "not supported: only an integer index on dim 0 with Replicate on the other mesh dims "
        "([Note: integer indexing of RaggedShard]); redistribute to Replicate or Shard first"
    )


def select(dt, dim: int, index: int):
    """`dt[index]` along `dim` (= 0) as a RaggedDTensor view; see
    [Note: integer indexing of RaggedShard]."""
    shape = tuple(dt.shape)
    what = f"select(dim={dim}, index={index})"
    if not shape:
        raise IndexError("select() cannot be applied to a 0-dim tensor")
    if dim < 0:
        dim += len(shape)
    if dim != 0:
        raise _select_unsupported(dt, what)
    if torch.is_grad_enabled() and dt.requires_grad:
        raise NotImplementedError(
            f"{what}: autograd does not flow through views of RaggedShard DTensors; run it under "
            "torch.no_grad() (as torch.nn.init does)"
        )
    spec = dt._spec
    layout = spec_layout(spec)
    ragged = layout.placement
    others = [p for j, p in enumerate(spec.placements) if j != layout.mesh_dim]
    if type(ragged) is StridedRaggedShard or not all(isinstance(p, Replicate) for p in others):
        raise _select_unsupported(dt, what)
    if not -shape[0] <= index < shape[0]:
        raise IndexError(
            f"index {index} is out of bounds for dimension 0 with size {shape[0]}"
        )
    index %= shape[0]
    k = len(ragged.dims)
    local = dt._local_tensor
    row_numel = layout.row_numel  # elements per ragged row (the block is the whole tensor)
    rows_per_index = math.prod(shape[1:k]) if k else 1  # ragged rows inside row `index`
    if k == 0:
        dims, counts = (), ragged.local_units  # one row: the whole tensor on its holder
        per = math.prod(shape[1:])
        start, stop = (index * per, (index + 1) * per) if layout.end > layout.begin else (0, 0)
    elif rows_per_index == 0:  # an empty row
        dims, counts = tuple(range(k - 1)), ragged.local_units
        start = stop = 0
    else:
        lo, hi = index * rows_per_index, (index + 1) * rows_per_index
        units = ragged._units
        bounds = [p * layout.rows // units.total for p in units.prefix]  # rows of each rank
        counts = tuple(max(0, min(e, hi) - max(b, lo)) for b, e in zip(bounds, bounds[1:]))
        dims = tuple(range(k - 1))
        mine_lo = max(layout.begin, lo)
        mine_hi = min(layout.end, hi)
        if mine_hi > mine_lo:
            start = (mine_lo - layout.begin) * row_numel
            stop = (mine_hi - layout.begin) * row_numel
        else:
            start = stop = 0
    placements = tuple(
        RaggedShard(dims, counts) if j == layout.mesh_dim else p
        for j, p in enumerate(spec.placements)
    )
    out_spec = cached_spec(spec.mesh, placements, shape[1:], local.dtype)
    with torch._C.DisableTorchFunctionSubclass():
        view = local[start:stop]
    return RaggedDTensor(view, out_spec, requires_grad=False)


def _select_op(dt, dim, index):
    """`Tensor.select` / `torch.select` / `aten.select.int`; NotImplemented for a named dim."""
    if not (_integer(dim) and _integer(index)):
        return NotImplemented
    return select(dt, int(dim), int(index))


def _integer(index) -> bool:
    return isinstance(index, numbers.Integral) and not isinstance(index, bool)


def getitem(dt, index):
    """`dt[index]` for an integer index, else NotImplemented."""
    if not _integer(index):
        return NotImplemented
    return select(dt, 0, int(index))


def setitem(dt, index, value):
    """`dt[index] = value` for an integer index (`dt[index].copy_(value)`), else NotImplemented."""
    if not _integer(index):
        return NotImplemented
    row = select(dt, 0, int(index))
    if isinstance(value, torch.Tensor):
        row.copy_(value)
    else:
        row.fill_(value)
    return None


# `__torch_function__` entries (Tensor methods) and aten packets -> handler(*args, **kwargs).
FACTORY_FUNCTIONS, FACTORY_PACKETS = _tables()
