"""Full state-dict values placed like the values they replace (for veragged.checkpoint.state_dict).

A state dict here is a tree of dicts, lists and tuples whose leaves are tensors or other values;
a leaf's *path* is the tuple of keys and indices leading to it. The value a leaf replaces
("like") is the leaf of this rank's current state dict at the same path, looked up by the path
joined with dots (`like_index`): `"state.0.weight.exp_avg"` for AdamW's `exp_avg` of parameter
`0.weight`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veragged.placement import RaggedDTensor, distribute_tensor

__all__ = [
    "distribute_ragged", "first_ragged", "like_index", "receive_from_rank0",
    "shard_like",
]

@dataclass(frozen=True)
class _TensorSpec:
    """Stands for a tensor of rank 0's state dict in the broadcast skeleton; the tensor itself
    follows in a broadcast of its own, in skeleton order."""

    shape: torch.Size
    dtype: torch.dtype


def _name(path: tuple) -> str:
    return ".".join(map(str, path))


def _leaves(tree: Any, path: tuple = ()):
    """(path, leaf) for every leaf of `tree`, in order."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif type(tree) in (list, tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _map(tree: Any, fn: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """`tree` rebuilt (mappings as dicts, lists, tuples) with each leaf replaced by
    fn(path, leaf), called in `_leaves` order. A module state dict's `_metadata` (its modules'
    versions, read by `load_state_dict`) is kept."""
    if isinstance(tree, Mapping):
        out = {k: _map(v, fn, (*path, k)) for k, v in tree.items()}
        metadata = getattr(tree, "_metadata", None)
        if metadata is not None:
            out = OrderedDict(out)
            out._metadata = metadata
        return out
    if type(tree) in (list, tuple):
        return type(tree)(_map(v, fn, (*path, i)) for i, v in enumerate(tree))
    return fn(path, tree)


def like_index(tree: Any) -> dict[str, Any]:
    """The leaves of `tree` by dotted path: where a value of another state dict lands."""
    return {_name(path): leaf for path, leaf in _leaves(tree)}


def first_ragged(tree: Any) -> RaggedDTensor | None:
    """The first RaggedShard DTensor among the leaves of `tree`, or None."""
    return next((v for _, v in _leaves(tree) if isinstance(v, RaggedDTensor)), None)


def shard_like(full: torch.Tensor, like: Any, path: tuple, src_data_rank: int | None) -> Any:
    """`full` as a DTensor placed like `like` (when `like` is one) that holds only this rank's
    piece, copied out of `full` so that `full` can be freed."""
    if not isinstance(like, DTensor):
        return full
    if full.shape != like.shape:
        raise ValueError(
            f"state dict value {_name(path)!r} has shape {tuple(full.shape)}, but the value it "
            f"loads into has shape {tuple(like.shape)}"
        )
    dt = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=src_data_rank)
    local = dt.to_local()
    if local.untyped_storage().data_ptr() != full.untyped_storage().data_ptr() or not local.numel():
        return dt  # veragged's slices are copies
    # torch's distribute_tensor keeps views of `full` for src_data_rank=None (Shard(0) chunks).
    return DTensor.from_local(
        dt.to_local().clone(), dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride()
    )


def distribute_ragged(tree: Any, like: dict[str, Any]) -> Any:
    """`tree` (full values on every rank) with each plain tensor whose `like` value (by dotted
    path) is a RaggedShard DTensor distributed with its mesh and placements; the rest as is.

    Rank 0's values are what every rank gets (`src_data_rank=0`, as torch's `distribute_tensor`
    used by torch's full-state-dict load), one collective per such tensor, in `tree`'s order, so
    every rank must pass the same keys in the same order.
    """

    def place(path: tuple, leaf: Any) -> Any:
        target = like.get(_name(path))
        plain = torch.is_tensor(leaf) and not isinstance(leaf, DTensor)
        if plain and isinstance(target, RaggedDTensor):
            return shard_like(leaf.detach(), target, path, src_data_rank=0)
        return leaf

    return _map(tree, place)


def _skeleton(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rank 0: `tree` with each tensor of one or more dimensions replaced by its `_TensorSpec`
    (the tensor appended to `tensors`) and 0-dim tensors moved to the CPU, as torch's broadcast
    sends them."""

    def strip(path: tuple, leaf: Any) -> Any:
        if not torch.is_tensor(leaf):
            return leaf
        if isinstance(leaf, DTensor):
            raise ValueError(
                f"broadcast_from_rank0 needs full tensors on rank 0, but {_name(path)!r} is a "
                f"DTensor with placements {leaf.placements}; pass .full_tensor() instead"
            )
        if leaf.dim() == 0:
            return leaf.detach().cpu()
        tensors.append(leaf)
        return _TensorSpec(leaf.shape, leaf.dtype)

    return _map(tree, strip)


def receive_from_rank0(tree: Any, like: dict[str, Any], device: torch.device) -> Any:
    """Rank 0's state dict `tree` on every rank of the default process group.

    One `broadcast_object_list` carries the structure, the non-tensor values and the 0-dim
    tensors; then each other tensor is broadcast on its own, in the same order on every rank, and
    immediately reduced to what this rank keeps: the piece its `like` value (by dotted path)
    holds when that is a DTensor, else the whole tensor. Peak memory is one full tensor.

    Args:
        tree: the full state dict on rank 0; ignored on the other ranks.
        like: this rank's current values by dotted path (`like_index`).
        device: where the tensors are broadcast (a device of the default group's backend).

    Raises:
        ValueError: on every rank, if rank 0's `tree` holds a DTensor, or a tensor whose shape
            differs from the DTensor it loads into.
    """
    rank0 = dist.get_rank() == 0
    tensors: list[torch.Tensor] = []
    box: list[Any] = [None]
    if rank0:
        try:
            box[0] = ("ok", _skeleton(tree, tensors))
        except ValueError as e:  # sent first, so that every rank raises it
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, skeleton = box[0]
    if kind == "error":
        raise ValueError(skeleton)
    pending = iter(tensors)

    def fill(path: tuple, leaf: Any) -> Any:
        if isinstance(leaf, _TensorSpec):
            if rank0:
                full = next(pending).detach().to(device)
            else:
                full = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            dist.broadcast(full, src=0)
        elif torch.is_tensor(leaf):
            full = leaf
        else:
            return leaf
        return shard_like(full, like.get(_name(path)), path, src_data_rank=None)

    return _map(skeleton, fill)
