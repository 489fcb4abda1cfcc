"""The state of one `fully_shard` call and the iteration it moves through.

[Note: fully_shard lifecycle]
Each `fully_shard` call makes one `FSDPState` holding one `ParamGroup` per DBuffer
(`api.py _bucket`).
States and groups move through `TrainingState` (IDLE -> FORWARD -> IDLE -> PRE_BACKWARD ->
POST_BACKWARD -> IDLE), always in the methods below, never elsewhere:
- Lazy init (first forward or `unshard`): the first state to run is the root of its subtree;
  every state below it shares the root's `StateContext` (all states in module order, the
  post-forward order of this iteration, the reduce-scatters in flight). Parameters set on the
  modules since `fully_shard` are taken into the DBuffers first; a configuration error found
  at `fully_shard` (a parameter tied across calls) or parameters still on meta raise here,
  before anything changes, as torch's do. Parameters whose local tensors were given all-gather
  extension hooks since move to extension groups ([Note: all-gather extensions]). With
  `reshard_after_forward=None` the root keeps its parameters after forward, others reshard.
- pre-forward (state FORWARD): all-gather into the DBuffer's unsharded buffer, register the
  unsharded parameters, and wrap the tensor inputs in `RegisterPostBackwardFunction`, whose
  backward runs post-backward once autograd is done with the whole module (so frozen
  parameters the module's backward still needs are never freed early).
- post-forward (state IDLE): reshard if asked (to k ranks with `reshard_after_forward=k`),
  record the group in the post-forward order and hook every output tensor that requires grad
  (found through dataclasses and containers); the first hook to fire is the pre-backward. A
  module of a `fully_shard([a, b])` group whose group forward is incomplete (or that runs on
  its own, as a chunked loss calls the head) hooks its outputs too.
- pre-backward (PRE_BACKWARD): all-gather again if resharded (within the k ranks if they
  kept their part and the parameters did not change since); lay out and allocate the gradient
  buffer for what requires grad now ([Note: compacted gradients]) and prefetch the group that
  ran before it in forward (or the explicit `set_modules_to_backward_prefetch`).
- post-backward (POST_BACKWARD): land the gradients autograd stored on the unsharded
  parameters in the buffer, in one launch ([Note: gradient landing]), the parameters found
  being those this rank's backward reached; then reduce-scatter the *whole* gradient buffer, a collective
  whose shape does not depend on which parameters this rank's data reached, so ranks whose
  data used different parameters (MoE routing, conditional branches) stay in step; which
  parameters some rank reached travels inside it ([Note: unreached parameters]): a parameter
  no rank reached keeps None, as with torch (`set_reduce_scatter_unused_params(True)` gives
  every trainable parameter a gradient instead). Frozen parameters have no gradient view.
  Launching a reduce-scatter finishes the oldest in flight beyond
  `set_reduce_scatter_max_input_buffers` (default 1), bounding the live gradient buffers.
- The root's end-of-backward callback runs post-backward for every group of the tree not in
  POST_BACKWARD, as torch's does (modules whose inputs needed no gradient; modules this
  backward did not reach, whose no-sync gradients it then reduces), waits for every reduction,
  reshards and returns everything to IDLE. It covers every state, used this iteration or not.
  A prefetch no backward used is kept across a non-last backward (as torch keeps it), freed
  after the last one, and gathered again if the parameters changed since.
- Activation checkpointing: a forward that runs while the state is PRE_BACKWARD is a
  recomputation; it only makes sure the parameters are unsharded and changes no state.
Collectives are issued in forward order and reverse forward order of the modules that ran,
which is the same on every rank when the same modules run.

[Note: manual backward finalization]
`set_manual_backward_finalization(True)` on the root (torch 2.15; torch's pipelining stages call
it) moves the end of the backward iteration from autograd's callback to `finalize_backward()`.
The mode is taken when a backward starts (`StateContext.manual_active`) and holds until the
iteration ends. In that mode the callback of every backward acts as for a non-last backward
(reductions in flight stay so, the forward order stays) and leaves the groups that would reduce
(gradient sync on) untouched; `finalize_backward` then runs their post-backward in reverse
module order, which reduces what the backwards accumulated and reshards as the groups' settings
say, and ends the iteration: waits for every reduction and binds the gradients. With
`async_op=True` the end waits for `GradientReductionHandle.wait()`; until then a forward or a
second finalization raises (torch's errors), and `reset_iter_state` invalidates the handle.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.utils import _apply_to_tensors

from veragged.dbuffer.inflight import wait_all
from veragged.fsdp.extensions import adopt_extensions
from veragged.fsdp.group import ParamGroup, TrainingState
from veragged.fsdp.log import log_root, module_name
from veragged.fsdp.state_dict import take_assigned
from veragged.runtime import for_device
from veragged.runtime import trace as tr

__all__ = ["FSDPState", "StateContext"]


def _cast(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(t):
        if t.requires_grad:
            found.append(t)
        return t

    _apply_to_tensors(visit, tree)
    return found


class StateContext:
    """What the states under one root share for an iteration."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []
        self.iter_forward_root: FSDPState | None = None
        self.callback_queued = False
        self.post_forward_order: list[ParamGroup] = []
        self.reducing: list[ParamGroup] = []  # groups whose reduce-scatter is in flight, oldest first
        self.max_reducing = 1  # set_reduce_scatter_max_input_buffers: max over the states
        self.is_last_backward = True  # False: the last reduce-scatter may stay in flight
        self.streams = None  # the tree's runtime ([Note: streams and events]), at lazy init
        # [Note: manual backward finalization]
        self.manual_finalization = False  # set_manual_backward_finalization
        self.manual_active: bool | None = None  # the mode the current backward iteration took
        self.reduction: object | None = None  # a finalize_backward(async_op=True) not waited on

    def resolve_max_reducing(self) -> None:
        """One pipeline of reduce-scatters for the tree: the largest cap any state asked for."""
        self.max_reducing = max(s.max_reduce_scatter_buffers for s in self.all_states)

    def before_reduce(self, group: ParamGroup) -> None:
        """Keep at most `max_reducing` reduce-scatters (each holding its gradient buffer) in
        flight: finish the oldest before launching the next."""
        if group in self.reducing:
            self.reducing.remove(group)
        if len(self.reducing) >= self.max_reducing:
            with tr.trace_label(tr.rs_wait_label, group.fqn):
                while len(self.reducing) >= self.max_reducing:
                    self.reducing.pop(0).finish_reduce()
        self.reducing.append(group)


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Identity on the module's inputs; its backward is the module's post-backward.

    Written in the `setup_context` style with a `jvp` and a generated vmap rule, so functorch
    transforms (`torch.func.jvp`, `vmap`) can run through a sharded module."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: "FSDPState", *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state._post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx, state_tangent, *tangents: torch.Tensor):
        return tangents  # identity; the state has no tangent


class FSDPState:
    """One `fully_shard` call: its modules, its parameter groups and their hooks."""

    def __init__(self, modules: tuple[nn.Module, ...], groups: list[ParamGroup], mp_policy,
                 auto_reshard_after_forward: bool):
        self.modules = modules
        self.groups = groups
        self.mp_policy = mp_policy
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self.ctx = StateContext()
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None  # None: the implicit order
        self.modules_to_run: set[nn.Module] = set()
        self.post_optim_event = None
        self.max_reduce_scatter_buffers = 1  # set_reduce_scatter_max_input_buffers
        self.init_error: Exception | None = None  # a bad configuration, raised at lazy init
        self.fqn = ""  # its modules' names under the root, for traces: [Note: trace ranges]
        for m in modules:
            pre = functools.partial(self._module_pre_forward, m)
            post = functools.partial(self._module_post_forward, m)
            # The hooks gather, free and swap parameters: they run eagerly also when the module
            # is compiled (torch.compile then compiles the forward between them).
            m.register_forward_pre_hook(
                torch.compiler.disable(pre), prepend=True, with_kwargs=True
            )
            m.register_forward_hook(torch.compiler.disable(post))

    # --- lazy init ---------------------------------------------------------------------------

    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"fully_shard needs a single root module, but the first forward ran on a "
                f"group of {len(self.modules)} modules; apply fully_shard to their parent too"
            )
        found: list[tuple[str, FSDPState]] = []
        names: dict[int, list[str]] = {}  # id(state) -> its modules' names, for traces
        for name, module in self.modules[0].named_modules():
            state = getattr(module, "_veragged_state", None)
            if state is not None:
                names.setdefault(id(state), []).append(name)
            if state is None or any(state is s for _, s in found):
                continue
            if state.init_error is not None:
                raise state.init_error
            # Parameters set on the modules since fully_shard (`module.w = nn.Parameter(...)`
            # in an init function) are taken into the DBuffers, as torch's lazy init resets
            # sharded parameters from what the modules hold.
            take_assigned(state)
            if state is not self and state.ctx.manual_finalization:
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root FSDP module"
                )
            if state is not self and state.is_root is not None:
                raise RuntimeError(
                    f"fully_shard state of {name!r} was already initialised: run forward "
                    "through the root module first"
                )
            on_meta = [
                f"{name}.{fqn}" if name else fqn
                for g in state.groups if g.buffer.is_meta for fqn in g.fqns
            ]
            if on_meta:  # torch's wording; nothing was initialised, so a retry starts over
                raise RuntimeError(
                    "FSDP parameters should be materialized from meta device before training, "
                    f"but the following were still on meta device: {on_meta}\n"
                    "For example, call module.to_empty(device) to materialize to device and "
                    "call module.reset_parameters() on each module to initialize values."
                )
            off_cpu = [
                (f"{name}.{fqn}" if name else fqn, g.buffer.device)
                for g in state.groups if g.buffer.offload and g.buffer.device.type != "cpu"
                for fqn in g.fqns
            ]
            if off_cpu:  # torch's wording
                raise RuntimeError(
                    "FSDP parameters should be materialized on CPU when enabling CPU "
                    'offloading. For example, load a CPU state dict or call module.to_empty('
                    'device="cpu"). Found following parameters on non-CPU device: '
                    f"{off_cpu}\n"
                )
            found.append((name, state))
        for _, state in found:  # hooks set on local tensors since: [Note: all-gather extensions]
            adopt_extensions(state)
        for _, state in found:  # torch's labels: [Note: trace ranges]
            state.fqn = ", ".join(names[id(state)])
            for g in state.groups:
                g.buffer.trace_fqn = state.fqn
        ctx = self.ctx
        for _, state in found:
            state.is_root = state is self
            state.ctx = ctx
            ctx.all_states.append(state)
        ctx.resolve_max_reducing()
        # One runtime for the tree: its streams order every group's collectives.
        devices = [g.buffer.compute_device for _, st in found for g in st.groups]
        ctx.streams = for_device(devices[0] if devices else torch.device("cpu"))
        for _, state in found:
            for g in state.groups:
                g.buffer.set_runtime(ctx.streams)
        if self.auto_reshard_after_forward:
            for g in self.groups:
                g.reshard_after_forward = False
        log_root(module_name(self.modules[0]), [st for _, st in found])

    # --- forward -----------------------------------------------------------------------------

    def _module_pre_forward(self, module, _hooked, args, kwargs):
        if len(self.modules) > 1 and not self.modules_to_run:
            self.modules_to_run.update(self.modules)
        return self._pre_forward(module, args, kwargs)

    def _module_post_forward(self, module, _hooked, args, output):
        if len(self.modules) > 1:
            if module in self.modules_to_run:
                self.modules_to_run.discard(module)
                complete = not self.modules_to_run
            else:
                complete = False
            if not complete:
                # The group's forward is not complete (or this module runs on its own, as a
                # chunked loss calls the head): its backward must still bind the gradients.
                if self.training_state != TrainingState.PRE_BACKWARD:
                    self._hook_pre_backward(output)
                return self._cast_output(output)
        return self._post_forward(module, args, output)

    def _pre_forward(self, module: nn.Module, args, kwargs):
        """Pre-forward (also what `register_fsdp_forward_method` calls)."""
        if self.training_state == TrainingState.PRE_BACKWARD:
            # Recomputation under activation checkpointing: parameters only.
            for g in self.groups:
                g.unshard()
            return self._cast_inputs(args, kwargs)
        first = self.training_state != TrainingState.FORWARD
        if first:
            self.lazy_init()
            if self.ctx.reduction is not None:
                raise RuntimeError(
                    "The previous gradient reduction must be waited on before forward"
                )
        self.training_state = TrainingState.FORWARD
        if first:
            if self.ctx.iter_forward_root is None:
                with tr.trace(tr.ROOT_PRE_FORWARD):
                    self.ctx.iter_forward_root = self
                    self._wait_post_optim()
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.groups:
            with tr.trace(tr.PRE_FORWARD, self.fqn):
                for g in self.groups:
                    g.pre_forward()
                if first and torch.is_grad_enabled():
                    args, kwargs = self._register_post_backward(args, kwargs)
        if first:
            for target in self.forward_prefetch:
                for g in target.groups:
                    with tr.trace_label(tr.prefetch_label, "forward", target.fqn):
                        g.unshard(async_op=True)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args, output):
        if self.training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        # A forward inside backward is a recomputation (reentrant activation checkpointing):
        # its parameters stay unsharded for the backward that follows, as with torch.
        in_backward = torch._C._current_graph_task_id() != -1
        self.ctx.streams.hold_from_here()  # this block's releases: [Note: streams and events]
        if self.groups:
            with tr.trace(tr.POST_FORWARD, self.fqn):
                for g in self.groups:
                    g.post_forward(self.ctx.post_forward_order, reshard=not in_backward)
        self._hook_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            self._complete_partial_groups(output)
            self.ctx.iter_forward_root = None
            self.ctx.streams.flush()  # forward's last releases: [Note: streams and events]
        return self._cast_output(output)

    def _complete_partial_groups(self, output) -> None:
        """`fully_shard([a, b])` groups of which forward ran only some modules."""
        for state in reversed(self.ctx.all_states):
            if state is self or not state.modules_to_run:
                continue
            state.modules_to_run.clear()
            if state.groups:
                with tr.trace(tr.POST_FORWARD, state.fqn):
                    for g in state.groups:
                        g.post_forward(self.ctx.post_forward_order)
            state._hook_pre_backward(output)
            state.training_state = TrainingState.IDLE

    def _hook_pre_backward(self, output) -> None:
        """The first gradient to reach any output tensor runs this state's pre-backward."""
        if torch.is_grad_enabled():
            for t in _grad_tensors(output):
                t.register_hook(self._pre_backward)

    def _register_post_backward(self, args, kwargs):
        tensors = _grad_tensors((args, kwargs))
        if not tensors:
            return args, kwargs
        outs = iter(RegisterPostBackwardFunction.apply(self, *tensors))
        ids = {id(t) for t in tensors}

        def swap(t):
            return next(outs) if id(t) in ids else t

        return _apply_to_tensors(swap, args), _apply_to_tensors(swap, kwargs)

    def _cast_inputs(self, args, kwargs):
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        cast = functools.partial(_cast, dtype)
        with tr.trace(tr.CAST_FORWARD_INPUTS):
            return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    def _cast_output(self, output):
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        with tr.trace(tr.CAST_FORWARD_OUTPUTS):
            return _apply_to_tensors(functools.partial(_cast, dtype), output)

    def _wait_post_optim(self) -> None:
        """The iteration's first all-gathers read the shards the optimizer wrote on the
        current stream: order the all-gather stream after the post-optim event if one was
        set, else after everything the current stream queued (torch's rule)."""
        event, self.post_optim_event = self.post_optim_event, None
        if self.is_root:  # unseen writes since the last iteration: [Note: shard epochs]
            for state in self.ctx.all_states:
                for g in state.groups:
                    g.buffer.new_epoch()
        rt = self.ctx.streams
        if rt is None:
            return
        for state in self.ctx.all_states:  # what the user's step may have done meanwhile
            for g in state.groups:
                rt.write(g.buffer.key("shard"))
                rt.read(g.buffer.key("shard_grad"))
        ag = rt.stream("all_gather")
        if event is not None:
            rt.wait(event, ag)
        else:
            rt.wait_stream(ag)

    # --- backward ----------------------------------------------------------------------------

    @torch.compiler.disable
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return grad
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            if ctx.manual_active is None:
                ctx.manual_active = ctx.manual_finalization
            Variable._execution_engine.queue_callback(self._root_post_backward_final_callback)
        # torch's order and nesting: the implicit prefetch inside the pre-backward range, the
        # explicit one (`set_modules_to_backward_prefetch`) after it.
        with tr.trace(tr.PRE_BACKWARD, self.fqn) if self.groups else tr.NO_RANGE:
            for g in self.groups:
                g.pre_backward()
            if self.backward_prefetch is None:
                self._prefetch_in_backward(self._implicit_backward_prefetch())
        if self.backward_prefetch is not None:
            self._prefetch_in_backward(
                [tg for st in self.backward_prefetch for tg in reversed(st.groups)])
        return grad

    def _prefetch_in_backward(self, targets: list[ParamGroup]) -> None:
        for g in targets:
            if g.unshard_in_backward:
                with tr.trace_label(tr.prefetch_label, "backward", g.fqn):
                    g.unshard(async_op=True)

    def _implicit_backward_prefetch(self) -> list[ParamGroup]:
        """The group that ran before this state's in this iteration's forward."""
        order = self.ctx.post_forward_order
        for g in self.groups:
            if g.post_forward_indices:
                i = g.post_forward_indices.pop()
                if i > 0 and order[i - 1] not in self.groups:
                    return [order[i - 1]]
        return []

    @torch.compiler.disable
    def _post_backward(self) -> None:
        for g in self.groups:
            g.post_backward(self.ctx)
        if self.training_state == TrainingState.PRE_BACKWARD:
            self.training_state = TrainingState.POST_BACKWARD

    @torch.compiler.disable
    def _root_post_backward_final_callback(self) -> None:
        with tr.trace(tr.ROOT_POST_BACKWARD_CALLBACK):
            self._end_backward()

    def _end_backward(self) -> None:
        ctx = self.ctx
        ctx.iter_forward_root = None
        manual = bool(ctx.manual_active)
        # Post-backwards autograd never ran (a module whose inputs need no gradient, or one
        # this backward did not reach), in torch's order: all states in pre-order, the root
        # first, each state's groups last first. Under manual finalization a group that would
        # reduce waits for `finalize_backward` instead.
        for state in ctx.all_states:
            state.modules_to_run.clear()
            for g in reversed(state.groups):
                if g.training_state == TrainingState.POST_BACKWARD:
                    continue
                if manual and g.reduce_grads:
                    g.training_state = TrainingState.IDLE
                else:
                    g.post_backward(ctx)
        last = ctx.is_last_backward and not manual
        keep = [] if last else ctx.reducing
        # Every reduction finishes first, leaving its verdict reads and offloaded copies
        # started; one host wait then covers them all, not one per group
        # ([Note: unreached parameters]). (A group with a read already pending is left to
        # `end_backward`: finishing it again would wait for that read first.)
        groups = [g for state in reversed(ctx.all_states) for g in reversed(state.groups)]
        for g in groups:
            if g not in keep and not g.buffer.grads.pending_reads:
                g.finish_reduce()
        reads = [r for g in groups for r in g.buffer.grads.pending_reads]
        if reads:
            wait_all(reads)
        for state in reversed(ctx.all_states):
            for g in reversed(state.groups):
                g.end_backward(ctx, wait=g not in keep, last=last)
            state.training_state = TrainingState.IDLE
        ctx.reducing = keep
        if last:  # as torch: the forward order serves every backward until then
            ctx.post_forward_order.clear()
            ctx.manual_active = None
        ctx.callback_queued = False
        ctx.streams.flush()

    # --- manual backward finalization ---------------------------------------------------------

    def finalize_backward(self, wait: bool) -> None:
        """`FSDPModule.finalize_backward` on the root ([Note: manual backward finalization]):
        reduce what backwards left (following the groups' current gradient-sync settings) and
        reshard, in reverse module order; with `wait`, also end the iteration."""
        with tr.trace(tr.FINALIZE_BACKWARD):
            ctx = self.ctx
            for state in reversed(ctx.all_states):
                for g in reversed(state.groups):
                    g.post_backward(ctx)  # an IDLE group: reduces its pending gradients, reshards
            if wait:
                self.end_iteration()

    def end_iteration(self) -> None:
        """Wait for every reduction, bind the gradients, return everything to IDLE."""
        ctx = self.ctx
        for state in reversed(ctx.all_states):
            for g in reversed(state.groups):
                g.end_backward(ctx, wait=True, last=True)
            state.training_state = TrainingState.IDLE
        ctx.reducing = []
        ctx.post_forward_order.clear()
        ctx.manual_active = None
        ctx.reduction = None
        ctx.streams.flush()

    def check_finalize(self) -> None:
        """torch's checks (and words) before `finalize_backward`."""
        ctx = self.ctx
        if ctx.reduction is not None:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing backward "
                "again"
            )
        if not self.is_root:
            raise RuntimeError("finalize_backward must be called on the root FSDP module")
        manual = ctx.manual_active if ctx.manual_active is not None else ctx.manual_finalization
        if not manual:
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) before forward"
            )
        if ctx.callback_queued:
            raise RuntimeError("FSDP finalize_backward must be called after backward completes")
        for state in ctx.all_states:
            for g in state.groups:
                if g.buffer.grads.has_partial:
                    raise RuntimeError(
                        "FSDP manual backward finalization does not support partial gradient "
                        f"reductions for parameter group {g!r}. Use automatic backward "
                        "finalization for this configuration"
                    )
                if g.reduce_grads and not g.all_reduce_grads and g.buffer.replica_dims():
                    raise RuntimeError(
                        "FSDP manual backward finalization requires all-reduce for parameter "
                        f"group {g!r}. Call set_requires_all_reduce(True) before finalization"
                    )

    def reset_iter_state(self) -> None:
        ctx = self.ctx
        for state in ctx.all_states or [self]:
            state.modules_to_run.clear()
            state.training_state = TrainingState.IDLE
            for g in state.groups:
                g.reset()
        ctx.reducing = []
        ctx.post_forward_order.clear()
        ctx.iter_forward_root = None
        ctx.callback_queued = False
        ctx.manual_active = None
        ctx.reduction = None  # invalidates an outstanding GradientReductionHandle
        if ctx.streams is not None:
            ctx.streams.flush()
