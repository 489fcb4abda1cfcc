"""A DBuffer's gradients (`Gradients`, `buffer.grads`): gradients landing in the gradient buffer,
no-sync accumulation, the reduce-scatter (and HSDP all-reduce) and the sharded gradients it writes.

[Note: gradient landing]
Backward does not write into a zeroed buffer through autograd's accumulation (a zero pass, then
a read-add-write per element). Autograd stores each unsharded parameter's gradient in its
`.grad` (the first without a copy; a module used twice adds the second, as with torch's FSDP2),
and the group's post-backward hands them all to `Gradients.land`, which writes each parameter's
range once (`+0.0 + scale * g`) or, when the buffer already holds an earlier gradient (no-sync
micro-batches, a second post-backward before the reduction), adds it in, in one `land_` launch
for the group (FSDP2's copy-in is one `chunk_cat` per group), and drops the `.grad`s. The buffer
has the reduce dtype, so the cast to it happens in that same write. `scale` is 1/world (HSDP:
1/(shard x replicate); or 1/divide_factor) when that is a power of two: multiplying by it before
the SUM gives exactly the bits of dividing after it (short of subnormals), so the reduce-scatter
can write the sharded gradients directly, with no pass of its own. So a parameter's gradient
costs one write, as FSDP2's copy into its reduce-scatter input does, and no hook of its own.
Ranges no gradient landed in (frozen and unreached parameters, padding) are zeroed by one launch
before the buffer is read (`GradLayout.unlanded_ranges`, once per set of landed tensors).
The gradient buffer is the reduce-scatter's input, rank-major with a slot of `S + F` elements per
rank: the S gradient elements of rank r's shard, then F verdict flags ([Note: unreached
parameters]; F = 0 on a mesh of one rank). A parameter that crosses a shard boundary is therefore
not one contiguous range of it: it lands in pieces (one per slot it crosses, all in the same
`land_` launch); one inside a slot (most parameters) is one piece. (`ChunkedDBuffer` lands
gradients in the full layout and adds the flags in its rank-major copy.)

[Note: offloaded gradients]
With CPU offload the sharded gradients live in (pinned) host memory, where the optimizer steps.
Inside backward a group's reduced gradients are not waited for: `finish_reduce(defer=True)`
starts their copy to a pinned host tensor (non-blocking, an event recorded after it) and leaves
the host-side write (cast, scale, accumulation into earlier sums) and the binding of `.grad` to
`resolve` at the end of backward, which waits for the event first; torch's FSDP2 likewise
copies with `non_blocking=True` and waits for its offload events in `finalize_backward`. So
backward issues every group's reduce-scatter and copy without a host sync per group. The same
deferral runs on the CPU (with a plain copy and no event), where tests/fsdp/test_cpu_offload.py
and the happens-before loop with offload exercise it. Outside backward (an explicit reduction)
the copy is synchronous.

[Note: sharded gradient lifetime]
The sharded `.grad`s are views of one buffer per group (`_shard_grad`). Gradients holds that
buffer only while it has something to write into it or bind from it (a reduction in flight, an
offloaded landing, verdicts still to read); after that only the `.grad` views keep it alive. So
`zero_grad()` (set_to_none) frees it, as it frees torch's reduce-scatter outputs, instead of the
buffer living through forward into the next backward; the next reduction allocates a new one
(on the reduce-scatter stream, ordered after the current stream's earlier work as torch's
output is). `set_to_none=False` and gradient accumulation across steps keep the views, and so
the buffer and its sums. A `.grad` the user replaced is not a view and does not count.

[Note: grad verdicts for optimizers]
Muon, Shampoo, SOAP and AdamW8bit must agree across a parameter's ranks whether it has a gradient
([Note: symmetric grad presence], optim/common.py), which costs them an all-reduce per step unless
they know. After a backward under fully_shard they know: every rank read the same grad/None
verdicts from the reduce-scatter ([Note: unreached parameters]). So when a backward iteration ends
with nothing pending, each group's Gradients records, per tensor, whether its parameter has a
gradient (`verdicts`, the same list on every rank of the DBuffer's mesh: the flags travel over the
shard ranks and, with HSDP, the replicas) and registers itself for each parameter (`GRAD_VERDICTS`,
by id, weakly: an attribute would travel with copies and pickles of the parameter), except where
ranks of the parameter's mesh did not exchange them (a TP/EP parameter's other mesh dims, replicas
with no shard dim), which keep the all-reduce; with `grad_agreement="auto"` an optimizer takes a
record no step has used yet (`fresh`) instead of the all-reduce, and its step (or its `zero_grad`)
uses it up, so a later step without a backward agrees by the all-reduce again. A rank whose `.grad`
presence no longer matches a fresh record (dropped or set by hand since the backward, or the
module's `zero_grad()` before the step) raises before any collective of the step: the ranks may
have changed it differently, and an all-reduce on some ranks only would pair with another
collective on the others; `grad_agreement="mesh"` handles such gradients.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veragged.dbuffer import comms, ops
from veragged.dbuffer.grad_layout import FLAG_ALIGN_BYTES, GradLayout, plan_grad_layout
from veragged.dbuffer.grad_moves import GradMoves
from veragged.dbuffer.inflight import (
    HostCopy,
    InFlightReduce,
    OffloadedLanding,
    PendingVerdicts,
    start_copy_to_host,
    start_read,
)
from veragged.placement.tensor import GRAD_VERDICTS
from veragged.runtime import trace as tr
from veragged.runtime.streams import free_storage, same_storage

if TYPE_CHECKING:
    from veragged.dbuffer.entries import Entry

__all__ = ["Gradients"]


class Gradients(GradMoves):
    """A DBuffer's gradients: the gradient buffer they land in and its layout, the reduction in
    flight and what it leaves pending, and the sharded gradients (views of one buffer) it
    writes. The DBuffer makes one (`buffer.grads`); this object alone writes these fields.

    What it needs of its DBuffer it is given, and keeps: at construction the per-tensor
    records and sharded parameters (`entries`, `params`: whose `.grad` it binds; the DBuffer's
    own lists, which `apply_` updates in place), the shard group's geometry, the replica
    groups HSDP all-reduces over, and how to view a slot as a sharded gradient and the gradient
    buffer as rank-major slots (the DBuffer's `sharded_view` and `rank_major`, which its
    subclasses define); at each `reset` the dtypes and devices the DBuffer's buffers were made
    in; and from the DBuffer's setters the runtime (`rt`, [Note: streams and events]), the
    reduce-scatter's comm and group ([Note: custom comms]) and the profiler ranges' suffix.

    Args:
        owner: the DBuffer whose `id` names this object's buffers to the runtime (`key`); it is
            not otherwise read.
        entries, params: the DBuffer's per-tensor records and sharded parameters.
        world, rank, group, shard_size: the shard mesh dim's size, this rank's coordinate on
            it, its process group, and S.
        replica_groups: the process groups of the mesh dims (of more than one rank) that
            replicate the DBuffer (HSDP), in mesh order.
        replicas: the number of replicas (the product of the other mesh dims' sizes).
        itemsize: the smallest dtype's size in play (a compacted slot's size rounds to it).
        rank_major: whether the gradient buffer is the reduce-scatter input as it is (False: a
            `ChunkedDBuffer`, whose gradients land in the full layout).
        sharded_view, to_rank_major: the DBuffer's `sharded_view(entry, buffer, local)` and
            `rank_major(full, slot)`.
        offload, pin_memory: the shard and sharded gradients live in (pinned) host memory.
    """

    def __init__(self, owner: object, *, entries: Sequence[Entry], params: list,
                 world: int, rank: int, group, shard_size: int, replica_groups: list,
                 replicas: int, itemsize: int, rank_major: bool, sharded_view: Callable,
                 to_rank_major: Callable, offload: bool, pin_memory: bool, rt):
        self._owner = id(owner)
        self._entries, self._params = entries, params
        self.world, self.rank, self._group, self.shard_size = world, rank, group, shard_size
        self._replica_groups, self._replicas = list(replica_groups), replicas
        self._rank_major_grads = rank_major
        self._view, self._to_rank_major = sharded_view, to_rank_major
        self._offload, self._pin_memory = offload, pin_memory
        self.rt = rt  # [Note: streams and events]; the DBuffer's `set_runtime` replaces it
        self.rs_comm = None  # the reduce-scatter's comm object ([Note: custom comms])
        self.rs_group = None  # the reduce-scatter's own process group (None: `group`)
        self.trace_fqn = ""  # the profiler ranges' suffix ([Note: trace ranges])
        # The buffers' dtypes and devices, given by `reset`.
        self.dtype = self.device = self.compute_device = self.reduce_dtype = None
        # A compacted slot's size rounds to it.
        self.slot_align = FLAG_ALIGN_BYTES // itemsize
        self.layout: GradLayout | None = None  # made by `reset` with the DBuffer's buffers
        self.flat: torch.Tensor | None = None  # the gradient buffer (reduce dtype, P slots)
        self._landed: list[bool] = []  # per tensor: whether its range holds a gradient
        self._land_scale = 1.0  # what landing gradients are multiplied by
        self._zero: torch.Tensor | None = None  # the +0.0 `land_one`'s first write adds
        # The sharded gradients' buffer (`_shard_grad`): held until the gradients it carries
        # are bound, then only through them ([Note: sharded gradient lifetime]).
        self._shard_hold: torch.Tensor | None = None
        self._shard_ref: weakref.ref | None = None
        self._partial: torch.Tensor | None = None  # HSDP sum awaiting its all-reduce
        self._flag_index: torch.Tensor | None = None  # the flags' positions, made when needed
        self._reduce: InFlightReduce | None = None
        self._pending: PendingVerdicts | None = None
        self._landing: OffloadedLanding | None = None
        # [Note: grad verdicts for optimizers]: per tensor, whether it had a gradient when the
        # last backward ended (None: no record), and whether an optimizer may still take it.
        self.verdicts: list[bool] | None = None
        self.fresh: list[bool] = []
        self._verdict_index: dict[int, int] = {}  # id(parameter) -> its index, as recorded

    def _key(self, name: str) -> tuple[int, str]:
        """The runtime's name of one of these buffers (the DBuffer's `key`)."""
        return (self._owner, name)

    @property
    def _shard_grad(self) -> torch.Tensor | None:
        if self._shard_hold is not None:
            return self._shard_hold
        return None if self._shard_ref is None else self._shard_ref()

    @_shard_grad.setter
    def _shard_grad(self, t: torch.Tensor | None) -> None:
        self._shard_hold = t
        self._shard_ref = None if t is None else weakref.ref(t)

    def _let_go(self) -> None:
        """Hold the sharded gradients' buffer only through the `.grad`s bound to it, once no
        gradient waits to be written into it or bound ([Note: sharded gradient lifetime])."""
        if self._pending is None and self._landing is None:
            self._shard_hold = None

    def reset(self, *, dtype: torch.dtype, device: torch.device, compute_device: torch.device,
              reduce_dtype: torch.dtype) -> None:
        """(Re)make the gradient buffer, freed, in `reduce_dtype` on `compute_device`, for the
        same mask (`DBuffer._make_buffers`, whose shard has `dtype` on `device`, as the sharded
        gradients will): no gradient held, no HSDP sum."""
        self.dtype, self.device = dtype, device
        self.compute_device, self.reduce_dtype = compute_device, reduce_dtype
        old = self.layout
        self._relayout(None if old is None else old.mask, True if old is None else old.with_flags)
        self.flat = torch.empty(self.layout.numel, dtype=self.reduce_dtype,
                                device=self.compute_device)
        free_storage(self.flat)
        self._landed = [True] * len(self._entries)
        self._shard_grad = None
        self._land_scale = 1.0
        self._zero = None
        self._partial = None

    def _relayout(self, mask: Sequence[bool] | None, flags: bool) -> None:
        self.layout = plan_grad_layout(
            self._entries, shard_size=self.shard_size, world=self.world, rank=self.rank,
            rank_major=self._rank_major_grads, slot_align=self.slot_align, mask=mask, flags=flags)
        self._flag_index = None

    @property
    def mask(self) -> tuple[bool, ...]:
        """Which tensors have room in the gradient buffer ([Note: compacted gradients])."""
        return self.layout.mask

    @property
    def allocated(self) -> bool:
        """Whether the gradient buffer has memory (between `alloc` and the reduction)."""
        return self.flat.untyped_storage().size() > 0

    @property
    def shard_grad(self) -> torch.Tensor | None:
        """The buffer the sharded gradients are views of (Sg + F elements), if made."""
        return self._shard_grad

    @property
    def has_partial(self) -> bool:
        """Whether an HSDP sum reduced without its all-reduce waits for the next one."""
        return self._partial is not None

    def cancel(self) -> None:
        """Drop the reduction in flight, the verdicts being read and the HSDP sum kept aside
        (`ParamGroup.reset`, after an exception): none is waited for or written."""
        self._reduce = None
        self._pending = None
        self._partial = None
        self._let_go()

    # --- landing -----------------------------------------------------------------------------

    def alloc(self, scale: float = 1.0) -> None:
        """Allocate the gradient buffer (the reduce dtype), unzeroed: gradients land by `land`,
        multiplied by `scale` (see `landing_scale`), and the rest is zeroed before the
        reduction ([Note: gradient landing])."""
        self.rt.alloc(self._key("grads"), self.flat)
        self._landed = [False] * len(self._entries)
        self._land_scale = scale

    def zero(self) -> None:
        """Allocate and zero the gradient buffer (one launch): every tensor counts as landed,
        so `land` adds into it."""
        self.rt.alloc(self._key("grads"), self.flat)
        ops.zero_ranges_(self.flat, [(0, self.flat.numel())])
        self._landed = [True] * len(self._entries)
        self._land_scale = 1.0

    def landing_scale(self, divide_factor: float | None = None, allowed: bool = True) -> float:
        """The factor gradients may be multiplied by as they land: 1/world (or 1/divide_factor)
        when that is a power of two, so that scaling before the SUM gives the bits scaling after
        it would (short of subnormals) and the reduce-scatter can write the sharded gradients
        with no pass of its own; else 1.0."""
        factor = float(divide_factor) if divide_factor is not None else self.world * self._replicas
        if not allowed or factor <= 0 or math.frexp(factor)[0] != 0.5:
            return 1.0
        return 1.0 / factor

    def _make_room(self, indices) -> None:
        """Gradient room for tensors frozen when the layout was made that have a gradient."""
        mask = self.layout.mask
        if not all(mask[i] for i in indices):
            room = set(indices)
            self.set_layout([m or j in room for j, m in enumerate(mask)], self.layout.with_flags)

    def land(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Land each `(i, grad)`: write (first gradient since allocation) or add it into
        tensor i's range, all in one `land_` launch ([Note: gradient landing])."""
        if not grads:
            return
        with tr.trace(tr.LAND_GRADS, self.trace_fqn):
            self._land(grads)

    def _land(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        self._make_room([i for i, _ in grads])
        srcs: list[torch.Tensor] = []
        pieces: list[int] = []
        for i, grad in grads:
            tp = self._entries[i].tp
            if tp is not None:  # a DTensor on the TP mesh: [Note: FSDP over TP]
                grad = tp.local_grad(grad)
            if grad.dtype not in ops.LAND_DTYPES or self.flat.dtype not in ops.LAND_DTYPES:
                self.land_one(i, grad, local=True)  # complex, float8: torch's adds
                continue
            j, add = len(srcs), int(self._landed[i])
            srcs.append(grad.contiguous().view(-1))
            for a, d, k in self.layout.land[i]:
                pieces += (j, a, d, k, add)
            self._landed[i] = True
        if srcs:
            self.rt.write(self._key("grads"))
            ops.land_(self.flat, srcs, pieces, self._land_scale)

    def land_one(self, i: int, grad: torch.Tensor, local: bool = False) -> None:
        """Write (first gradient since allocation) or add `grad` into tensor `i`'s range, by
        torch's ops, one per piece (`land` lands several tensors in one launch); `local`: a TP
        gradient already made local."""
        self._make_room([i])
        tp = self._entries[i].tp
        if tp is not None and not local:  # a DTensor on the TP mesh: [Note: FSDP over TP]
            grad = tp.local_grad(grad)
        flat, G = grad.reshape(-1), self.flat
        parts = [(G[d : d + k], flat[a : a + k]) for a, d, k in self.layout.land[i]]
        self.rt.write(self._key("grads"))
        with torch.no_grad():
            if self._landed[i]:
                for view, g in parts:
                    view.add_(g, alpha=self._land_scale)
            else:  # +0.0 + x is never -0.0: see [Note: unreached parameters]
                if self._zero is None:  # the +0.0 torch's add starts from, made once
                    self._zero = torch.zeros((), dtype=G.dtype, device=G.device)
                for view, g in parts:
                    torch.add(self._zero, g, alpha=self._land_scale, out=view)
                self._landed[i] = True

    def _zero_unlanded(self) -> None:
        """Zero every range of the gradient buffer no gradient landed in, in one launch."""
        lay, landed = self.layout, tuple(self._landed)
        ranges = lay.unlanded.get(landed)
        if ranges is None:
            ranges = lay.unlanded[landed] = lay.unlanded_ranges(self._entries, landed)
        if ranges:
            ops.zero_ranges_(self.flat, ranges)
        self._landed = [True] * len(self._entries)

    # --- layout per backward -----------------------------------------------------------------

    def set_layout(self, mask: Sequence[bool], flags: bool = True) -> None:
        """Give gradient room to the tensors `mask` marks only (those that require grad): the
        gradient buffer, the reduce-scatter and the sharded gradients shrink to them
        ([Note: compacted gradients]); `flags`: whether the reductions carry verdict flags
        (not needed when every trainable tensor gets a gradient: [Note: unreached
        parameters]). Gradients kept across a change (no-sync micro-batches, an HSDP sum
        awaiting its all-reduce, sharded `.grad`s) move to the new layout; a tensor losing its
        room keeps its sharded `.grad` as a copy of its own."""
        mask = tuple(bool(m) for m in mask)
        if not self._rank_major_grads:
            mask = self.layout.mask  # its gradients stay in the full layout
        if mask == self.layout.mask and bool(flags) == self.layout.with_flags:
            return
        self._move_to_layout(mask, flags)

    # --- sharded gradients -------------------------------------------------------------------

    def _bound(self, p: torch.Tensor) -> bool:
        """Whether `p.grad` is this buffer's view (not None, not replaced by the user)."""
        g = p.grad
        return (
            g is not None
            and self._shard_grad is not None
            and isinstance(g, DTensor)
            and same_storage(g._local_tensor, self._shard_grad)
        )

    def _new_shard_grad(self) -> torch.Tensor:
        """The sharded gradients' buffer: Sg elements, then room for the F flags the
        reduce-scatter writes when it writes the sharded gradients directly."""
        return ops.aligned_empty(self.layout.slot + self.layout.flags, self.dtype, self.device,
                             pin_memory=self._pin_memory)

    def _write_shard_grad(self, reduced: torch.Tensor, add: bool, scale, fresh) -> None:
        """Write this rank's Sg reduced gradient elements into the shard gradient: added to the
        earlier sums with `add` (the tensors in `fresh`, whose .grad was dropped, start again
        from zero; a tensor no rank reached adds +0.0, which changes no bit of a sum of landed
        gradients, never -0.0), else written in one pass (no earlier sums: zero_grad() set them
        to None); cast and scaled on the way."""
        S = self.layout.slot
        if add:
            ops.zero_ranges_(self._shard_grad, fresh)
            ops.accumulate_(self._shard_grad[:S], reduced, scale)
        else:
            ops.cast_scale_(self._shard_grad[:S], reduced, scale)

    def _bind_grads(self, indices: Sequence[int], accumulate: bool) -> None:
        """Make the sharded gradients of tensors `indices` views of the shard gradient (if they
        are not already); with `accumulate`, a gradient the user assigned (not a view of this
        buffer) is added in first, as torch's FSDP2 adds the reduced gradient to an existing
        sharded `.grad`."""
        for i in indices:
            p, e = self._params[i], self._entries[i]
            if self._bound(p):
                continue
            a, b = self.layout.local[i]
            if accumulate and p.grad is not None:
                old = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if old.numel() != b - a:
                    raise ValueError(
                        f"{e.name}.grad: expected this rank's {b - a} "
                        f"elements ({p.placements}), got a tensor of shape {list(old.shape)}"
                    )
                self._shard_grad[a:b].add_(old.reshape(-1))
            p.grad = self._view(e, self._shard_grad, (a, b))

    # --- reduction ---------------------------------------------------------------------------

    def _write_flags(self, source: torch.Tensor, unreached: Sequence[bool] | None) -> None:
        """Write this rank's verdicts (1: reached or no verdict asked, 0: not reached) into the
        flags of every slot of the reduce-scatter input ([Note: unreached parameters])."""
        lay = self.layout
        S, F = lay.sizes[0], lay.flags
        if not F:
            return
        key = None if unreached is None else tuple(unreached)
        values = lay.flag_values_of.get(key)
        if values is None:
            values = lay.flag_values_of[key] = lay.flag_values(unreached)
        flags = torch.tensor(values, dtype=source.dtype)
        if source.device.type != "cpu":
            flags = flags.pin_memory().to(source.device, non_blocking=True)
        if lay.uniform:
            slots = source.view(-1, S + F)
            slots[:, S:].copy_(flags.expand(slots.shape[0], F))
            return
        if self._flag_index is None or self._flag_index.device != source.device:
            at = [a + s for a, s in zip(lay.starts, lay.sizes)]
            self._flag_index = (torch.tensor(at, device=source.device)[:, None]
                                + torch.arange(F, device=source.device)).view(-1)
        source.index_copy_(0, self._flag_index, flags.repeat(len(lay.sizes)))

    def reduce(
        self,
        *,
        accumulate: bool = False,
        average: bool = True,
        divide_factor: float | None = None,
        all_reduce: bool = True,
        unreached: Sequence[bool] | None = None,
        async_op=False,
    ) -> None:
        """Reduce-scatter the gradient buffer into the sharded gradients.

        SUM on the wire (gloo's AVG is unreliable, pytorch #162338). The gradients are scaled by
        1/world (if `average`; `divide_factor` replaces the world size) as they land when that is
        exact (`landing_scale`), and the reduce-scatter then writes the sharded gradients
        directly; otherwise one fused kernel scales and casts its result into them, adding when
        `accumulate` and some sharded gradient holds an earlier sum. HSDP: the result is then
        all-reduced over the other mesh dims (unless `all_reduce` is False). Gradients of
        no-sync micro-batches have accumulated in the buffer, in the reduce dtype. A world of one
        communicates nothing. With `async_op` only the reduce-scatter is launched;
        `finish_reduce()` completes it. `unreached[i]` marks tensors this rank's backward did not
        reach (None: every tensor counts as reached): see [Note: unreached parameters].
        """
        self.finish_reduce()
        lay = self.layout
        S = lay.slot
        if not lay.with_flags:  # laid out without flags: every tensor counts as reached
            unreached = None
        self.rt.write(self._key("grads"))  # the zeros and flags below, on the current stream
        if self.allocated:
            self._zero_unlanded()
        if self._rank_major_grads:
            source = self.flat
        else:
            source = self._to_rank_major(self.flat, S + lay.flags)
        self._write_flags(source, unreached)
        if divide_factor is not None:
            scale = 1.0 / divide_factor
        else:
            scale = 1.0 / (self.world * self._replicas) if average else 1.0
        scale /= self._land_scale
        comm = self.rs_comm if self.world > 1 else None  # [Note: custom comms]
        comm = comm if comms.stages(comm, self.compute_device) else None
        if self._shard_grad is not None and not any(self._bound(p) for p in self._params):
            # No `.grad` is a view of it any more (zero_grad(set_to_none=True)): the gradients
            # get fresh memory, as torch's get a fresh reduce-scatter output, so a reference
            # the user kept to an earlier `.grad` keeps its values.
            self._shard_grad = None
        # Offloaded buffers never reduce into the shard gradient directly: on a device it lives
        # on the host, and a CPU mesh takes the same path ([Note: offloaded gradients]).
        direct = (
            comm is None and self.world > 1 and scale == 1.0 and self.reduce_dtype == self.dtype
            and not self._offload and self._partial is None
            and (all_reduce or not self._replica_groups)
            and not (accumulate and any(self._bound(p) for p in self._params))
        )
        # On the reduce-scatter stream, after the gradients landed: [Note: streams and events]
        rt = self.rt
        rs = rt.stream("reduce_scatter")
        rt.reclaim(rs)  # outputs of earlier reductions, once the current stream is done
        rt.wait(rt.record(), rs)
        with rt.use(rs):
            reduced, source, temp = self._launch_reduce(direct, comm, source, S)
            handle = rt.handle(None)
            if self.world > 1:
                starts = None if comm is not None or lay.uniform else lay.starts
                work = comms.reduce_scatter(comm, reduced, source,
                                            self.rs_group or self._group, starts)
                rt.accesses("reduce_scatter",
                            reads=(self._key("staged_grads" if comm else "grads"),),
                            writes=(self._key("shard_grad" if direct else "reduced"),))
                handle = rt.handle(work)
        self._reduce = InFlightReduce(handle, source, temp, reduced, direct, accumulate, scale,
                                      all_reduce, unreached)
        if not async_op:
            self.finish_reduce()

    def _launch_reduce(self, direct: bool, comm, source: torch.Tensor, S: int):
        """The reduce-scatter's output (allocated on the reduce-scatter stream, current here)
        and input: (output, input, the output if it is a temporary to release after use)."""
        if direct:  # the reduce-scatter writes the sharded gradients
            sg = self._shard_grad
            self._shard_grad = sg = self._new_shard_grad() if sg is None else sg  # held
            return sg, source, None
        if self.world == 1:
            return source, source, None
        if comm is not None:  # staged in the comm's buffers, flags included
            lay = self.layout
            self.rt.accesses("copy", reads=(self._key("grads"),),
                             writes=(self._key("staged_grads"),))
            source = comms.stage(comm, source, self.world, max(lay.sizes) + lay.flags,
                                 None if lay.uniform else lay.starts)
            reduced = comms.allocate(comm, source.numel() // self.world, self.reduce_dtype,
                                     self.compute_device)
            return reduced, source, reduced
        reduced = torch.empty(S + self.layout.flags, dtype=self.reduce_dtype,
                              device=self.compute_device)
        return reduced, source, reduced

    def finish_reduce(self, bind: Sequence[bool] | None = None, hook=None,
                      defer: bool = False) -> list[bool]:
        """Wait for a launched reduce-scatter and write the sharded gradients.

        `bind[i]` says whether tensor i may receive its gradient (default: every tensor with
        room in the gradient buffer, [Note: compacted gradients]; never one without); of
        those marked unreached at launch, only the ones some rank reached do
        ([Note: unreached parameters]). The others keep their `.grad` as it was (None stays
        None). With `defer` the verdict for the tensors this rank did not reach is read at
        `resolve()` (which this and every later reduction call first) instead of now.
        Returns, per tensor, whether its gradient was written (all False if no reduction was in
        flight and no verdict pending). `hook`, if given, is `(fn, stream)`: `fn(reduced)` runs
        on this rank's reduced slot (its Sg gradient elements, then the F flags; after the HSDP
        all-reduce, before any scaling left after landing and the cast; torch's
        `set_all_reduce_hook`: the group then lands gradients unscaled), in `stream`'s context
        if not None.
        """
        done = self.resolve()
        if self._reduce is None:
            return done
        with tr.trace(tr.FINISH_REDUCE, self.trace_fqn):
            return self._finish_reduce(done, bind, hook, defer)

    def _finish_reduce(self, done: list[bool], bind, hook, defer: bool) -> list[bool]:
        """The steps of `finish_reduce`, each one method below."""
        red, self._reduce = self._reduce, None
        if self._replica_groups and not red.all_reduce:
            self._set_aside(red)  # an HSDP micro-batch without its all-reduce
            return done
        reduced = self._wait_reduced(red)  # reduce-scatter, and HSDP all-reduce, done
        if hook is not None:
            self._run_hook(hook, reduced)  # torch's set_all_reduce_hook
        bind = self._bindable(bind)
        asked = self._awaiting_verdict(red, bind)  # unreached here: the flags decide
        verdict = self._read_verdicts(reduced) if asked else None
        now = self._write_and_bind(red, reduced, bind, asked, defer)
        self._release_reduced(red.temp)
        if asked and verdict is not None:
            self._pending = PendingVerdicts(verdict, [(i, self.layout.flag_of[i]) for i in asked],
                                            red.accumulate)
        if (self._pending is not None or self._landing is not None) and not defer:
            now = [a or b for a, b in zip(now, self.resolve())]
        self._let_go()
        return [a or b for a, b in zip(done, now)]

    def _set_aside(self, red: InFlightReduce) -> None:
        """HSDP micro-batch without the all-reduce (`set_requires_all_reduce(False)`): keep the
        reduce-scattered sum (and flags) aside, as torch does; the next all-reducing
        micro-batch adds it in before its all-reduce. The sharded gradients are not touched
        until then."""
        F = self.layout.slot + self.layout.flags
        self.rt.wait_for(red.handle)
        self.rt.read(self._key("shard_grad" if red.direct else "reduced"))
        if self._partial is None:
            self._partial = red.reduced[:F].clone()
        else:
            self._partial.add_(red.reduced[:F])
        self._release_reduced(red.temp)

    def _wait_reduced(self, red: InFlightReduce) -> torch.Tensor:
        """Order the current stream after the reduction and return this rank's reduced slot
        (Sg gradient elements, then F flags). HSDP: first a sum kept aside is added in, then
        the slot is all-reduced over each replica dim, on the all-reduce stream after what it
        reduces ([Note: streams and events])."""
        rt, S, F = self.rt, self.layout.slot, self.layout.flags
        handle, reduced = red.handle, red.reduced
        rkey = self._key("shard_grad" if red.direct else "reduced")
        if self._replica_groups:
            if self._partial is not None:  # the kept sums, added on the current stream
                rt.wait_for(handle)
                rt.read(rkey)
                reduced = reduced[: S + F] + self._partial
                self._partial = None
                rkey = self._key("partial_sum")
                rt.write(rkey)
                handle = rt.handle(None)
            ar = rt.stream("all_reduce")
            for group in self._replica_groups:
                rt.wait_for(handle, ar)  # after the reduce-scatter, or the previous dim's
                with rt.use(ar):
                    work = comms.named(dist.all_reduce(reduced, op=dist.ReduceOp.SUM,
                                                       group=group, async_op=True),
                                       "all_reduce", group)
                    rt.accesses("all_reduce", reads=(rkey,), writes=(rkey,))
                    handle = rt.handle(work)
        rt.wait_for(handle)
        red.source = None  # the reduce-scatter's input may go: it completed
        rt.read(rkey)
        return reduced

    def _run_hook(self, hook, reduced: torch.Tensor) -> None:
        """`hook` = (fn, stream): `fn(reduced)` in `stream`'s context (None: the current one)."""
        fn, stream = hook
        if stream is None:
            fn(reduced)
        else:
            with torch.get_device_module(self.compute_device.type).stream(stream):
                fn(reduced)

    def _bindable(self, bind: Sequence[bool] | None) -> list[bool]:
        """Per tensor, whether it may receive its gradient: as `bind` says (default: every
        one), and only with room in the gradient buffer ([Note: compacted gradients])."""
        bind = [True] * len(self._params) if bind is None else list(bind)
        return [b and m for b, m in zip(bind, self.layout.mask)]

    def _awaiting_verdict(self, red: InFlightReduce, bind: Sequence[bool]) -> list[int]:
        """The tensors to bind that this rank's backward did not reach: their gradient exists
        only if some rank reached them ([Note: unreached parameters]). On a mesh of one rank
        (no flags) its own backward is the verdict: they get none, and none is asked."""
        unreached = red.unreached
        if unreached is None:
            return []
        return [i for i, (b, u) in enumerate(zip(bind, unreached)) if b and u]

    def _read_verdicts(self, reduced: torch.Tensor) -> object | None:
        """Start reading the verdict flags of `reduced` to the host, all of them at once (None
        without flags: a mesh of one rank)."""
        S, F = self.layout.slot, self.layout.flags
        return start_read(reduced[S : S + F] != 0) if F else None

    def _write_and_bind(self, red: InFlightReduce, reduced: torch.Tensor,
                        bind: Sequence[bool], asked: Sequence[int], defer: bool) -> list[bool]:
        """Write the reduced gradients into the sharded gradients and bind those of the tensors
        in `bind` but not in `asked` (which wait for their verdict); returns, per tensor,
        whether its gradient was written now. Offloaded inside backward (`defer`), the reduced
        gradients go to the host without a wait and are written and bound at `resolve`
        ([Note: offloaded gradients])."""
        lay, n = self.layout, len(self._params)
        S = lay.slot
        land_later = self._offload and defer and not red.direct
        if land_later:
            arriving = start_copy_to_host(reduced[:S])
        elif reduced.device != self.device:  # offloaded, outside backward: here and now
            reduced = reduced[:S].to(self.device)
        sg = self._shard_grad
        self._shard_grad = self._new_shard_grad() if sg is None else sg  # held until bound
        # Sharded gradients that are not this buffer's views start again from zero (in the
        # accumulating pass below): every tensor that may be bound now or after its verdict.
        fresh = [lay.local[i] for i, (p, b) in enumerate(zip(self._params, bind))
                 if b and not self._bound(p)]
        if not red.direct:
            self.rt.write(self._key("shard_grad"))
        # Some sharded gradients (of any tensor, reached or not) hold earlier sums: add to them.
        add = red.accumulate and any(self._bound(p) for p in self._params)
        if not red.direct and not land_later:
            self._write_shard_grad(reduced[:S], add, red.scale, fresh)
        waiting = set(asked)
        bound_now = [i for i in range(n) if bind[i] and i not in waiting]
        if land_later:
            self._landing = OffloadedLanding(arriving, add, red.scale, fresh, bound_now,
                                             red.accumulate)
            return [False] * n
        self._bind_grads(bound_now, red.accumulate)
        now = [False] * n
        for i in bound_now:
            now[i] = True
        return now

    def _release_reduced(self, temp: torch.Tensor | None) -> None:
        """Free the gradient buffer (allocated and last read on the current stream, which the
        reduce-scatter's event ordered after the reduction) and release a temporary
        reduce-scatter output to the reduce-scatter stream ([Note: streams and events])."""
        rt, key = self.rt, self._key
        rt.free(key("grads"), self.flat)
        if temp is not None:
            rt.release(key("reduced"), temp, rt.stream("reduce_scatter"), "drop")

    @property
    def pending_reads(self) -> list[HostCopy]:
        """The host copies `resolve` will wait for (verdicts, offloaded gradients)."""
        reads = [] if self._pending is None else [self._pending.reached]
        return reads if self._landing is None else reads + [self._landing.arriving]

    def record_verdicts(self) -> None:
        """At the end of a backward iteration: note, per tensor, whether its parameter has a
        gradient, for the optimizers ([Note: grad verdicts for optimizers]); no record while
        a reduction or a verdict is still pending."""
        busy = self._reduce is not None or self._pending is not None or self._landing is not None
        # The verdicts agree over the shard ranks (the flags) and the replicas (HSDP adds the
        # flags in its all-reduce); replicas with no shard dim (DDP mode) carry no flags.
        agreed = self.world > 1 or self._replicas == 1
        if busy or not agreed:
            self.verdicts, self.fresh = None, []
            return
        self.verdicts = [p.grad is not None for p in self._params]
        self.fresh = [True] * len(self.verdicts)
        self._verdict_index = {}
        for i, (p, e) in enumerate(zip(self._params, self._entries)):
            # A TP/EP parameter's ranks on the other mesh dims run reductions of their own,
            # whose verdicts may differ: it takes the all-reduce ([Note: FSDP over TP]).
            if e.tp is None:
                GRAD_VERDICTS[id(p)] = self
                self._verdict_index[id(p)] = i

    def verdict_index(self, p: torch.Tensor) -> int | None:
        """Parameter `p`'s index in the records (None: not one of these parameters)."""
        i = self._verdict_index.get(id(p))
        return i if i is not None and self._params[i] is p else None

    def resolve(self) -> list[bool]:
        """Write and bind what `finish_reduce(defer=True)` left pending: offloaded gradients
        arriving on the host ([Note: offloaded gradients]), and the gradients of tensors waiting
        for their verdict ([Note: unreached parameters]); returns, per tensor, whether its
        gradient was written now."""
        if self._landing is None and self._pending is None:
            return [False] * len(self._params)
        with tr.trace(tr.RESOLVE_GRADS, self.trace_fqn):
            return self._resolve()

    def _resolve(self) -> list[bool]:
        written = [False] * len(self._params)
        landing, self._landing = self._landing, None
        if landing is not None:
            host = landing.arriving.wait()
            self._write_shard_grad(host, landing.add, landing.scale, landing.fresh)
            self._bind_grads(landing.bind, landing.accumulate)
            for i in landing.bind:
                written[i] = True
        pending, self._pending = self._pending, None
        if pending is None:
            self._let_go()
            return written
        reached = pending.reached.wait().tolist()
        chosen = [i for i, j in pending.asked if reached[j]]
        self._bind_grads(chosen, pending.accumulate)
        for i in chosen:
            written[i] = True
        self._let_go()
        return written
