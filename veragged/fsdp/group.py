"""One DBuffer's worth of a `fully_shard` call: parameter swaps, collectives, gradients.

A `fully_shard` call makes one `ParamGroup` per DBuffer it builds (one per mesh, dtype and
requires_grad, and apart for chunked and all-gather-extension parameters: `api.py _bucket`);
its `FSDPState` (`state.py`) drives them through [Note: fully_shard lifecycle].

[Note: backward memory order]
A group's backward holds, at most, what torch's FSDP2 holds at the same point. Pre-backward
unshards and lays the gradient buffer out but allocates nothing for gradients. Post-backward
then goes in torch's order: take the gradients off the unsharded parameters, reshard (the
unsharded parameters go), finish the oldest reduce-scatter if `max_reducing` are in flight
(`StateContext.before_reduce`: its gradient buffer goes), and only then allocate this group's
gradient buffer, land the gradients in it and launch its reduce-scatter. So the root's buffer,
whose post-backward runs last, does not live through the whole backward, and a group's
buffer never sits beside its own unsharded parameters or the buffer of a reduction that had to
finish first. The sharded gradients it writes live as long as the `.grad`s do ([Note: sharded
gradient lifetime], grads.py).
"""

from __future__ import annotations

import enum

import torch
import torch.nn as nn

from veragged.dbuffer.buffer import DBuffer
from veragged.runtime import trace as tr

__all__ = ["ParamGroup", "TrainingState"]


class TrainingState(enum.Enum):
    """Where a state or group is in an iteration (the names and meaning of torch's FSDP2)."""

    IDLE = enum.auto()  # between iterations, or after its forward
    FORWARD = enum.auto()  # between its pre-forward and post-forward
    PRE_BACKWARD = enum.auto()  # its backward may run: unsharded, gradients bound
    POST_BACKWARD = enum.auto()  # its backward ran: gradients reduced (or stashed)


class ParamGroup:
    """The parameters of one DBuffer of a `fully_shard` call (one mesh, dtype and
    requires_grad: `api.py _bucket`)."""

    def __init__(
        self,
        fqns: list[str],
        locations: list[list[tuple[nn.Module, str]]],
        buffer: DBuffer,
        *,
        reshard_after_forward: bool,
        post_forward_group=None,
        views: list | None = None,
    ):
        self.fqns = fqns
        # per parameter, None or how it is presented on the full SPMD mesh (dp_mesh_dims):
        # [Note: data-parallel meshes]
        self.views = views if views is not None else [None] * len(fqns)
        self.locations = locations  # per parameter, every (module, attribute name) holding it
        self.buffer = buffer
        self.training_state = TrainingState.IDLE
        self.reshard_after_forward = reshard_after_forward
        # reshard_after_forward=k: after forward, keep the parameters sharded over this group of
        # k ranks (1/k of them per rank), so backward gathers within it (e.g. within a node).
        self.post_forward_group = post_forward_group
        self.reshard_after_backward = True
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False  # only decides set_symm_mem_for_comm's RS
        self.all_reduce_hook = None  # (fn, stream): set_all_reduce_hook
        self.post_forward_indices: list[int] = []
        self._make_unsharded()
        self._has_grad = [False] * len(self.sharded)
        self._grads_live = False  # the gradient buffer holds this step's (accumulated) grads
        self._bind: list[bool] | None = None  # which tensors the launched reduce may write
        self._registered = self.sharded

    def _make_unsharded(self) -> None:
        self.sharded = self.buffer.params
        self.unsharded = [
            nn.Parameter(v if view is None else view.unsharded(v), requires_grad=p.requires_grad)
            for v, p, view in zip(self.buffer.unsharded_params, self.sharded, self.views)
        ]
        for u in self.unsharded:
            self._set_grad_dtype(u)
        for p in self.sharded:  # autograd never accumulates into them: no ragged hooks, so no
            p.__dict__["_veragged_fsdp"] = True  # weak reference blocks swap_tensors

    def _set_grad_dtype(self, u: nn.Parameter) -> None:
        # As torch 2.15's FSDP2 in a reducing backward (`_set_unsharded_grad_dtypes`, deferred
        # upcast): autograd keeps an unsharded gradient in the dtype the computation produced
        # (grad_dtype None; the default, the parameter's bf16, would round an fp32 one), and its
        # landing casts it to the reduce dtype in the write it makes anyway, so no cast pass of
        # its own. torch 2.11 has no grad_dtype.
        if (hasattr(u, "grad_dtype") and u.dtype.is_floating_point
                and u.dtype != self.buffer.reduce_dtype):
            u.grad_dtype = None

    def _adopt_unsharded(self) -> None:
        """Take the unsharded parameters a buffer made at its first all-gather
        ([Note: all-gather extensions]); the same objects on every later one."""
        for i, u in enumerate(self.buffer.unsharded_params):
            if u is not self.unsharded[i] and not u.is_meta:
                self._set_grad_dtype(u)
                self.unsharded[i] = u

    def _refuse_late_hooks(self) -> None:
        """Hooks on a flat DBuffer parameter's local tensor that lazy init did not take
        ([Note: all-gather extensions]) would be ignored: raise naming the parameter."""
        for fqn, p in zip(self.fqns, self.sharded):
            local = getattr(p, "_local_tensor", None)
            if local is not None and hasattr(local, "fsdp_pre_all_gather"):
                raise RuntimeError(
                    f"parameter {fqn!r}: its local tensor defines fsdp_pre_all_gather, but "
                    "its group was set up without all-gather extensions (taken from the "
                    "tensor at fully_shard, and from the local tensor at the first forward's "
                    "lazy init, as torch's FSDP2 takes them): set the hooks before the first "
                    "forward"
                )

    # --- parameter registration --------------------------------------------------------------

    def _register(self, params: list[nn.Parameter]) -> None:
        for p, places in zip(params, self.locations):
            for mod, name in places:
                mod._parameters[name] = p
        self._registered = params

    @property
    def is_unsharded(self) -> bool:
        return self._registered is self.unsharded

    @property
    def fqn(self) -> str:
        """Its modules' fqn under the root, the suffix of its ranges ([Note: trace ranges])."""
        return self.buffer.trace_fqn

    @property
    def needs_gather(self) -> bool:
        """Whether `unshard` all-gathers: the buffer is free, or holds a prefetch that no
        module registered and the sharded parameters changed since it was gathered (a prefetch
        a non-last backward did not use is kept, as torch keeps it: an optimizer step before
        the next backward must not leave it stale)."""
        buf = self.buffer
        return not buf.is_unsharded or (not self.is_unsharded and not buf.gather_is_current())

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather unless the buffer already holds (or is gathering) the params."""
        if self.needs_gather:
            if not self.buffer.MAKES_UNSHARDED:
                self._refuse_late_hooks()
            with tr.trace(tr.ALL_GATHER, self.fqn):
                # Memory released to the all-gather stream returns first; in forward the block
                # computed last stays (held), so this all-gather does not wait for its compute.
                rt = self.buffer.rt
                rt.reclaim(rt.stream("all_gather"),
                           keep_held=self.training_state == TrainingState.FORWARD)
                self.buffer.unshard(async_op=True)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish the all-gather and register the unsharded parameters in their modules."""
        if not self.buffer.is_unsharded:
            return
        if self.buffer.gathering:
            with tr.trace(tr.ALL_GATHER_COPY_OUT, self.fqn):
                self.buffer.wait_unshard()
        if self.buffer.MAKES_UNSHARDED:
            self._adopt_unsharded()
        self._sync_requires_grad()
        self._register(self.unsharded)
        for u, view in zip(self.unsharded, self.views):
            if view is not None and view.spmd_types:
                view.annotate(u)

    def _sync_requires_grad(self) -> None:
        """`requires_grad_()` after fully_shard reaches whichever parameter was registered:
        the sharded one (between iterations) or the unsharded one (a root kept unsharded after
        forward). The one that changed since the last sync wins; both then agree."""
        last = getattr(self, "_requires_grad", None)
        now = []
        for i, (u, s) in enumerate(zip(self.unsharded, self.sharded)):
            rg = s.requires_grad
            if last is not None and rg == last[i] and u.requires_grad != rg:
                rg = u.requires_grad  # set on the registered unsharded parameter
                with torch._C.DisableTorchFunctionSubclass():  # no ragged accumulation hooks
                    s.requires_grad_(rg)
            if u.requires_grad != rg:
                u.requires_grad_(rg)
            now.append(rg)
        self._requires_grad = now

    def reshard(self, post_forward: bool = False) -> None:
        """Register the sharded parameters again and free the unsharded buffer (after forward
        keeping a 1/k copy if `post_forward_group` is set)."""
        self._register(self.sharded)
        self.buffer.reshard(self.post_forward_group if post_forward else None)

    def apply_(self, fn) -> None:
        """`Module._apply` on this group (see `DBuffer.apply_`)."""
        self.finish_reduce()
        self.reshard()
        self._grads_live = False
        if self.buffer.apply_(fn):
            self._make_unsharded()
        self._register(self.sharded)

    def reset_sharded_param(self, i: int, value: torch.Tensor) -> None:
        """Take `value` (what `load_state_dict(assign=True)` registered for parameter `i`) into
        the DBuffer, materialising a DBuffer on the meta device on the mesh's device first
        (zeros); see [Note: fully_shard state dicts]."""
        if self.buffer.is_meta:
            device = self.buffer.home_device
            self.apply_(lambda t: torch.zeros_like(t, device=device))
        p = self.sharded[i]
        if value is p:  # swapped in place by a submodule's `_apply`: [Note: submodule _apply]
            if value.dtype != self.buffer.dtype or value.device != self.buffer.device:
                raise NotImplementedError(
                    f"{self.fqns[i]!r} was moved to {value.dtype} on {value.device} by `.to()` "
                    f"or a cast of a submodule, but its fully_shard group holds "
                    f"{self.buffer.dtype} on {self.buffer.device}: cast or move the module "
                    "fully_shard was applied to (or do it before fully_shard)"
                )
            fresh = self.buffer.new_sharded_param(i)
            with torch.no_grad():  # same placements: this rank's elements, no communication
                fresh._local_tensor.view(-1).copy_(p._local_tensor.reshape(-1))
            with torch._C.DisableTorchFunctionSubclass():
                fresh.requires_grad_(p.requires_grad)
            torch.utils.swap_tensors(p, fresh)
            p.__dict__["_veragged_fsdp"] = True
        else:
            self.buffer.load_(i, value)
        with torch._C.DisableTorchFunctionSubclass():  # no ragged accumulation hooks
            self.sharded[i].requires_grad_(value.requires_grad)

    # --- forward -----------------------------------------------------------------------------

    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.unshard()

    def _computed(self) -> None:
        """The module's compute, queued on the current stream, read the unsharded buffer."""
        if self.buffer.is_unsharded:
            self.buffer.rt.read(self.buffer.key("unsharded"))

    def post_forward(self, order: list["ParamGroup"], reshard: bool = True) -> None:
        self._computed()
        if reshard:
            if self.reshard_after_forward:
                self.reshard(post_forward=True)
            self.post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE

    # --- backward ----------------------------------------------------------------------------

    def pre_backward(self) -> None:
        """Unshard and lay the gradient buffer out for what requires grad now: the
        post-backward lands the gradients autograd stored on the unsharded parameters in it
        ([Note: gradient landing]); which ones it found is which parameters this rank's
        backward reached. The buffer itself is allocated at the post-backward, as torch's
        reduce-scatter input is ([Note: backward memory order])."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
        if not any(p.requires_grad for p in self.sharded):
            return
        self._prepare_grads()

    def _prepare_grads(self) -> None:
        """Lay the gradient buffer out for what requires grad now and mark this group's
        gradients live (reduced at its post-backward, or kept without gradient sync); gradients
        kept from no-sync backwards stay."""
        # A module run more than once in forward has one backward per run: the reduce-scatter
        # of an earlier one still reads the gradient buffer this one is about to fill.
        self.finish_reduce()
        # Gradient room for what requires grad now ([Note: compacted gradients]); verdict flags
        # unless every trainable parameter gets a gradient ([Note: unreached parameters]).
        room = [s.requires_grad or u.requires_grad for s, u in zip(self.sharded, self.unsharded)]
        grads = self.buffer.grads
        if self._grads_live and grads.allocated:  # keep what accumulated (no-sync)
            room = [a or b for a, b in zip(room, grads.mask)]
        grads.set_layout(room, flags=not self.reduce_scatter_unused_params)
        self._grads_live = True

    def _alloc_grads(self) -> None:
        """Allocate the gradient buffer unless it holds gradients (no-sync): scaled as they
        land when that is exact, unless an all-reduce hook must see sums."""
        grads = self.buffer.grads
        if not grads.allocated:
            grads.alloc(grads.landing_scale(self.gradient_divide_factor,
                                            allowed=self.all_reduce_hook is None))

    def _take_grads(self) -> list[tuple[int, torch.Tensor]]:
        """The gradients autograd stored on the unsharded parameters (made local to this
        rank's TP shard), taken off them; notes which parameters they reached."""
        found = []
        for i, u in enumerate(self.unsharded):
            g = u.grad
            if g is None:
                continue
            u.grad = None
            view = self.views[i]
            found.append((i, g if view is None else view.local_grad(g)))
            self._has_grad[i] = True
        return found

    def post_backward(self, ctx) -> None:
        """Reduce this backward's gradients (or keep them, without gradient sync) and reshard.

        Idempotent within a pass: a second call without a pre-backward in between does nothing.
        As torch's, it also runs (from the end-of-backward callback) for a group this backward
        never reached: gradients an earlier no-sync backward left are then reduced, and
        parameters unsharded since forward are resharded. The reduce-scatter always covers the
        whole buffer, so it is the same collective on every rank whatever each rank's data
        reached ([Note: fully_shard lifecycle]). The order is torch's, so the gradient buffer
        never lives beside this group's unsharded parameters or the buffer of the reduction
        before the last one allowed in flight ([Note: backward memory order]).
        """
        state = self.training_state
        if state == TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        self._computed()
        found = self._take_grads()
        with tr.trace(tr.POST_BACKWARD_RESHARD, self.fqn):
            if self.reshard_after_backward and self.is_unsharded:  # a prefetch stays in flight
                self.reshard()
        if found and not self._grads_live:
            self._prepare_grads()  # a group whose pre-backward did not run (torch reduces it)
        if self._grads_live and self.reduce_grads:
            ctx.before_reduce(self)  # FSDP::post_backward_rs_wait when it finishes one
            with tr.trace(tr.POST_BACKWARD_REDUCE, self.fqn):  # torch's copy-in is inside too
                self._land(found)
                self._launch_reduce()
        else:  # no-sync: they stay in the buffer and add up
            self._land(found)

    def _land(self, found: list[tuple[int, torch.Tensor]]) -> None:
        """Land `found` in the gradient buffer, allocated now if it holds none yet
        ([Note: gradient landing])."""
        if found:
            self._alloc_grads()
            self.buffer.grads.land(found)

    def _launch_reduce(self) -> None:
        self._alloc_grads()  # no gradient landed on this rank: zeros (and verdicts) all the same
        trainable = [p.requires_grad and m for p, m in zip(self.sharded, self.buffer.grads.mask)]
        if self.reduce_scatter_unused_params:  # every trainable parameter gets a gradient
            unreached = None
        else:  # those no rank reached keep None: [Note: unreached parameters]
            unreached = [t and not h for h, t in zip(self._has_grad, trainable)]
        self.buffer.grads.reduce(
            accumulate=True,
            divide_factor=self.gradient_divide_factor,
            all_reduce=self.all_reduce_grads,
            unreached=unreached,
            async_op=True,
        )
        self._bind = trainable  # frozen parameters never get a gradient
        self._has_grad = [False] * len(self.sharded)
        self._grads_live = False

    def finish_reduce(self) -> None:
        """Wait for this group's reduce-scatter (if any) and write the sharded gradients.

        Inside backward (after this group's post-backward) the gradients of parameters this
        rank did not reach wait for their verdict until `resolve_grads` (end of backward), so
        reading it does not stall the host here ([Note: unreached parameters])."""
        bind, self._bind = self._bind, None
        defer = self.training_state == TrainingState.POST_BACKWARD
        written = self.buffer.grads.finish_reduce(bind=bind, hook=self.all_reduce_hook,
                                                  defer=defer)
        self._run_grad_hooks(written)

    def resolve_grads(self) -> None:
        """Bind the gradients whose verdict `finish_reduce` left pending."""
        self._run_grad_hooks(self.buffer.grads.resolve())

    def _run_grad_hooks(self, written: list[bool]) -> None:
        # Hooks registered on the sharded parameters run once their gradient is written (as
        # torch's, e.g. an optimizer step in backward): autograd never accumulates into them.
        for p, w in zip(self.sharded, written):
            if w and p.grad is not None:
                for fn in tuple((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                    fn(p)

    def end_backward(self, ctx, wait: bool = True, last: bool = True) -> None:
        """End of a backward (`last`: of the backward iteration): wait for this group's
        reduction (if `wait`), bind the gradients waiting for a verdict, reshard."""
        if wait:
            self.finish_reduce()
        self.resolve_grads()
        if self.reshard_after_backward and self.is_unsharded and self.reduce_grads:
            self.reshard()
        elif not self.is_unsharded and self.buffer.is_unsharded and last:
            # A prefetch no backward used: freed after the last backward (torch keeps it to
            # the next unshard); kept across gradient accumulation, where the next backward
            # uses it unless the parameters changed since (`needs_gather`).
            self.buffer.reshard()
        if last:  # a later backward of this forward may still prefetch by them
            self.post_forward_indices.clear()
            self.buffer.grads.record_verdicts()  # [Note: grad verdicts for optimizers]
        self.training_state = TrainingState.IDLE

    def reset(self) -> None:
        """Drop everything in flight (`reset_iter_state` after an exception)."""
        self.buffer.wait_unshard()
        self._bind = None
        self.buffer.grads.cancel()
        self._grads_live = False
        self._has_grad = [False] * len(self.sharded)
        for u in self.unsharded:
            u.grad = None
        self.post_forward_indices.clear()
        self.training_state = TrainingState.IDLE
        self.reshard()

    def __repr__(self) -> str:
        return f"ParamGroup({', '.join(self.fqns)})"

