"""The gradient half of a DBuffer: gradients landing in the buffer, no-sync accumulation, the
reduce-scatter and the sharded gradients it writes.

[Note: gradient landing]
Backward does not write into a zeroed buffer through autograd's accumulation (a zero pass, then
a read-add-write per element). Autograd stores each unsharded parameter's gradient in its
`.grad` (the first without a copy; a module used twice adds the second, as with torch's FSDP2),
and the group's post-backward hands them all to `land_grads`, which writes each parameter's
range once (`+0.0 + scale * g`) or, when the buffer already holds an earlier gradient (no-sync
micro-batches, a second post-backward before the reduction), adds it in, in one `land_` launch
for the group (FSDP2's copy-in is one `chunk_cat` per group), and drops the `.grad`s. The buffer
has the reduce dtype, so the cast to it happens in that same write. `scale` is 1/world (HSDP:
1/(shard x replicate); or 1/divide_factor) when that is a power of two: multiplying by it before
the SUM gives exactly the bits of dividing after it (short of subnormals), so the reduce-scatter
can write the sharded gradients directly, with no pass of its own. So a parameter's gradient
costs one write, as FSDP2's copy into its reduce-scatter input does, and no hook of its own.
Ranges no gradient landed in (frozen and unreached parameters, padding) are zeroed by one launch
(`complete_grads`) before the buffer is read.
The gradient buffer is the reduce-scatter's input, rank-major with a slot of `S + F` elements per
rank: the S gradient elements of rank r's shard, then F verdict flags ([Note: unreached
parameters]; F = 0 on a mesh of one rank). A parameter that crosses a shard boundary is therefore
not one contiguous range of it: it lands in pieces (one per slot it crosses, all in the same
`land_` launch); one inside a slot (most parameters) is one piece. (`ChunkedDBuffer` lands
gradients in the full layout and adds the flags in its rank-major copy.)

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
is laid out without flags (`set_grad_layout(flags=False)`): the reduce-scatter then carries the
trainable gradients only, as torch's.
Reading a verdict is a device-to-host read, needed only when this rank's backward missed a
trainable tensor of the buffer (it knows the tensors it reached): one read per buffer, of all
its flags. Inside backward (`finish_reduce(defer=True)`, the group's state after its
post-backward) the read is started without waiting (a copy to pinned host memory and an event on
an accelerator) and the gradients of those tensors are bound at the end of backward
(`resolve_grads`, from `ParamGroup.end_backward`), so backward does not stall the host per
group; any later use of the buffer (the next reduction, `apply_`) resolves first. Tensors this
rank reached are bound when their reduction finishes; hooks on the sharded parameters (an
optimizer step in backward) run when the gradient is bound, so for the others at the end of
backward.
(tests/fsdp/test_routing.py: ranks reaching different experts, holding none of some, through
clipping, the optimizers, GradScaler and DCP; tests/stress: the same over many steps.)

[Note: offloaded gradients]
With CPU offload the sharded gradients live in (pinned) host memory, where the optimizer steps.
Inside backward a group's reduced gradients are not waited for: `finish_reduce(defer=True)`
starts their copy to a pinned host tensor (non-blocking, an event recorded after it) and leaves
the host-side write (cast, scale, accumulation into earlier sums) and the binding of `.grad` to
`resolve_grads` at the end of backward, which waits for the event first; torch's FSDP2 likewise
copies with `non_blocking=True` and waits for its offload events in `finalize_backward`. So
backward issues every group's reduce-scatter and copy without a host sync per group. The same
deferral runs on the CPU (with a plain copy and no event), where tests/fsdp/test_cpu_offload.py
and the happens-before loop with offload exercise it. Outside backward (an explicit reduction)
the copy is synchronous.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veragged.dbuffer import comms, ops
from veragged.dbuffer.grad_layout import GradientLayout
from veragged.dbuffer.memory import aligned_empty

__all__ = ["FLAG_ALIGN_BYTES", "GradientPath"]

# The flags round up to 16 bytes (not the 256-byte alignment of parameter slots): every rank's
# gradient slot then still starts 16-byte aligned, which vectorised loads and NCCL's copies
# want, and a buffer of up to 4 fp32 tensors sends 16 bytes of flags per rank, not 256.
FLAG_ALIGN_BYTES = 16


def _start_copy_to_host(t: torch.Tensor):
    """Start copying `t` into a host tensor of its own: (host tensor, event to wait for before
    reading it, or None where `t` is on the CPU and the copy is done)."""
    if t.device.type == "cpu":
        return t.clone(), None
    return _start_read(t)


def _start_read(t: torch.Tensor):
    """Start copying `t` to the host: (host tensor, event to wait for, or None on the CPU)."""
    if t.device.type == "cpu":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.get_device_module(t.device.type).Event()
    event.record()
    return host, event


class GradientPath(GradientLayout):
    """`DBuffer`'s gradient methods (a mixin: the buffers and entries are DBuffer's)."""

    # --- landing -----------------------------------------------------------------------------

    def alloc_unsharded_grads(self, scale: float = 1.0) -> None:
        """Allocate the gradient buffer (the reduce dtype), unzeroed: gradients land by
        `land_grads`, multiplied by `scale` (see `landing_scale`), and the rest is zeroed by
        `complete_grads` ([Note: gradient landing])."""
        self.rt.alloc(self.key("grads"), self._grads)
        self._landed = [False] * len(self.entries)
        self._land_scale = scale
        if self._zero is None:  # the +0.0 each landing adds, made once
            self._zero = torch.zeros((), dtype=self._grads.dtype, device=self._grads.device)

    def landing_scale(self, divide_factor: float | None = None, allowed: bool = True) -> float:
        """The factor gradients may be multiplied by as they land: 1/world (or 1/divide_factor)
        when that is a power of two, so that scaling before the SUM gives the bits scaling after
        it would (short of subnormals) and the reduce-scatter can write the sharded gradients
        with no pass of its own; else 1.0."""
        replicas = math.prod(self.mesh.size(d) for d in range(self.mesh.ndim)
                             if d != self.shard_dim)
        factor = float(divide_factor) if divide_factor is not None else self.world * replicas
        if not allowed or factor <= 0 or math.frexp(factor)[0] != 0.5:
            return 1.0
        return 1.0 / factor

    def _land_ranges(self, i: int):
        """Tensor i's pieces in the gradient buffer: (offset in the tensor, offset in the
        buffer, elements), one per rank slot it crosses ([Note: gradient landing])."""
        a, starts = 0, self._grad_starts
        for r, off, k in self._grad_slots[i]:
            yield a, starts[r] + off, k
            a += k

    def _make_room(self, indices) -> None:
        """Gradient room for tensors frozen when the layout was made that have a gradient."""
        if not all(self._grad_mask[i] for i in indices):
            room = set(indices)
            self.set_grad_layout([m or j in room for j, m in enumerate(self._grad_mask)],
                                 self._grad_flags)

    def land_grads(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Land each `(i, grad)`: write (first gradient since allocation) or add it into
        tensor i's range, all in one `land_` launch ([Note: gradient landing])."""
        if not grads:
            return
        self._make_room([i for i, _ in grads])
        srcs: list[torch.Tensor] = []
        pieces: list[int] = []
        for i, grad in grads:
            spmd = self.entries[i].spmd
            if spmd is not None:  # a DTensor on the TP mesh: [Note: FSDP over TP]
                grad = spmd.local_grad(grad)
            if grad.dtype not in ops.LAND_DTYPES or self._grads.dtype not in ops.LAND_DTYPES:
                self.land_grad(i, grad, local=True)  # complex, float8: torch's adds
                continue
            j, add = len(srcs), int(self._landed[i])
            srcs.append(grad.contiguous().view(-1))
            for a, d, k in self._land_ranges(i):
                pieces += (j, a, d, k, add)
            self._landed[i] = True
        if srcs:
            self.rt.write(self.key("grads"))
            ops.land_(self._grads, srcs, pieces, self._land_scale)

    def land_grad(self, i: int, grad: torch.Tensor, local: bool = False) -> None:
        """Write (first gradient since allocation) or add `grad` into tensor `i`'s range, by
        torch's ops, one per piece (`land_grads` lands several tensors in one launch);
        `local`: a TP gradient already made local."""
        self._make_room([i])
        spmd = self.entries[i].spmd
        if spmd is not None and not local:  # a DTensor on the TP mesh: [Note: FSDP over TP]
            grad = spmd.local_grad(grad)
        flat, G = grad.reshape(-1), self._grads
        parts = [(G[d : d + k], flat[a : a + k]) for a, d, k in self._land_ranges(i)]
        self.rt.write(self.key("grads"))
        with torch.no_grad():
            if self._landed[i]:
                for view, g in parts:
                    view.add_(g, alpha=self._land_scale)
            else:  # +0.0 + x is never -0.0: see [Note: unreached parameters]
                for view, g in parts:
                    torch.add(self._zero, g, alpha=self._land_scale, out=view)
                self._landed[i] = True

    def complete_grads(self) -> None:
        """Zero every range of the gradient buffer no gradient landed in, in one launch."""
        covered: list[list[tuple[int, int]]] = [[] for _ in range(self.world)]
        S = self.shard_size
        for e, landed, pieces in zip(self.entries, self._landed, self._grad_slots):
            if not landed:
                continue
            a = e.start  # the tensor fills [start, stop): TP padding after it is zeroed too
            for r, off, k in pieces:
                fill = min(a + k, e.stop) - a
                if fill > 0:
                    covered[r].append((off, off + fill))
                a = (r + 1) * S
        ranges, sizes, starts = [], self._grad_sizes, self._grad_starts
        if not self._GRADS_RANK_MAJOR:  # the full layout: one range of W * S elements
            covered, sizes = [sum(covered, [])], [self.world * S]
        for r, spans in enumerate(covered):
            pos, at = 0, starts[r]
            for a, b in sorted(spans):
                if a > pos:
                    ranges.append((at + pos, at + a))
                pos = max(pos, b)
            if pos < sizes[r]:
                ranges.append((at + pos, at + sizes[r]))
        if ranges:
            ops.zero_ranges_(self._grads, ranges)
        self._landed = [True] * len(self.entries)

    def _bound(self, p: torch.Tensor) -> bool:
        """Whether `p.grad` is this buffer's view (not None, not replaced by the user)."""
        g = p.grad
        return (
            g is not None
            and self._shard_grad is not None
            and isinstance(g, DTensor)
            and g._local_tensor.untyped_storage().data_ptr()
            == self._shard_grad.untyped_storage().data_ptr()
        )

    @property
    def grads_allocated(self) -> bool:
        return self._grads.untyped_storage().size() > 0

    def zero_unsharded_grads(self) -> None:
        """Allocate and zero the gradient buffer (one launch): every tensor counts as landed,
        so `land_grads` adds into it."""
        self.rt.alloc(self.key("grads"), self._grads)
        ops.zero_ranges_(self._grads, [(0, self._grads.numel())])
        self._landed = [True] * len(self.entries)
        self._land_scale = 1.0

    def _replica_dims(self) -> list[int]:
        return [d for d in range(self.mesh.ndim) if d != self.shard_dim and self.mesh.size(d) > 1]

    def _new_shard_grad(self) -> torch.Tensor:
        """The sharded gradients' buffer: S elements, then room for the F flags the
        reduce-scatter writes when it writes the sharded gradients directly."""
        return aligned_empty(self._grad_slot + self._flags, self.dtype, self.device,
                             pin_memory=self._pin)

    # --- reduction ---------------------------------------------------------------------------

    def _write_flags(self, source: torch.Tensor, unreached: Sequence[bool] | None) -> None:
        """Write this rank's verdicts (1: reached or no verdict asked, 0: not reached) into the
        flags of every slot of the reduce-scatter input ([Note: unreached parameters])."""
        S, F = self._grad_sizes[0], self._flags
        if not F:
            return
        values = [0.0] * F
        for i, j in enumerate(self._flag_of):
            if j is not None:
                values[j] = 0.0 if unreached is not None and unreached[i] else 1.0
        flags = torch.tensor(values, dtype=source.dtype)
        if source.device.type != "cpu":
            flags = flags.pin_memory().to(source.device, non_blocking=True)
        if self.grad_slots_uniform:
            slots = source.view(-1, S + F)
            slots[:, S:].copy_(flags.expand(slots.shape[0], F))
            return
        if self._flag_index is None or self._flag_index.device != source.device:
            at = [a + s for a, s in zip(self._grad_starts, self._grad_sizes)]
            self._flag_index = (torch.tensor(at, device=source.device)[:, None]
                                + torch.arange(F, device=source.device)).view(-1)
        source.index_copy_(0, self._flag_index, flags.repeat(len(self._grad_sizes)))

    def reduce_grads(
        self,
        *,
        accumulate: bool = False,
        average: bool = True,
        divide_factor: float | None = None,
        all_reduce: bool = True,
        unreached: Sequence[bool] | None = None,
        async_op=False,
    ):
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
        S = self._grad_slot
        if not self._grad_flags:  # laid out without flags: every tensor counts as reached
            unreached = None
        self.rt.write(self.key("grads"))  # the zeros and flags below, on the current stream
        if self.grads_allocated:
            self.complete_grads()
        if self._GRADS_RANK_MAJOR:
            source = self._grads
        else:
            source = self._rank_major(self._grads, S + self._flags)
        self._write_flags(source, unreached)
        replicas = math.prod(self.mesh.size(d) for d in self._replica_dims())
        if divide_factor is not None:
            scale = 1.0 / divide_factor
        else:
            scale = 1.0 / (self.world * replicas) if average else 1.0
        scale /= self._land_scale
        comm = self.reduce_scatter_comm if self.world > 1 else None  # [Note: custom comms]
        comm = comm if comms.stages(comm, self.compute_device) else None
        if self._shard_grad is not None and not any(self._bound(p) for p in self.params):
            # No `.grad` is a view of it any more (zero_grad(set_to_none=True)): the gradients
            # get fresh memory, as torch's get a fresh reduce-scatter output, so a reference
            # the user kept to an earlier `.grad` keeps its values.
            self._shard_grad = None
        # Offloaded buffers never reduce into the shard gradient directly: on a device it lives
        # on the host, and a CPU mesh takes the same path ([Note: offloaded gradients]).
        direct = (
            comm is None and self.world > 1 and scale == 1.0 and self.reduce_dtype == self.dtype
            and not self.offload and self._partial is None
            and (all_reduce or not self._replica_dims())
            and not (accumulate and any(self._bound(p) for p in self.params))
        )
        # On the reduce-scatter stream, after the gradients landed: [Note: streams and events]
        rt = self.rt
        rs = rt.stream("reduce_scatter")
        rt.reclaim(rs)  # outputs of earlier reductions, once the current stream is done
        rt.wait(rt.record(), rs)
        with rt.use(rs):
            reduced, source, temp = self._launch_reduce(direct, comm, source, S)
            handle = rt.launched(None)
            if self.world > 1:
                starts = (None if comm is not None or self.grad_slots_uniform
                          else self._grad_starts)
                work = comms.reduce_scatter(comm, reduced, source,
                                            self.reduce_scatter_group or self.group, starts)
                rt.launch("reduce_scatter", reads=(self.key("staged_grads" if comm else "grads"),),
                          writes=(self.key("shard_grad" if direct else "reduced"),))
                handle = rt.launched(work)
        self._reduce = (handle, (source, temp), reduced, direct, accumulate, scale, all_reduce,
                        unreached)
        if not async_op:
            self.finish_reduce()

    def _launch_reduce(self, direct: bool, comm, source: torch.Tensor, S: int):
        """The reduce-scatter's output (allocated on the reduce-scatter stream, current here)
        and input: (output, input, the output if it is a temporary to release after use)."""
        if direct:  # the reduce-scatter writes the sharded gradients
            if self._shard_grad is None:
                self._shard_grad = self._new_shard_grad()
            return self._shard_grad, source, None
        if self.world == 1:
            return source, source, None
        if comm is not None:  # staged in the comm's buffers, flags included
            source = self._stage(comm, source)
            reduced = comms.allocate(comm, source.numel() // self.world, self.reduce_dtype,
                                     self.compute_device)
            return reduced, source, reduced
        reduced = torch.empty(S + self._flags, dtype=self.reduce_dtype, device=self.compute_device)
        return reduced, source, reduced

    def _stage(self, comm, source: torch.Tensor) -> torch.Tensor:
        """`source` copied into `comm`'s buffer, every rank's slot padded with zeros to the
        largest (a comm reduce-scatters equal slots: [Note: custom comms])."""
        W, F = self.world, self._flags
        width = max(self._grad_sizes) + F
        staged = comms.allocate(comm, W * width, source.dtype, source.device)
        self.rt.launch("copy", reads=(self.key("grads"),), writes=(self.key("staged_grads"),))
        if self.grad_slots_uniform:
            staged.copy_(source)
            return staged
        slots = staged.view(W, width)
        with torch.no_grad():
            slots.zero_()
            for r, (a, b) in enumerate(zip(self._grad_starts, self._grad_starts[1:])):
                slots[r, : b - a].copy_(source[a:b])
        return staged

    def finish_reduce(self, bind: Sequence[bool] | None = None, hook=None,
                      defer: bool = False) -> list[bool]:
        """Wait for a launched reduce-scatter and write the sharded gradients.

        `bind[i]` says whether tensor i may receive its gradient (default: every tensor with
        room in the gradient buffer, [Note: compacted gradients]; never one without); of
        those marked unreached at launch, only the ones some rank reached do
        ([Note: unreached parameters]). The others keep their `.grad` as it was (None stays
        None). With `defer` the verdict for the tensors this rank did not reach is read at
        `resolve_grads()` (which this and every later reduction call first) instead of now.
        Returns, per tensor, whether its gradient was written (all False if no reduction was in
        flight and no verdict pending). `hook`, if given, is `(fn, stream)`: `fn(reduced)` runs
        on this rank's reduced slot (its S gradient elements, then the F flags; after the HSDP
        all-reduce, before any scaling left after landing and the cast; torch's
        `set_all_reduce_hook`: the group then lands gradients unscaled), in `stream`'s context
        if not None.
        """
        done = self.resolve_grads()
        if self._reduce is None:
            return done
        handle, (source, temp), reduced, direct, accumulate, scale, all_reduce, unreached = (
            self._reduce)
        self._reduce = None
        rt = self.rt
        rkey = self.key("shard_grad" if direct else "reduced")
        S, F = self._grad_slot, self._flags
        n = len(self.params)
        replica_dims = self._replica_dims()
        if replica_dims and not all_reduce:
            # HSDP micro-batch without the all-reduce (set_requires_all_reduce(False)): keep the
            # reduce-scattered sum (and flags) aside, as torch does; the next all-reducing
            # micro-batch adds it in before its all-reduce. The sharded gradients are not
            # touched until then.
            rt.completed(handle)
            rt.read(rkey)
            if self._partial is None:
                self._partial = reduced[: S + F].clone()
            else:
                self._partial.add_(reduced[: S + F])
            self._release_reduced(temp)
            return done
        if replica_dims:  # HSDP: the all-reduce on its own stream, after what it reduces
            if self._partial is not None:  # the kept sums, added on the current stream
                rt.completed(handle)
                rt.read(rkey)
                reduced = reduced[: S + F] + self._partial
                self._partial = None
                rkey = self.key("partial_sum")
                rt.write(rkey)
                handle = rt.launched(None)
            ar = rt.stream("all_reduce")
            for d in replica_dims:
                rt.completed(handle, ar)  # after the reduce-scatter, or the previous dim's
                with rt.use(ar):
                    work = dist.all_reduce(reduced, op=dist.ReduceOp.SUM,
                                           group=self.mesh.get_group(d), async_op=True)
                    rt.launch("all_reduce", reads=(rkey,), writes=(rkey,))
                    handle = rt.launched(work)
        rt.completed(handle)
        del source
        rt.read(rkey)
        if hook is not None:
            fn, stream = hook
            if stream is None:
                fn(reduced)
            else:
                with torch.get_device_module(self.compute_device.type).stream(stream):
                    fn(reduced)
        bind = [True] * n if bind is None else list(bind)
        bind = [b and m for b, m in zip(bind, self._grad_mask)]  # no room, no gradient
        # Tensors this rank did not reach take the verdict of the flags: read once, for all.
        asked = [] if unreached is None else [i for i in range(n) if bind[i] and unreached[i]]
        verdict = None
        if asked and F:
            verdict = _start_read(reduced[S : S + F] != 0)
        # Offloaded (the optimizer steps on host shards) inside backward: the reduced gradients
        # go to the host without waiting for them ([Note: offloaded gradients]).
        land_later = self.offload and defer and not direct
        if land_later:
            arriving = _start_copy_to_host(reduced[:S])
        elif reduced.device != self.device:  # offloaded, outside backward: here and now
            reduced = reduced[:S].to(self.device)
        if self._shard_grad is None:
            self._shard_grad = self._new_shard_grad()
        # Sharded gradients that are not this buffer's views start again from zero (in the
        # accumulating pass below): every tensor that may be bound now or after its verdict.
        fresh = [self._grad_local[i] for i, (p, b) in enumerate(zip(self.params, bind))
                 if b and not self._bound(p)]
        if not direct:
            rt.write(self.key("shard_grad"))
        # Some sharded gradients (of any tensor, reached or not) hold earlier sums: add to them.
        add = accumulate and any(self._bound(p) for p in self.params)
        if not direct and not land_later:
            self._write_shard_grad(reduced[:S], add, scale, fresh)
        now = list(bind)
        for i in asked:
            now[i] = False
        if verdict is None and asked:  # a mesh of one rank: its own backward is the verdict
            asked = []
        bound_now = [i for i in range(n) if now[i]]
        if land_later:
            self._landing = (arriving, add, scale, fresh, bound_now, accumulate)
            now = [False] * n
        else:
            self._bind_grads(bound_now, accumulate)
        self._release_reduced(temp)
        if asked:
            self._pending = (verdict, [(i, self._flag_of[i]) for i in asked], accumulate)
        if (asked or land_later) and not defer:
            late = self.resolve_grads()
            now = [a or b for a, b in zip(now, late)]
        return [a or b for a, b in zip(done, now)]

    def _write_shard_grad(self, reduced: torch.Tensor, add: bool, scale, fresh) -> None:
        """Write this rank's S reduced gradient elements into the shard gradient: added to the
        earlier sums with `add` (the tensors in `fresh`, whose .grad was dropped, start again
        from zero; a tensor no rank reached adds +0.0, which changes no bit of a sum of landed
        gradients, never -0.0), else written in one pass (no earlier sums: zero_grad() set them
        to None); cast and scaled on the way."""
        S = self._grad_slot
        if add:
            ops.zero_ranges_(self._shard_grad, fresh)
            ops.accumulate_(self._shard_grad[:S], reduced, scale)
        else:
            ops.cast_scale_(self._shard_grad[:S], reduced, scale)

    def _release_reduced(self, temp: torch.Tensor | None) -> None:
        """Free the gradient buffer (allocated and last read on the current stream, which the
        reduce-scatter's event ordered after the reduction) and release a temporary
        reduce-scatter output to the reduce-scatter stream ([Note: streams and events])."""
        self.rt.free(self.key("grads"), self._grads)
        if temp is not None:
            self.rt.release(self.key("reduced"), temp, self.rt.stream("reduce_scatter"), "drop")

    def resolve_grads(self) -> list[bool]:
        """Bind the gradients of the tensors whose verdict `finish_reduce(defer=True)` left
        pending (waiting for its read: [Note: unreached parameters]); returns, per tensor,
        whether its gradient was written now."""
        written = [False] * len(self.params)
        landing, self._landing = self._landing, None
        if landing is not None:  # [Note: offloaded gradients]
            (host, event), add, scale, fresh, bound_now, accumulate = landing
            if event is not None:
                event.synchronize()
            self._write_shard_grad(host, add, scale, fresh)
            self._bind_grads(bound_now, accumulate)
            for i in bound_now:
                written[i] = True
        pending, self._pending = self._pending, None
        if pending is None:
            return written
        (host, event), asked, accumulate = pending
        if event is not None:
            event.synchronize()
        reached = host.tolist()
        chosen = [i for i, j in asked if reached[j]]
        self._bind_grads(chosen, accumulate)
        for i in chosen:
            written[i] = True
        return written

    def _bind_grads(self, indices: Sequence[int], accumulate: bool) -> None:
        """Make the sharded gradients of tensors `indices` views of the shard gradient (if they
        are not already); with `accumulate`, a gradient the user assigned (not a view of this
        buffer) is added in first, as torch's FSDP2 adds the reduced gradient to an existing
        sharded `.grad`."""
        for i in indices:
            p, e = self.params[i], self.entries[i]
            if self._bound(p):
                continue
            a, b = self._grad_local[i]
            if accumulate and p.grad is not None:
                old = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if old.numel() != b - a:
                    raise ValueError(
                        f"{e.name}.grad: expected this rank's {b - a} "
                        f"elements ({p.placements}), got a tensor of shape {list(old.shape)}"
                    )
                self._shard_grad[a:b].add_(old.reshape(-1))
            p.grad = self._sharded(e, self._shard_grad, requires_grad=False, local=(a, b))
