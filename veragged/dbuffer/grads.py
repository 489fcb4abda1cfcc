"""The gradient half of a DBuffer: gradients landing in the buffer, no-sync accumulation, the
reduce-scatter and the sharded gradients it writes.

[Note: gradient landing]
Backward does not write into a zeroed buffer through autograd's accumulation (a zero pass, then
a read-add-write per element). Each unsharded parameter's `.grad` stays None; when autograd has
stored a gradient, a post-accumulate-grad hook (`ParamGroup`) hands it to `land_grad`, which
writes the parameter's range of the gradient buffer once (`+0.0 + scale * g`, so no element is
-0.0: see [Note: unreached parameters]) or, for a later gradient before the buffer is reduced
(a module used twice, no-sync micro-batches), adds it in, and drops `.grad` again. The buffer
has the reduce dtype, so the cast to it happens in that same write. `scale` is 1/world (HSDP:
1/(shard x replicate); or 1/divide_factor) when that is a power of two: multiplying by it before
the SUM gives exactly the bits of dividing after it (short of subnormals), so the
reduce-scatter can write the sharded gradients directly, with no pass of its own. Autograd's
first gradient is stored without a copy, so a parameter's gradient costs one write, as FSDP2's
copy into its reduce-scatter input does. Ranges no gradient landed in (frozen and unreached
parameters, padding) are zeroed by one launch (`complete_grads`) before the buffer is read.

[Note: unreached parameters]
A parameter that no rank's backward reached keeps `.grad = None` (torch's FSDP2 leaves it out of
its reduce-scatter), yet the reduce-scatter covers the whole buffer on every rank, so that ranks
whose data reached different parameters still issue the same collective. Which parameters some
rank reached travels inside that collective, at no cost: a reached element is never -0.0 (its
first gradient lands as `g + 0.0`, later ones are added, and in round-to-nearest x + y is -0.0
only when both are -0.0; [Note: gradient landing]); before the reduce-scatter each rank writes
-0.0 over the parameters it did not reach. A SUM is then -0.0 exactly when every rank sent -0.0, i.e. when no
rank reached the parameter, and every rank holding part of it reads the same answer from its
first local element. Adding -0.0 to a value leaves it unchanged, so the marks never alter a
gradient. This needs a SUM that adds in IEEE arithmetic without a +0.0 identity: gloo's does
(tests/fsdp/test_lifecycle.py::test_ranks_using_different_parameters); NCCL's ring and tree
kernels add the ranks' values the same way (not yet checked on a GPU here). A backend that
lost the sign would make every parameter read as reached, i.e. zeros instead of None, the same
on every rank. A rank holding none of a parameter answers from
its own backward, which agrees with the others whenever every rank reached the same parameters
(torch's requirement in this mode); `set_reduce_scatter_unused_params(True)` instead gives every
trainable parameter a gradient, zeros where none was reached, the same on every rank: the mode
for data-dependent routing (experts without tokens on some ranks), as with torch's FSDP2. (A
has-grad all-reduce beside the reduce-scatter would give the None verdict everywhere, but
backward would then issue a collective torch's does not; carrying the verdicts inside the
reduce-scatter needs a per-slot region in the layout: not done.)
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veragged.dbuffer import ops
from veragged.dbuffer.entries import Entry as _Entry
from veragged.dbuffer.memory import aligned_empty

__all__ = ["GradientPath"]


class GradientPath:
    """`DBuffer`'s gradient methods (a mixin: the buffers and entries are DBuffer's)."""

    def alloc_unsharded_grads(self, scale: float = 1.0) -> list[torch.Tensor]:
        """Allocate the gradient buffer (the reduce dtype), unzeroed: gradients land by
        `land_grad`, multiplied by `scale` (see `landing_scale`), and the rest is zeroed by
        `complete_grads` ([Note: gradient landing]). Returns the per-tensor views."""
        self._alloc(self._grads)
        self._landed = [False] * len(self.entries)
        self._land_scale = scale
        if self._zero is None:  # the +0.0 each landing adds, made once
            self._zero = torch.zeros((), dtype=self._grads.dtype, device=self._grads.device)
        return self.unsharded_grads

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

    def land_grad(self, i: int, grad: torch.Tensor) -> None:
        """Write (first gradient since allocation) or add `grad` into tensor `i`'s range."""
        view = self.unsharded_grads[i]
        spmd = self.entries[i].spmd
        if spmd is not None:  # a DTensor on the TP mesh: [Note: FSDP over TP]
            grad = spmd.local_grad(grad)
        with torch.no_grad():
            if self._landed[i]:
                view.add_(grad, alpha=self._land_scale)
            else:  # +0.0 + x is never -0.0: see [Note: unreached parameters]
                torch.add(self._zero, grad, alpha=self._land_scale, out=view)
                self._landed[i] = True

    def complete_grads(self) -> None:
        """Zero every range of the gradient buffer no gradient landed in, in one launch."""
        ranges, pos = [], 0
        for e, landed in sorted(zip(self.entries, self._landed), key=lambda x: x[0].start):
            if landed:
                if e.start > pos:
                    ranges.append((pos, e.start))
                pos = max(pos, e.stop)  # TP padding after `stop` is zeroed too
        if pos < self._grads.numel():
            ranges.append((pos, self._grads.numel()))
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

    def zero_unsharded_grads(self) -> list[torch.Tensor]:
        """Allocate and zero the gradient buffer (one launch); returns the per-tensor views."""
        self._alloc(self._grads)
        ops.zero_ranges_(self._grads, [(0, self._grads.numel())])
        self._landed = [True] * len(self.entries)
        self._land_scale = 1.0
        return self.unsharded_grads

    def _replica_dims(self) -> list[int]:
        return [d for d in range(self.mesh.ndim) if d != self.shard_dim and self.mesh.size(d) > 1]

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
        reach: see [Note: unreached parameters].
        """
        self.finish_reduce()
        S = self.shard_size
        if self.grads_allocated:
            self.complete_grads()
        source = self._grads
        if unreached is not None:
            for e, u in zip(self.entries, unreached):
                if u:
                    source[e.start : e.end].fill_(-0.0)
        source = self._rank_major(source)
        replicas = math.prod(self.mesh.size(d) for d in self._replica_dims())
        if divide_factor is not None:
            scale = 1.0 / divide_factor
        else:
            scale = 1.0 / (self.world * replicas) if average else 1.0
        scale /= self._land_scale
        direct = (
            self.world > 1 and scale == 1.0 and self.reduce_dtype == self.dtype
            and self.device == self.compute_device and self._partial is None
            and (all_reduce or not self._replica_dims())
            and not (accumulate and any(self._bound(p) for p in self.params))
        )
        if direct:  # the reduce-scatter writes the sharded gradients
            if self._shard_grad is None:
                self._shard_grad = aligned_empty(S, self.dtype, self.device, pin_memory=self._pin)
            reduced = self._shard_grad
        elif self.world == 1:
            reduced = source
        else:
            reduced = torch.empty(S, dtype=self.reduce_dtype, device=self.compute_device)
        work = None
        if self.world > 1:
            work = dist.reduce_scatter_tensor(
                reduced, source, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )
        self._reduce = (work, source, reduced, direct, accumulate, scale, all_reduce, unreached)
        if not async_op:
            self.finish_reduce()

    def finish_reduce(self, bind: Sequence[bool] | None = None, hook=None) -> list[bool]:
        """Wait for a launched reduce-scatter and write the sharded gradients.

        `bind[i]` says whether tensor i may receive its gradient (default: every tensor); of
        those marked unreached at launch, only the ones some rank reached do
        ([Note: unreached parameters]). The others keep their `.grad` as it was (None stays
        None). Returns, per tensor, whether its gradient was written (all False if no reduction
        was in flight). `hook`, if given, is
        `(fn, stream)`: `fn(reduced)` runs on this rank's reduced shard (after the HSDP
        all-reduce, before any scaling left after landing and the cast; torch's
        `set_all_reduce_hook`: the group then lands gradients unscaled), in `stream`'s context
        if not None.
        """
        if self._reduce is None:
            return [False] * len(self.params)
        work, source, reduced, direct, accumulate, scale, all_reduce, unreached = self._reduce
        self._reduce = None
        if work is not None:
            work.wait()
        del source
        S = self.shard_size
        replica_dims = self._replica_dims()
        if replica_dims and not all_reduce:
            # HSDP micro-batch without the all-reduce (set_requires_all_reduce(False)): keep the
            # reduce-scattered sum aside, as torch does; the next all-reducing micro-batch adds
            # it in before its all-reduce. The sharded gradients are not touched until then.
            if self._partial is None:
                self._partial = reduced[:S].clone()
            else:
                self._partial.add_(reduced[:S])
            self._free(self._grads)
            return [False] * len(self.params)
        if self._partial is not None:
            reduced = reduced[:S] + self._partial
            self._partial = None
        for d in replica_dims:
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=self.mesh.get_group(d))
        if hook is not None:
            fn, stream = hook
            if stream is None:
                fn(reduced)
            else:
                with torch.get_device_module(self.compute_device.type).stream(stream):
                    fn(reduced)
        if reduced.device != self.device:  # offloaded: the optimizer steps on host shards
            reduced = reduced[:S].to(self.device)
        if self._shard_grad is None:
            self._shard_grad = aligned_empty(S, self.dtype, self.device, pin_memory=self._pin)
        bind = [True] * len(self.params) if bind is None else list(bind)
        if unreached is not None:
            bind = [b and (not u or self._reached_elsewhere(e, reduced))
                    for b, u, e in zip(bind, unreached, self.entries)]
        unbound = [
            (p, e) for p, e, b in zip(self.params, self.entries, bind)
            if b and not self._bound(p)
        ]
        if direct:
            pass  # the reduce-scatter wrote them
        elif accumulate and any(self._bound(p) for p in self.params):
            # Some sharded gradients (of any tensor, reached or not) hold earlier sums: add to
            # them; tensors whose .grad was dropped (set to None) start again from zero.
            ops.zero_ranges_(self._shard_grad, [e.local for _, e in unbound])
            ops.accumulate_(self._shard_grad, reduced[:S], scale)
        else:  # no earlier sums (zero_grad() set them to None): one pass writes them all
            ops.cast_scale_(self._shard_grad, reduced[:S], scale)
        if accumulate:
            # A gradient the user assigned (not a view of this buffer) is accumulated into, as
            # torch's FSDP2 adds the reduced gradient to an existing sharded `.grad`.
            for p, e in unbound:
                if p.grad is not None:
                    old = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    if old.numel() != e.local[1] - e.local[0]:
                        raise ValueError(
                            f"{e.name}.grad: expected this rank's {e.local[1] - e.local[0]} "
                            f"elements ({p.placements}), got a tensor of shape "
                            f"{list(old.shape)}"
                        )
                    self._shard_grad[e.local[0] : e.local[1]].add_(old.reshape(-1))
        for p, e in unbound:
            p.grad = self._sharded(e, self._shard_grad, requires_grad=False)
        self._free(self._grads)
        return bind

    @staticmethod
    def _reached_elsewhere(e: _Entry, reduced: torch.Tensor) -> bool:
        """Whether some rank reached tensor `e`, which this rank's backward did not: its first
        local element is not the -0.0 every unreaching rank sent ([Note: unreached parameters]).
        A rank holding no element of it cannot tell, and answers no."""
        b, end = e.local
        if b == end:
            return False
        first = reduced[b]
        return not (first.item() == 0 and torch.signbit(first).item())
