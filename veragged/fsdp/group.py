"""One `fully_shard` call's state: its DBuffer, the parameter swap and the forward/backward hooks.

[Note: fully_shard lifecycle]
Between iterations a sharded module holds its sharded parameters (RaggedShard DTensors, views
into the DBuffer's shard), which is what `parameters()`, optimizers and `state_dict()` see.
- pre-forward: all-gather into the unsharded buffer (or wait for a prefetch), register the
  unsharded parameters (plain `nn.Parameter` views into that buffer, made once) in their modules.
- post-forward: with `reshard_after_forward`, register the sharded parameters again and free
  the unsharded buffer's storage; autograd keeps the unsharded views, whose storage the
  pre-backward all-gather restores before any of the module's backward runs. A grad hook on the
  outputs is the pre-backward hook.
- pre-backward: unshard if needed; allocate and zero the gradient buffer and make its views the
  unsharded parameters' `.grad`, so the autograd engine accumulates into place.
- post-backward: once every unsharded parameter with a gradient has accumulated (or at the end
  of backward, from the root's final callback, for parameters the step did not use), launch the
  reduce-scatter of the gradient buffer; backward of the earlier groups runs while it is on the
  wire. Launching one finishes the one before (writes its sharded `.grad` views, frees its
  gradient buffer), so at most two gradient buffers are live; the root's final callback
  finishes the last.
- backward prefetch: once a group's backward has its parameters, the all-gather of the group
  backward needs next (the one before it in forward order, or those set with
  `set_modules_to_backward_prefetch`) is launched without waiting.
Collectives are issued in forward/backward order, which is the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from veragged.dbuffer.buffer import DBuffer

__all__ = ["ParamGroup"]


def _cast_floats(tree, dtype: torch.dtype):
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return tree_map(cast, tree)


class ParamGroup:
    """The parameters one `fully_shard` call manages, in one DBuffer."""

    def __init__(
        self,
        module: nn.Module,
        locations: list[list[tuple[nn.Module, str]]],
        buffer: DBuffer,
        *,
        reshard_after_forward: bool,
        mp_policy,
    ):
        self.module = module
        self.locations = locations  # per parameter, every (module, attribute name) holding it
        self.buffer = buffer
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.mp_policy = mp_policy
        self.sharded = buffer.params
        self.unsharded = [
            nn.Parameter(v, requires_grad=p.requires_grad)
            for v, p in zip(buffer.unsharded_params, self.sharded)
        ]
        self.root: "RootState | None" = None
        self._pending = 0  # unsharded parameters still to receive their gradient this backward
        self._in_backward = False
        self._grads_ready = False  # the gradient buffer holds (accumulated) gradients
        for p in self.unsharded:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._post_accumulate)

    # --- parameter registration --------------------------------------------------------------

    def _register(self, params: list[nn.Parameter]) -> None:
        for p, places in zip(params, self.locations):
            for mod, name in places:
                mod._parameters[name] = p

    def unshard(self, async_op: bool = False):
        if not self.buffer.is_unsharded:
            return self.buffer.unshard(async_op=async_op)
        return None

    def wait_for_unshard(self) -> None:
        self.buffer.wait_unshard()
        self._register(self.unsharded)

    def reshard(self) -> None:
        self._register(self.sharded)
        self.buffer.reshard()

    # --- forward -----------------------------------------------------------------------------

    def pre_forward(self, module, args, kwargs):
        if self.root is not None:
            self.root.pre_forward(self)
        self.unshard()
        self.wait_for_unshard()
        if self.root is not None:
            self.root.prefetch_after(self)
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        return args, kwargs

    def post_forward(self, module, args, output):
        if self.reshard_after_forward:
            self.reshard()
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward, mode="any"
                )
        policy = self.mp_policy
        if policy.output_dtype is not None:
            output = tree_map(
                lambda t: (
                    t.to(policy.output_dtype)
                    if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t
                ),
                output,
            )
        return output

    # --- backward ----------------------------------------------------------------------------

    def _pre_backward(self, *unused: Any) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        if self.root is not None:
            self.root.pre_backward(self)
        self.unshard()
        self.wait_for_unshard()
        if self.root is not None:
            self.root.prefetch_before(self)
        if not self._grads_ready:
            grads = self.buffer.zero_unsharded_grads()
            for p, g in zip(self.unsharded, grads):
                if p.requires_grad:
                    p.grad = g
            self._grads_ready = True
        self._pending = sum(1 for p in self.unsharded if p.requires_grad)

    def _post_accumulate(self, param: torch.Tensor) -> None:
        self._pending -= 1
        if self._pending == 0:
            self.post_backward()

    def post_backward(self) -> None:
        """Reduce the gradients (unless gradient sync is off) and reshard; once per backward."""
        if not self._in_backward:
            return
        self._in_backward = False
        if self.requires_grad_sync:
            self.buffer.reduce_grads(accumulate=True, async_op=True)
            if self.root is not None:
                self.root.reduce_launched(self)
            for p in self.unsharded:
                p.grad = None
            self._grads_ready = False
        if self.reshard_after_backward:
            self.reshard()


class RootState:
    """Per root module: forward order, prefetching and the end-of-backward callback."""

    def __init__(self, groups: list[ParamGroup]):
        self.groups = groups
        for g in groups:
            g.root = self
        self.forward_order: list[ParamGroup] = []
        self._recording = True
        self._callback_queued = False
        self._reducing: ParamGroup | None = None  # the group whose reduce-scatter is in flight
        self.forward_prefetch: dict[ParamGroup, list[ParamGroup]] = {}
        self.backward_prefetch: dict[ParamGroup, list[ParamGroup]] = {}

    def pre_forward(self, group: ParamGroup) -> None:
        if self._recording and group not in self.forward_order:
            self.forward_order.append(group)

    def prefetch_after(self, group: ParamGroup) -> None:
        """Start the next all-gathers while `group` computes: the modules set with
        `set_modules_to_forward_prefetch`, else the next group in the recorded forward order."""
        targets = self.forward_prefetch.get(group)
        if targets is None and not self._recording:
            order = self.forward_order
            i = order.index(group) if group in order else -1
            targets = order[i + 1 : i + 2] if i >= 0 else []
        for nxt in targets or ():
            nxt.unshard(async_op=True)

    def prefetch_before(self, group: ParamGroup) -> None:
        """Start the all-gathers backward needs next while `group`'s backward computes: the
        modules set with `set_modules_to_backward_prefetch`, else the group before it in the
        forward order."""
        targets = self.backward_prefetch.get(group)
        if targets is None:
            order = self.forward_order
            i = order.index(group) if group in order else -1
            targets = order[i - 1 : i] if i > 0 else []
        for nxt in targets:
            nxt.unshard(async_op=True)

    def pre_backward(self, group: ParamGroup) -> None:
        self._recording = False
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)


    def reduce_launched(self, group: ParamGroup) -> None:
        """Keep one reduce-scatter in flight: finish the previous one (freeing its gradient
        buffer) now that the next is on the wire, so at most two gradient buffers are live."""
        if self._reducing is not None and self._reducing is not group:
            self._reducing.buffer.finish_reduce()
        self._reducing = group

    def _finish_backward(self) -> None:
        self._callback_queued = False
        order = list(reversed(self.forward_order or self.groups))
        for g in order:
            g.post_backward()
        for g in order:  # the last reduce-scatter in flight (and any launched out of band)
            g.buffer.finish_reduce()
        self._reducing = None
        for g in self.groups:
            if g.reshard_after_backward and g.buffer.is_unsharded:
                g.reshard()
