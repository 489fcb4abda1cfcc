"""`FSDPModule`: the methods every module `veragged.fully_shard` was applied to gains, and the
handles they return."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

try:  # torch 2.15: `finalize_backward(async_op=True)`'s handle type (absent on 2.11)
    from torch.distributed.fsdp._fully_shard import GradientReductionHandle as _TorchReductionHandle
except ImportError:
    _TorchReductionHandle = None

from veragged.fsdp import comm_settings
from veragged.fsdp.group import ParamGroup
from veragged.fsdp.state import FSDPState

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle"]


class GradientReductionHandle(*([_TorchReductionHandle] if _TorchReductionHandle else [])):
    """Returned by `FSDPModule.finalize_backward(async_op=True)`; `wait()` waits for the
    gradient reductions and ends the backward iteration."""

    def __init__(self, state):
        self._state = state

    def wait(self) -> None:
        state, self._state = self._state, None
        if state is None:
            return
        if state.ctx.reduction is not self:
            raise RuntimeError("This gradient reduction handle was invalidated")
        state.end_iteration()


class UnshardHandle:
    """Returned by `FSDPModule.unshard(async_op=True)`; `wait()` finishes the all-gather."""

    def __init__(self, groups: list[ParamGroup] | None):
        self._groups = groups

    def wait(self) -> None:
        for g in self._groups or ():
            g.wait_for_unshard()
        self._groups = None


class FSDPModule(TorchFSDPModule):
    """Mixed into every module `fully_shard` was applied to; a torch `FSDPModule` subclass, so
    torch's tooling that checks for FSDP2 modules recognises it."""

    # [FSDP<Orig>, FSDPModule, torch's FSDPModule, Orig, ...]: see torch's FSDPModule.__new__.
    _orig_cls_mro_index = 3
    _veragged_state: FSDPState

    def _get_fsdp_state(self) -> FSDPState:
        return self._veragged_state

    def _states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]
        seen: list[FSDPState] = []
        for m in modules:
            st = getattr(m, "_veragged_state", None)
            if st is not None and st not in seen:
                seen.append(st)
        return seen

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        return [g for st in self._states(recurse) for g in st.groups]

    def quant_stats(self, *, recurse: bool = True) -> list:
        """The `QuantStats` (formats, bytes, all-gathers, quantisations) of every group that
        all-gathers block-scaled weights, this module's and (`recurse`) its submodules'
        ([Note: block-scaled weights]); empty when none does."""
        return [g.buffer.stats for g in self._groups(recurse)
                if getattr(g.buffer, "stats", None) is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        state = self._veragged_state
        outside_forward = state.ctx.iter_forward_root is None
        for g in state.groups:
            if outside_forward:  # an optimizer may have run: [Note: shard epochs]
                g.buffer.new_epoch()
            g.unshard(async_op=True)
        handle = UnshardHandle(list(state.groups))
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        for g in self._veragged_state.groups:
            g.reshard()

    def reset_iter_state(self) -> None:
        self._veragged_state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        self._veragged_state.ctx.is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        for g in self._groups(recurse):
            g.reduce_grads = requires_gradient_sync
            g.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        for g in self._groups(recurse):
            g.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward must be a bool, got {reshard_after_forward!r}"
            )
        for g in self._groups(recurse):
            g.reshard_after_forward = reshard_after_forward
            g.post_forward_group = None  # a bool: the whole world (as torch)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        for g in self._groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._veragged_state.forward_prefetch = [_state_of(m, "modules") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._veragged_state.backward_prefetch = [_state_of(m, "modules") for m in modules]

    def set_post_optim_event(self, event: torch.Event) -> None:
        self._veragged_state.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor!r}")
        for g in self._groups(recurse=True):
            g.gradient_divide_factor = float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many reduce-scatters (each with its gradient buffer) may be in flight at once:
        more overlap of an exposed reduce-scatter for more peak memory. Default 1; the tree
        uses the largest value any of its modules asked for (as torch)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        for state in self._states(recurse):
            comm_settings.check_symm_mem_buffers(state, max_input_buffers)
        for state in self._states(recurse):
            state.max_reduce_scatter_buffers = max_input_buffers
        ctx = self._veragged_state.ctx
        if ctx.all_states:  # already initialised: resolve again
            ctx.resolve_max_reducing()

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: torch.Stream | None = None) -> None:
        """`hook(reduced)` runs on each reduced gradient shard after the reduce-scatter (and
        the HSDP all-reduce), before the division by the world size and the cast; in `stream`
        if given (not with native HSDP, whose all-reduce decides the stream, as torch)."""
        groups = self._veragged_state.groups
        if stream is not None and any(g.buffer.mesh.ndim > 1 for g in groups):
            raise ValueError("stream cannot be set when using native HSDP")
        for g in groups:
            g.all_reduce_hook = (hook, stream)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """veragged always reduces with SUM on the wire and divides after; as torch, this also
        decides whether `set_symm_mem_for_comm` puts the reduce-scatter in symmetric memory."""
        for g in self._veragged_state.groups:
            g.force_sum_reduction_for_comms = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        for g in self._groups(recurse):
            g.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether `finalize_backward()` (not the end of each backward) ends the backward
        iteration: [Note: manual backward finalization]. On the root, before backward."""
        state = self._veragged_state
        ctx = state.ctx
        if state.is_root is False:
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root FSDP module"
            )
        if enabled != ctx.manual_finalization and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        if ctx.manual_active is not None and enabled != ctx.manual_active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts"
            )
        ctx.manual_finalization = bool(enabled)

    @torch.compiler.disable
    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        """Reduce and reshard what the backwards since the last finalization left, then wait
        for the reductions, or with `async_op` return a handle whose `wait()` does."""
        state = self._veragged_state
        if state.is_root is None:  # before the first forward: nothing to finalize
            return GradientReductionHandle(None) if async_op else None
        state.check_finalize()
        if not async_op:
            state.finalize_backward(wait=True)
            return None
        state.finalize_backward(wait=False)
        handle = GradientReductionHandle(state)
        state.ctx.reduction = handle
        return handle

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep each DBuffer's unsharded memory across reshards (its data pointers then stay
        the same, for CUDA graph capture), at the cost of that memory; the next unshard
        all-gathers into it again."""
        for g in self._groups(recurse):
            g.buffer.set_keep_storage(keep)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        for g in self._veragged_state.groups:
            g.unshard_in_backward = unshard_in_backward

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted: veragged's all-gathers are always asynchronous until waited for."""

    # Collectives through comm objects, staged in their buffers: [Note: custom comms].
    def set_custom_all_gather(self, comm) -> None:
        """This module's all-gathers go through `comm` (torch's `AllGather`)."""
        comm_settings.set_custom_comm(self._veragged_state, "all_gather", comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """This module's reduce-scatters go through `comm` (torch's `ReduceScatter`)."""
        comm_settings.set_custom_comm(self._veragged_state, "reduce_scatter", comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Stage this module's collectives in the process group's memory where its backend has
        an allocator (not with a custom comm: AssertionError, as torch)."""
        comm_settings.set_allocate_from_process_group(self._veragged_state, enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Stage this module's all-gathers (and, with `set_force_sum_reduction_for_comms`,
        reduce-scatters) in symmetric memory (CUDA, NCCL)."""
        comm_settings.set_symm_mem(self._veragged_state, backend)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Run the reduce-scatters on a process group of their own over the shard ranks
        (collective over those ranks, as torch); False: back to the shard group."""
        comm_settings.set_separate_reduce_scatter_group(self._states(recurse), enable)

    def _apply(self, fn, recurse: bool = True):
        """`.to()`, `.float()`, `to_empty()`, ...: the DBuffers go through `fn` as a whole,
        the sharded parameters keep their identity (see `DBuffer.apply_`)."""
        state = self._veragged_state
        hidden = []
        for g in state.groups:
            g.finish_reduce()
            g.reshard()
            for places in g.locations:
                for mod, name in places:
                    hidden.append((mod, name, mod._parameters[name]))
                    mod._parameters[name] = None
        try:
            ret = nn.Module._apply(self, fn, recurse)
        finally:
            for mod, name, p in hidden:
                mod._parameters[name] = p
        for g in state.groups:
            g.apply_(fn)
        return ret


def _state_of(module, arg: str) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"{arg}: expected modules that veragged.fully_shard was applied to, got "
            f"{type(module).__name__}"
        )
    return module._veragged_state
