"""Where gradients live in a DBuffer's gradient buffer: which tensors have room, each one's
pieces per rank slot, and the verdict flags that end each slot. Pure layout math, a value per
layout (`GradLayout`); the buffers it describes are the DBuffer's `Gradients` (grads.py).

[Note: compacted gradients]
Only tensors that require grad have room in the gradient buffer. `fully_shard` puts frozen and
trainable parameters in different groups, but `requires_grad_()` after it (PEFT's and torch's
freeze-after-init) leaves both in one DBuffer; its group then gives the buffer the mask of what
requires grad at each backward's start (`Gradients.set_layout`). Rank r's gradient slot holds r's
pieces of the masked tensors, packed in layout order: Sg_r elements, their sum rounded up to 16
bytes (Sg_r = S for every rank, the identity layout, when every tensor is masked; a
`ChunkedDBuffer` always keeps it). Slots of different sizes are reduce-scattered by the list
form of the collective (`dist.reduce_scatter`; NCCL runs it as grouped reduces), in which each
rank sends every slot as it is: the wire carries the trainable gradients themselves, however
unevenly the parameter layout spread them (a model frozen after `fully_shard` may hold its
adapters on a few ranks), not W copies of the largest slot. A comm that stages the collective
([Note: custom comms]) takes equal slots, so its buffer pads each to the largest. Each tensor
keeps its rank distribution (its gradient on rank r has exactly r's elements of the parameter),
so a sharded gradient is the same RaggedShard DTensor over `shard_grad[layout.local[i]]`, at
another offset than the parameter in the shard. The landing, the flags, the reduce-scatter and
the HSDP all-reduce all work on slots of Sg_r + F: frozen tensors cost nothing on the wire or in
memory, as in torch's FSDP2, which leaves them out of its reduce-scatter. A tensor that gains a
gradient without room (frozen when the layout was made) triggers a new layout in place;
gradients held across a change move. (tests/fsdp/test_compacted_grads.py; torch's
test_train_mixed_requires_grad_per_group.)

[Note: unreached parameters]
A parameter that no rank's backward reached keeps `.grad = None` (torch's FSDP2 leaves it out of
its reduce-scatter), yet the reduce-scatter covers the whole buffer on every rank, so that ranks
whose data reached different parameters still issue the same collective. Which parameters some
rank reached travels inside that collective: every rank's slot of the gradient buffer ends with
F >= n flags (n tensors with room in it, [Note: compacted gradients]; F rounded up to 16 bytes),
and each rank writes its own verdicts into every slot's flags before the reduce-scatter (1 for a
tensor its backward reached, or any tensor in `set_reduce_scatter_unused_params(True)` mode; 0
otherwise; one small host-to-device copy). The SUM leaves in each rank's slot the number of
ranks that reached each tensor (HSDP: the all-reduce over the replicas adds theirs; a
no-all-reduce micro-batch's sum kept aside adds its own), so every rank, including one that
holds no element of a tensor (a RaggedShard may give a rank zero units), reads the same verdict:
a gradient for every tensor some rank reached, None for the others. After backward, every rank
of the mesh therefore agrees on which parameters have a gradient, and clipping (torch's, whose
per-parameter norms of RaggedShard gradients each all-reduce, and `veragged.clip_grad_norm_`),
GradScaler, the optimizers and DCP issue the same collectives on every rank. The counts are
small integers in the reduce dtype (exact below 2^8 ranks even in bf16, and never 0 once
positive), so no backend detail (the sign of a zero sum) matters; the flags never touch a
gradient element: a rank that did not reach a tensor sends +0.0 there, which leaves the others'
sum bitwise as it was (their elements are never -0.0: +0.0 + x is not). The cost is F elements
per rank on the wire and in the buffer (n rounded up to 16 bytes, `FLAG_ALIGN_BYTES`: 16 B per
rank for a buffer of up to 4 trainable fp32 tensors, 4 bytes a tensor beyond), and no collective
torch's backward does not issue. It cannot be zero while the guarantee holds: a rank that
reached a tensor another did not must tell it, and the gradient elements cannot carry the news
(a reached rank's gradient may be exactly zero, and its sum with anything is another gradient),
so the bits must travel somewhere; torch sends none and aborts instead when ranks reach
different parameters. (Filling unreached ranges with -0.0 would let a tensor's own elements
carry its verdict, since IEEE sums give -0.0 only from -0.0 alone, but only to ranks holding
part of it: a RaggedShard layout keeps most tensors on a few ranks, so the flags stay.) With
`set_reduce_scatter_unused_params(True)` (torch's answer to such routing: every trainable
parameter gets a gradient, zeros where no rank reached it) no verdict is needed, and the buffer
is laid out without flags (`Gradients.set_layout(flags=False)`): the reduce-scatter then
carries the trainable gradients only, as torch's.
The flags are written and read by the DBuffer's `Gradients` (grads.py). Reading a verdict is a
device-to-host read, needed only when this rank's backward missed a trainable tensor of the
buffer (it knows the tensors it reached): one read per buffer, of all its flags. Inside backward
(`Gradients.finish_reduce(defer=True)`, the group's state after its post-backward) the read is
started without waiting (a copy to pinned host memory and an event on an accelerator) and the
gradients of those tensors are bound at the end of backward
(`Gradients.resolve`, from `ParamGroup.end_backward`), so backward does not stall the host per
group; any later use of the buffer (the next reduction, `apply_`) resolves first. Tensors this
rank reached are bound when their reduction finishes; hooks on the sharded parameters (an
optimizer step in backward) run when the gradient is bound, so for the others at the end of
backward.
(tests/fsdp/test_routing.py: ranks reaching different experts, holding none of some, through
clipping, the optimizers, GradScaler and DCP; tests/stress: the same over many steps.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from veragged.dbuffer.entries import Entry
from veragged.dbuffer.ops import aligned_empty

__all__ = ["FLAG_ALIGN_BYTES", "GradLayout", "flag_room", "plan_grad_layout"]

# The flags round up to 16 bytes (not the 256-byte alignment of parameter slots): every rank's
# gradient slot then still starts 16-byte aligned, which vectorised loads and NCCL's copies
# want, and a buffer of up to 4 fp32 tensors sends 16 bytes of flags per rank, not 256.
FLAG_ALIGN_BYTES = 16


def flag_room(n: int, align: int, ranks: int) -> int:
    """F: the verdict flags at the end of each rank's gradient slot, `n` rounded up to `align`
    (so every slot stays aligned); none on a mesh of one rank."""
    return 0 if ranks == 1 else -(-max(n, 1) // align) * align


@dataclass(frozen=True, slots=True)
class GradLayout:
    """One layout of a DBuffer's gradient buffer: rank-major slots of Sg_r gradient elements then
    F verdict flags ([Note: compacted gradients], [Note: unreached parameters]). Made by
    `plan_grad_layout`, replaced (never changed) when the mask changes."""

    mask: tuple[bool, ...]  # which tensors have room
    with_flags: bool  # whether the slots end with verdict flags
    pieces: list[list[tuple[int, int, int]]]  # per tensor: (rank, offset in its slot, elements)
    local: list[tuple[int, int]]  # per tensor: this rank's part of the sharded gradient
    flags: int  # F, the flags per slot
    flag_of: list[int | None]  # tensor i's verdict is flag flag_of[i]
    sizes: list[int]  # Sg_r: rank r's gradient elements in its slot
    slot: int  # this rank's Sg
    starts: list[int]  # where each rank's slot (Sg_r + F elements) starts; the end
    rank_major: bool  # False: one range in the full layout, the flags added in its copy
    world: int
    shard_size: int
    # Read by every backward, so made once with the layout:
    numel: int  # the gradient buffer's elements
    # whether every rank's gradient slot has the same size (the reduce-scatter is then
    # `reduce_scatter_tensor`'s; else the list form, uneven)
    uniform: bool
    # per tensor, its pieces in the gradient buffer: (offset in the tensor, offset in the
    # buffer, elements), one per rank slot it crosses ([Note: gradient landing])
    land: list[list[tuple[int, int, int]]]
    # `unlanded_ranges` and `flag_values` per argument, filled by `Gradients` as backwards ask
    # (a backward reaches the same tensors as the last one, mostly)
    unlanded: dict = field(default_factory=dict)
    flag_values_of: dict = field(default_factory=dict)

    def unlanded_ranges(self, entries: Sequence[Entry],
                        landed: Sequence[bool]) -> list[tuple[int, int]]:
        """The ranges of the gradient buffer no gradient landed in (`landed[i]`: tensor i's
        did): frozen and unreached tensors, TP padding, slot padding."""
        covered: list[list[tuple[int, int]]] = [[] for _ in range(self.world)]
        S = self.shard_size
        for e, done, pieces in zip(entries, landed, self.pieces):
            if not done:
                continue
            a = e.start  # the tensor fills [start, stop): TP padding after it is zeroed too
            for r, off, k in pieces:
                fill = min(a + k, e.stop) - a
                if fill > 0:
                    covered[r].append((off, off + fill))
                a = (r + 1) * S
        ranges, sizes, starts = [], self.sizes, self.starts
        if not self.rank_major:  # the full layout: one range of W * S elements
            covered, sizes = [sum(covered, [])], [self.world * S]
        for r, spans in enumerate(covered):
            pos, at = 0, starts[r]
            for a, b in sorted(spans):
                if a > pos:
                    ranges.append((at + pos, at + a))
                pos = max(pos, b)
            if pos < sizes[r]:
                ranges.append((at + pos, at + sizes[r]))
        return ranges

    def flag_values(self, unreached: Sequence[bool] | None) -> list[float]:
        """This rank's verdicts, one per flag: 0 for a tensor marked `unreached`, else 1."""
        values = [0.0] * self.flags
        for i, j in enumerate(self.flag_of):
            if j is not None:
                values[j] = 0.0 if unreached is not None and unreached[i] else 1.0
        return values

    def moves_from(self, old: GradLayout, keep: Sequence[int]) -> list[tuple[int, int, int]]:
        """(from in `old`'s buffer, to in this one's, elements) for the tensors `keep`."""
        return [(old.starts[r] + a, self.starts[r] + b, k)
                for i in keep for (r, a, k), (_, b, _) in zip(old.pieces[i], self.pieces[i])]

    def moved_slot(self, t: torch.Tensor, old: GradLayout, keep: Sequence[int],
                   pin_memory: bool) -> torch.Tensor:
        """This rank's slot `t` of layout `old` (its gradient elements, then its flags) in this
        layout: the tensors `keep`'s elements and flags moved, zeros elsewhere (pinned if
        `pin_memory` and in host memory)."""
        Sg, F = self.slot, self.flags
        new = aligned_empty(Sg + F, t.dtype, t.device,
                            pin_memory=pin_memory and t.device.type == "cpu")
        new.zero_()
        with torch.no_grad():
            for i in keep:
                (a, b), (c, d) = old.local[i], self.local[i]
                new[c:d].copy_(t[a:b])
                j, k = old.flag_of[i], self.flag_of[i]
                if old.flags and F and j is not None and k is not None:
                    new[Sg + k].copy_(t[t.numel() - old.flags + j])
        return new


def plan_grad_layout(entries: Sequence[Entry], *, shard_size: int, world: int, rank: int,
                     rank_major: bool, slot_align: int, mask: Sequence[bool] | None = None,
                     flags: bool = True) -> GradLayout:
    """Lay the gradient buffer out for the tensors `mask` marks (default: every tensor): each
    one's pieces per rank slot, this rank's part of the sharded gradients, the slot sizes Sg_r
    ([Note: compacted gradients]) and whether the slots end with verdict flags
    ([Note: unreached parameters]). `rank_major` False: gradients land in the full layout (a
    `ChunkedDBuffer`'s), every tensor has room, and the flags come in its rank-major copy."""
    n = len(entries)
    mask = (True,) * n if mask is None else tuple(bool(m) for m in mask)
    S, W = shard_size, world
    identity = all(mask) or not rank_major
    used = [0] * W
    slots: list[list[tuple[int, int, int]]] = []
    for e, m in zip(entries, mask):
        pieces = []
        a, b = (e.start, e.stop) if m or identity else (0, 0)
        if not rank_major:  # the full layout: one range, no slots
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
    F = flag_room(sum(mask), slot_align, W) if flags else 0
    flag_of, j = [], 0
    for m in mask:
        flag_of.append(j if m and F else None)
        j += bool(m and F)
    if identity:
        sizes = [S] * W
        local = [e.local for e in entries]
    else:  # each rank's slot as large as its own share: [Note: compacted gradients]
        sizes = [-(-u // slot_align) * slot_align for u in used]
        local = []
        for pieces in slots:
            mine = [(off, off + k) for r, off, k in pieces if r == rank]
            local.append(mine[0] if mine else (0, 0))
    slot_flags = F if rank_major else 0  # the full layout: the flags come in its rank-major copy
    starts = [0] * (W + 1)
    for r in range(W):
        starts[r + 1] = starts[r] + sizes[r] + slot_flags
    land = []
    for pieces in slots:
        a, ranges = 0, []
        for r, off, k in pieces:
            ranges.append((a, starts[r] + off, k))
            a += k
        land.append(ranges)
    return GradLayout(mask=mask, with_flags=bool(flags), pieces=slots, local=local, flags=F,
                      flag_of=flag_of, sizes=sizes, slot=sizes[rank], starts=starts,
                      rank_major=rank_major, world=W, shard_size=S, numel=starts[-1],
                      uniform=len(set(sizes)) == 1, land=land)
