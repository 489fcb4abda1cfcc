"""Where gradients live in a DBuffer's gradient buffer: which tensors have room, each one's
pieces per rank slot, and moving held gradients when that changes.

[Note: compacted gradients]
Only tensors that require grad have room in the gradient buffer. `fully_shard` puts frozen and
trainable parameters in different groups, but `requires_grad_()` after it (PEFT's and torch's
freeze-after-init) leaves both in one DBuffer; its group then gives the buffer the mask of what
requires grad at each backward's start (`set_grad_layout`). Rank r's gradient slot holds r's
pieces of the masked tensors, packed in layout order: Sg_r elements, their sum rounded up to 16
bytes (Sg_r = S for every rank, the identity layout, when every tensor is masked; a
`ChunkedDBuffer` always keeps it). Slots of different sizes are reduce-scattered by the list
form of the collective (`dist.reduce_scatter`; NCCL runs it as grouped reduces), in which each
rank sends every slot as it is: the wire carries the trainable gradients themselves, however
unevenly the parameter layout spread them (a model frozen after `fully_shard` may hold its
adapters on a few ranks), not W copies of the largest slot. A comm that stages the collective
([Note: custom comms]) takes equal slots, so its buffer pads each to the largest. Each tensor
keeps its rank distribution (its gradient on rank r has exactly r's elements of the parameter),
so a sharded gradient is the same RaggedShard DTensor over `_shard_grad[_grad_local[i]]`, at
another offset than the parameter in the shard. The landing, the flags, the reduce-scatter and
the HSDP all-reduce all work on slots of Sg_r + F: frozen tensors cost nothing on the wire or in
memory, as in torch's FSDP2, which leaves them out of its reduce-scatter. A tensor that gains a
gradient without room (frozen when the layout was made) triggers a new layout in place;
gradients held across a change move. (tests/fsdp/test_compacted_grads.py; torch's
test_train_mixed_requires_grad_per_group.)
"""

from __future__ import annotations

from typing import Sequence

import torch

from veragged.dbuffer import ops
from veragged.dbuffer.memory import aligned_empty

__all__ = ["GradientLayout"]


class GradientLayout:
    """The gradient buffer's layout (a mixin of `GradientPath`, on DBuffer's fields): rank-major
    slots of Sg_r gradient elements then F verdict flags ([Note: unreached parameters] in
    grads.py)."""

    # The gradient buffer is the reduce-scatter input (rank-major, slots of Sg_r + F elements); a
    # subclass landing gradients in another layout sets False and overrides `_rank_major`.
    _GRADS_RANK_MAJOR = True

    # --- layout ------------------------------------------------------------------------------

    @staticmethod
    def flag_room(n: int, align: int, ranks: int) -> int:
        """F: the verdict flags at the end of each rank's gradient slot, `n` rounded up to
        `align` (so every slot stays aligned); none on a mesh of one rank."""
        return 0 if ranks == 1 else -(-max(n, 1) // align) * align

    def _plan_grads(self, mask: Sequence[bool] | None = None, flags: bool = True) -> None:
        """Lay the gradient buffer out for the tensors `mask` marks (default: every tensor):
        each one's pieces per rank slot (`_grad_slots`), this rank's part of the sharded
        gradients (`_grad_local`), the slot sizes Sg_r ([Note: compacted gradients]) and whether
        the slots end with verdict flags ([Note: unreached parameters])."""
        n = len(self.entries)
        mask = (True,) * n if mask is None else tuple(bool(m) for m in mask)
        S, W = self.shard_size, self.world
        identity = all(mask) or not self._GRADS_RANK_MAJOR
        used = [0] * W
        slots: list[list[tuple[int, int, int]]] = []
        for e, m in zip(self.entries, mask):
            pieces = []
            a, b = (e.start, e.stop) if m or identity else (0, 0)
            if not self._GRADS_RANK_MAJOR:  # the full layout: one range, no slots
                pieces, a = ([(0, a, b - a)] if b > a else []), b
            while a < b:
                r = a // S
                end = min(b, (r + 1) * S)
                off = a - r * S if identity else used[r]
                pieces.append((r, off, end - a))
                used[r] = off + end - a
                a = end
            slots.append(pieces)
        # F: the flags in use, one for each tensor with room (the others get no gradient)
        F = self.flag_room(sum(mask), self._slot_align, W) if flags else 0
        flag_of, j = [], 0
        for m in mask:
            flag_of.append(j if m and F else None)
            j += bool(m and F)
        if identity:
            sizes = [S] * W
            local = [e.local for e in self.entries]
        else:  # each rank's slot as large as its own share: [Note: compacted gradients]
            align = self._slot_align
            sizes = [-(-u // align) * align for u in used]
            local = []
            for pieces in slots:
                mine = [(off, off + k) for r, off, k in pieces if r == self.rank]
                local.append(mine[0] if mine else (0, 0))
        self._grad_mask, self._grad_slots, self._grad_local = mask, slots, local
        self._grad_flags = bool(flags)
        self._flags, self._flag_of = F, flag_of  # tensor i's verdict is flag _flag_of[i]
        if not self._GRADS_RANK_MAJOR:  # the full layout: the flags come in its rank-major copy
            F = 0
        self._grad_sizes = sizes  # Sg_r: rank r's gradient elements in its slot
        self._grad_slot = sizes[self.rank]  # this rank's
        # Where each rank's slot (Sg_r + F elements) starts in the gradient buffer; the end.
        self._grad_starts = [0] * (W + 1)
        for r in range(W):
            self._grad_starts[r + 1] = self._grad_starts[r] + sizes[r] + F
        self._flag_index = None  # the flags' positions in the buffer, made when first needed

    @property
    def grad_slots_uniform(self) -> bool:
        """Whether every rank's gradient slot has the same size (the reduce-scatter is then
        `reduce_scatter_tensor`'s; else the list form, uneven)."""
        return len(set(self._grad_sizes)) == 1

    @property
    def grad_mask(self) -> tuple[bool, ...]:
        """Which tensors have room in the gradient buffer ([Note: compacted gradients])."""
        return self._grad_mask

    def _grads_numel(self) -> int:
        return self._grad_starts[-1]

    def set_grad_layout(self, mask: Sequence[bool], flags: bool = True) -> None:
        """Give gradient room to the tensors `mask` marks only (those that require grad): the
        gradient buffer, the reduce-scatter and the sharded gradients shrink to them
        ([Note: compacted gradients]); `flags`: whether the reductions carry verdict flags
        (not needed when every trainable tensor gets a gradient: [Note: unreached
        parameters]). Gradients kept across a change (no-sync micro-batches, an HSDP sum
        awaiting its all-reduce, sharded `.grad`s) move to the new layout; a tensor losing its
        room keeps its sharded `.grad` as a copy of its own."""
        mask = tuple(bool(m) for m in mask)
        if not self._GRADS_RANK_MAJOR:
            mask = self._grad_mask  # its gradients stay in the full layout
        if mask == self._grad_mask and bool(flags) == self._grad_flags:
            return
        self.finish_reduce()
        self.resolve_grads()
        old_mask, old_slots, old_local = self._grad_mask, self._grad_slots, self._grad_local
        old_starts, old_flags = self._grad_starts, (self._flags, self._flag_of)
        old_grads = self._grads if self.grads_allocated else None
        old_partial, old_shard = self._partial, self._shard_grad
        bound = [self._bound(p) for p in self.params]  # views of old_shard
        self._plan_grads(mask, flags)
        self._grads = torch.empty(self._grads_numel(), dtype=self.reduce_dtype,
                                  device=self.compute_device)
        keep = [i for i, (m, o) in enumerate(zip(mask, old_mask)) if m and o]  # room in both
        if old_grads is not None:  # gradients accumulating without sync: move them
            moves = [(old_starts[r] + a, self._grad_starts[r] + b, k)
                     for i in keep for (r, a, k), (_, b, _) in zip(old_slots[i],
                                                                   self._grad_slots[i])]
            ops.zero_ranges_(self._grads, [(0, self._grads.numel())])
            with torch.no_grad():
                for src, dst, k in moves:
                    self._grads[dst : dst + k].copy_(old_grads[src : src + k])
        else:
            self._free(self._grads)
        if old_partial is not None:
            self._partial = self._move_local(old_partial, old_local, keep, old_flags)
        if old_shard is not None:
            self._shard_grad = self._move_local(old_shard, old_local, keep, old_flags)
            for i, (p, e) in enumerate(zip(self.params, self.entries)):
                if not bound[i]:
                    continue
                if mask[i]:
                    p.grad = self._sharded(e, self._shard_grad, requires_grad=False,
                                           local=self._grad_local[i])
                else:  # no room any more: the gradient keeps its values in its own memory
                    a, b = old_local[i]
                    p.grad = self._sharded(e, old_shard[a:b].clone(), requires_grad=False,
                                           local=(0, b - a))

    def _move_local(self, old: torch.Tensor, old_local, keep, old_flags) -> torch.Tensor:
        """This rank's slot `old` (gradient elements at `old_local`, then the flags `old_flags`,
        (F, each tensor's flag)) in the current layout: the kept tensors' elements and flags
        moved, zeros elsewhere."""
        Sg, F = self._grad_slot, self._flags
        new = aligned_empty(Sg + F, old.dtype, old.device, pin_memory=self._pin and
                            old.device.type == "cpu")
        new.zero_()
        old_F, old_of = old_flags
        with torch.no_grad():
            for i in keep:
                (a, b), (c, d) = old_local[i], self._grad_local[i]
                new[c:d].copy_(old[a:b])
                j, k = old_of[i], self._flag_of[i]
                if old_F and F and j is not None and k is not None:
                    new[Sg + k].copy_(old[old.numel() - old_F + j])
        return new
