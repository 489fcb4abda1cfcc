"""Operands of ops on RaggedShard DTensors: local tensors in, RaggedDTensors out.

`unwrap` replaces the DTensor operands of an op by their local tensors, checking that the
RaggedShard ones share one layout (per list position for `_foreach_*` ops) and cutting operands
that every rank holds whole to the local rows ([Note: replicated operands of ragged ops]);
`wrap` wraps the op's local outputs under those layouts. See [Note: ops on RaggedShard DTensors]
(ops.py).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate
from torch.utils._pytree import tree_map

from veragged.placement.layout import spec_layout
from veragged.placement.tensor import RaggedDTensor, as_ragged

__all__ = ["is_ragged_dt", "name_of", "unwrap", "wrap"]

aten = torch.ops.aten


def is_ragged_dt(x) -> bool:
    return isinstance(x, RaggedDTensor)


def _same_layout(a: DTensor, b: DTensor) -> bool:
    return (
        a._spec.mesh == b._spec.mesh
        and a._spec.placements == b._spec.placements
        and a.shape == b.shape
    )


def _layout_error(name, a: DTensor, b: DTensor) -> ValueError:
    return ValueError(
        f"{name}: RaggedShard DTensor operands must have identical layouts, "
        f"got shape {list(a.shape)} placements {a.placements} "
        f"and shape {list(b.shape)} placements {b.placements}"
    )


def _unwrap_scalar(name, t: torch.Tensor, slot: int):
    """A 0-dim non-ragged tensor operand: its value is the same on every rank."""
    if isinstance(t, DTensor):
        if any(isinstance(p, Partial) for p in t.placements):
            raise ValueError(
                f"{name}: a 0-dim Partial DTensor operand must be reduced first ({t.placements})"
            )
        return t._local_tensor
    return t


class _Broadcast:
    """A non-ragged operand of more than 0 dims, cut to the local rows once the layout of the
    RaggedShard operands is known ([Note: replicated operands of ragged ops])."""

    __slots__ = ("tensor", "slot")

    def __init__(self, tensor: torch.Tensor, slot: int):
        self.tensor, self.slot = tensor, slot


def _local_rows(name: str, t: torch.Tensor, ref: DTensor, copy_source: bool = False
                ) -> torch.Tensor:
    """[Note: replicated operands of ragged ops]
    An element-wise op may combine a RaggedShard DTensor with a tensor every rank holds whole:
    a Replicate DTensor (on the same mesh), or a plain tensor under torch's
    `implicit_replication()` (outside it, as with torch's DTensor, a plain tensor of more than
    one element raises). Its shape must broadcast to the ragged operand's global shape without
    enlarging it (a bias against a weight, a full-size tensor). Each rank then cuts out the
    elements matching its own local shard: the block it holds under the other placements
    (torch's block offset), then its rows [begin, end) of that block (by unravelling the row
    indices, so only the local elements are ever copied, whatever the broadcast). No
    communication; every element of the result is computed by the same kernel from the same
    two values as in the full-tensor op, so it is bit-exact.
    The source of a `copy_` into a RaggedShard DTensor may be a plain tensor outside
    `implicit_replication()` too (where torch's DTensor raises): the copy has one meaning, every
    rank passes the whole source and keeps its own part (Hugging Face's `init.copy_(param,
    values)`, torchtitan's fused-QKV init). The destination of an in-place op must be the
    RaggedShard DTensor itself: writing into a plain or Replicate tensor from a RaggedShard one
    would fill only this rank's part of it, so it raises (gather with `.full_tensor()` first)."""
    if isinstance(t, DTensor):
        if t.device_mesh != ref.device_mesh or not all(
                isinstance(p, Replicate) for p in t.placements):
            raise ValueError(
                f"{name}: a RaggedShard DTensor can be combined with RaggedShard DTensors of the "
                "same layout, Replicate DTensors on its mesh and 0-dim tensors; got a DTensor of "
                f"shape {list(t.shape)} with placements {t.placements}: redistribute it first"
            )
        t = t._local_tensor
    elif not (copy_source or DTensor._op_dispatcher._allow_implicit_replication):
        raise ValueError(
            f"{name}: a RaggedShard DTensor is combined with a plain tensor of shape "
            f"{list(t.shape)}; as with torch's DTensor, plain tensors of more than one element "
            "are taken as replicated only under "
            "torch.distributed.tensor.experimental.implicit_replication()"
        )
    shape = tuple(ref.shape)
    try:
        fits = tuple(torch.broadcast_shapes(t.shape, shape)) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name}: an operand of shape {list(t.shape)} does not broadcast to the RaggedShard "
            f"DTensor's shape {list(shape)} (the result must keep that shape)"
        )
    lay = spec_layout(ref._spec)
    block = t.expand(shape)[tuple(slice(o, o + n)
                                  for o, n in zip(lay.block_offset, lay.block_shape))]
    k = len(lay.placement.dims)
    if k <= 1:
        rows = block[lay.begin:lay.end] if k else block[None][lay.begin:lay.end]
    else:
        index, coords = torch.arange(lay.begin, lay.end, device=t.device), []
        for size in reversed(lay.block_shape[:k]):
            coords.append(index % size)
            index = index // size
        rows = block[tuple(reversed(coords))]
    return rows.reshape(-1)


def _as_ragged(x):
    return as_ragged(x) if isinstance(x, DTensor) else x


_COPY = frozenset({torch.Tensor.copy_, aten.copy_.default})


def _writes_first(func) -> bool:
    """Whether `func` writes into its first argument (an in-place op)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        info = schema.arguments[0].alias_info if schema.arguments else None
        return info is not None and info.is_write
    name = name_of(func)
    return name.endswith("_") and not name.startswith("__") or name in _INPLACE_DUNDERS


_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in "add sub mul truediv div floordiv mod pow and or xor lshift rshift "
    "matmul".split()
)


def _check_write_target(name: str, first) -> None:
    """The tensors an in-place op writes into must be RaggedShard DTensors (see
    [Note: replicated operands of ragged ops])."""
    for t in first if isinstance(first, (list, tuple)) else (first,):
        if isinstance(t, torch.Tensor) and not is_ragged_dt(_as_ragged(t)):
            kind = (f"a DTensor with placements {t.placements}" if isinstance(t, DTensor)
                    else "a plain tensor")
            raise ValueError(
                f"{name} writes into {kind} of shape {list(t.shape)} from a RaggedShard "
                "DTensor, which holds only this rank's part: gather it with .full_tensor() "
                "(or redistribute) first"
            )


def unwrap(name: str, args, kwargs, func=None):
    """Replace DTensors by local tensors (`func`, when given, is checked for in-place writes
    and `copy_`).

    Return (args, kwargs, layout reference per output slot, local tensor id -> DTensor).
    """
    if func is not None and args and _writes_first(func):
        _check_write_target(name, args[0])
    copy_source = func in _COPY
    refs: dict[int, DTensor] = {}  # list position (or -1 for non-list operands) -> layout reference
    locals_to_dt: dict[int, DTensor] = {}
    deferred: list[int] = []  # slots holding a _Broadcast

    def check(dt: DTensor, slot: int) -> None:
        ref = refs.setdefault(slot, dt)
        if ref is not dt and not _same_layout(ref, dt):
            raise _layout_error(name, ref, dt)

    def leaf(x, slot: int):
        x = _as_ragged(x)  # torch code may hand back a plain DTensor with a RaggedShard spec
        if is_ragged_dt(x):
            check(x, slot)
            locals_to_dt[id(x._local_tensor)] = x
            return x._local_tensor
        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                return _unwrap_scalar(name, x, slot)
            deferred.append(slot)
            return _Broadcast(x, slot)
        return x

    def arg(x):
        if isinstance(x, torch.Tensor):
            return leaf(x, -1)
        if isinstance(x, (list, tuple)):
            if any(isinstance(e, torch.Tensor) for e in x):
                return type(x)(leaf(e, i) for i, e in enumerate(x))
            return x
        if x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype, torch.device)):
            return x
        return tree_map(lambda e: leaf(e, -1), x)

    uargs = tuple(arg(a) for a in args)
    ukwargs = {k: arg(v) for k, v in kwargs.items()}
    if -1 in refs:  # a lone DTensor operand next to lists: it must match every list position
        for slot, ref in refs.items():
            if slot != -1 and not _same_layout(ref, refs[-1]):
                raise _layout_error(name, refs[-1], ref)
    if deferred:  # [Note: replicated operands of ragged ops]
        def cut(x):
            if not isinstance(x, _Broadcast):
                return x
            ref = refs.get(x.slot)
            if ref is None:
                ref = refs.get(-1)
            if ref is None:
                ref = next(iter(refs.values()))
            return _local_rows(name, x.tensor, ref, copy_source)

        uargs = tree_map(cut, uargs)
        ukwargs = tree_map(cut, ukwargs)
    return uargs, ukwargs, refs, locals_to_dt


def wrap(out, refs, locals_to_dt):
    """Wrap local outputs as RaggedDTensors: output i of a `_foreach_*` op takes the layout of
    list position i, any other output the layout shared by the DTensor operands."""
    lists = any(slot >= 0 for slot in refs)

    def one(t, slot: int):
        if not isinstance(t, torch.Tensor):
            return t
        same = locals_to_dt.get(id(t))
        if same is not None and same._local_tensor is t:
            return same  # in-place op: hand back the DTensor itself
        ref = refs.get(slot, refs.get(-1))
        if ref is None or t.shape != ref._local_tensor.shape:
            raise RuntimeError(
                f"internal error: output of shape {list(t.shape)} "
                "cannot be wrapped as a RaggedShard DTensor"
            )
        return RaggedDTensor._wrap(t, ref._spec)

    if isinstance(out, (list, tuple)):
        return type(out)(one(t, i if lists else -1) for i, t in enumerate(out))
    return one(out, -1)


def name_of(func) -> str:
    return getattr(func, "__name__", None) or str(func)
