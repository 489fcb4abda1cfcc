"""What modules and state dicts do to a DBuffer's sharded parameters: `.to()` / `.double()` /
`to_empty` (`apply_`), parameter objects swapped in (`take_param_`, `new_sharded_param`), loads
(`load_`, `check_loadable`, `holds`) and a buffer of the same kind for a subset (`config`).

`ParamOps` is a base of `DBuffer` (buffer.py): these methods work on the DBuffer's own state
(`params`, `entries`, `shard`, `grads`, `_make_buffers`, `reshard`), kept here so that
buffer.py reads as the layout and the collectives. Subclasses override the hooks they need
(`ExtensionDBuffer`: `apply_`, `holds`, `_full_value_local`, `_copy_local`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

from veragged.dbuffer import ops
from veragged.placement.api import distribute_tensor
from veragged.placement.ragged_shard import RaggedShard
from veragged.placement.redistribute import redistribute
from veragged.placement.torch_callers import WAYS_OUT
from veragged.runtime.streams import same_storage

__all__ = ["ParamOps"]


class ParamOps:
    """Module and state-dict operations on a DBuffer's sharded parameters (see the module)."""

    def apply_(self, fn) -> bool:
        """Run a module `_apply` function (`.to()`, `.double()`, `to_empty`) on the group.

        `fn` sees the flat shard once. If it returns a new dtype or device, every buffer is
        re-made around the result and the old sharded parameters take the new contents in
        place (`.data` and the DTensor fields; weak references and optimizer state keep
        pointing at the same objects), so modules and optimizers holding them stay valid.
        Sharded gradients move with their parameters. Returns whether the buffers were re-made
        (the unsharded views are then new objects).
        """
        self.grads.finish_reduce()
        self.reshard()
        with torch.no_grad():
            new = fn(self.shard)
        if new is self.shard or (new.dtype == self.dtype and new.device == self.device
                                 and same_storage(new, self.shard)
                                 and new.storage_offset() == self.shard.storage_offset()):
            return False
        pin = self.pin_memory and new.device.type == "cpu"
        shard = ops.aligned_empty(self.shard_size, new.dtype, new.device, pin_memory=pin)
        with torch.no_grad():
            shard.copy_(new)
        self._remake(shard)
        return True

    def _remake(self, shard: torch.Tensor) -> None:
        """Re-make every buffer around `shard` (`apply_`): the old sharded parameters take the
        new contents in place, their sharded gradients move with them."""
        had_grad = [p.grad is not None for p in self.params]
        old_shard_grad = self.grads.shard_grad
        new_params = self._make_buffers(shard)
        for i, (old, fresh) in enumerate(zip(self.params, new_params)):
            with torch._C.DisableTorchFunctionSubclass():  # no ragged hooks: `_sharded_param`
                old.grad = None
                fresh.requires_grad_(old.requires_grad)
            try:
                torch.utils.swap_tensors(old, fresh)
                continue
            except RuntimeError:  # weakly referenced (hooks): keep the object, take the data
                pass
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    old.data = fresh
                    if hasattr(old, "grad_dtype"):
                        old.grad_dtype = fresh.dtype
                old._local_tensor, old._spec = fresh._local_tensor, fresh._spec
            except RuntimeError:  # another device type: the new object replaces the old one
                self.params[i] = fresh
        self.grads.rebind_moved(old_shard_grad, had_grad)

    def take_param_(self, i: int, param: torch.nn.Parameter) -> None:
        """Make the object `param` sharded parameter `i`: it takes parameter i's contents
        (`torch.utils.swap_tensors`, which raises RuntimeError where it cannot), so what holds
        it (modules, optimizers) holds this buffer's parameter."""
        torch.utils.swap_tensors(param, self.params[i])
        self.params[i] = param

    def config(self, indices: Sequence[int]) -> dict:
        """The keyword arguments that make a buffer of this kind and policy holding only the
        tensors `indices` (in that order)."""
        cfg = dict(self._config)
        for key in ("block_sizes", "tp"):
            if cfg[key] is not None:
                cfg[key] = [cfg[key][i] for i in indices]
        return cfg

    def holds(self, i: int) -> bool:
        """Whether sharded parameter `i` still holds this buffer's memory (a view of the shard;
        a dtype or device of its own answers no on every rank, also where it has no element)."""
        p = self.params[i]
        if p.dtype != self.dtype or p.device != self.device:
            return False
        local = p._local_tensor
        return local.numel() == 0 or same_storage(local, self.shard)

    def load_(self, i: int, value: torch.Tensor) -> None:
        """Copy `value` into tensor `i`'s part of the shard (cast and moved as needed).

        `value` is a DTensor on this buffer's mesh, redistributed first if its placements differ
        from tensor `i`'s (a collective: every rank of the mesh loads it), or a plain tensor
        holding the full value, of which each rank takes its own elements.
        """
        self.check_loadable(i, value)
        p = self.params[i]
        with torch.no_grad():
            mesh = p.device_mesh
            if not isinstance(value, DTensor):
                src = self._full_value_local(i, value)
            elif value.device_mesh != mesh:
                raise ValueError(
                    f"{self.entries[i].name}: cannot load a DTensor on {value.device_mesh} into "
                    f"a parameter on {mesh}"
                )
            else:
                if tuple(value.placements) != p.placements:
                    value = redistribute(value, mesh, p.placements)
                src = value._local_tensor
            self._copy_local(i, src)

    def check_loadable(self, i: int, value: torch.Tensor) -> None:
        """Raise, without communication, if `load_(i, value)` cannot load `value`: ValueError
        for another shape; RuntimeError, as torch's loaders, for a DTensor with tensor `i`'s
        placements whose local tensor is not this rank's flat piece (what torch's
        `DTensor.from_local` and torch's loaders make of a RaggedShard value: [Note: torch's
        entry points without the routing], placement/torch_callers.py)."""
        p = self.params[i]
        name = self.entries[i].name
        if value.shape != p.shape:
            raise ValueError(
                f"{name}: cannot load a tensor of shape {list(value.shape)} into a parameter of "
                f"shape {list(p.shape)}"
            )
        local = value._local_tensor if isinstance(value, DTensor) else None
        if (local is not None and any(isinstance(pl, RaggedShard) for pl in p.placements)
                and tuple(value.placements) == p.placements
                and (local.dim() != 1 or local.numel() != p._local_tensor.numel())):
            raise RuntimeError(
                f"{name}: the DTensor loaded into it has this parameter's placements "
                f"{p.placements} but its local tensor has shape {list(local.shape)} where this "
                f"rank holds {p._local_tensor.numel()} elements, flat: it was not sharded by "
                "veragged (torch's full-state-dict loaders and DTensor.from_local slice a "
                f"RaggedShard as a replica). {WAYS_OUT}"
            )

    def _full_value_local(self, i: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full value of tensor `i` (`load_`)."""
        p = self.params[i]
        return distribute_tensor(value, p.device_mesh, p.placements,
                                 src_data_rank=None)._local_tensor

    def _copy_local(self, i: int, src: torch.Tensor) -> None:
        """Copy this rank's part `src` into parameter `i`'s local tensor (`load_`)."""
        self.params[i]._local_tensor.view(-1).copy_(src.reshape(-1))

    def new_sharded_param(self, i: int) -> torch.nn.Parameter:
        """A new sharded parameter object for tensor `i`, over the shard (the one in `params`
        is not replaced)."""
        return self._sharded_param(self.entries[i], self.shard)
