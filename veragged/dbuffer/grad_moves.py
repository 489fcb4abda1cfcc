"""Gradients held across a change of the gradient buffer: a new layout (another mask of the
tensors that require grad: [Note: compacted gradients]) or new buffers (`DBuffer.apply_`: another
dtype or device). Neither happens in a steady training step, so the step's path (grads.py) only
checks whether one is due.

`GradMoves` is a base of `Gradients` (grads.py) and works on its state: the gradient buffer
(`flat`), the HSDP sum kept aside (`_partial`), the sharded gradients' buffer (`_shard_grad`) and
the `.grad`s bound to it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from veragged.dbuffer import ops
from veragged.runtime.streams import free_storage

__all__ = ["GradMoves"]


class GradMoves:
    """Moving gradients to a new layout or new buffers (see the module)."""

    def rebind_moved(self, old: torch.Tensor | None, had_grad: Sequence[bool]) -> None:
        """After `DBuffer._remake` (a new dtype or device, after `reset`): the sharded gradients
        of the old shard gradient `old` copied into a new one, bound again to the parameters
        that had one."""
        if old is None or not any(had_grad):
            return
        self._shard_grad = self._new_shard_grad()
        with torch.no_grad():
            self._shard_grad.copy_(old)
        for p, e, had, local in zip(self._params, self._entries, had_grad, self.layout.local):
            if had:
                with torch._C.DisableTorchFunctionSubclass():
                    p.grad = self._view(e, self._shard_grad, local)
        self._let_go()

    def _move_to_layout(self, mask: Sequence[bool], flags: bool) -> None:
        """`set_layout`'s change: the reduction in flight finished, then the gradient buffer,
        the HSDP sum and the sharded gradients re-made in the new layout, the gradients of the
        tensors with room in both moved, and the `.grad`s bound again (a tensor losing its room
        keeps its values in memory of its own)."""
        self.finish_reduce()
        self.resolve()
        old = self.layout
        old_flat = self.flat if self.allocated else None
        old_partial, old_shard = self._partial, self._shard_grad
        bound = [self._bound(p) for p in self._params]  # views of old_shard
        self._relayout(mask, flags)
        self.flat = torch.empty(self.layout.numel, dtype=self.reduce_dtype,
                                device=self.compute_device)
        keep = [i for i, (m, o) in enumerate(zip(mask, old.mask)) if m and o]  # room in both
        pin = self._pin_memory
        if old_flat is not None:  # gradients accumulating without sync: move them
            moves = self.layout.moves_from(old, keep)
            ops.zero_ranges_(self.flat, [(0, self.flat.numel())])
            with torch.no_grad():
                for src, dst, k in moves:
                    self.flat[dst : dst + k].copy_(old_flat[src : src + k])
        else:
            free_storage(self.flat)
        if old_partial is not None:
            self._partial = self.layout.moved_slot(old_partial, old, keep, pin)
        if old_shard is not None:
            self._shard_grad = self.layout.moved_slot(old_shard, old, keep, pin)
            for i, (p, e) in enumerate(zip(self._params, self._entries)):
                if not bound[i]:
                    continue
                if mask[i]:
                    p.grad = self._view(e, self._shard_grad, self.layout.local[i])
                else:  # no room any more: the gradient keeps its values in its own memory
                    a, b = old.local[i]
                    p.grad = self._view(e, old_shard[a:b].clone(), (0, b - a))
            self._let_go()
