"""Each implementation's own equivalents of the FSDP2 internals that some of torch's tests read.

torch's tests marked `torch_only` in the ports read FSDP2's private state (`FSDPState`,
`FSDPParamGroup`, `FSDPParam`). Their adapted copies
(`test_adapted_*.py`) run the same steps and assertions against both implementations through
these functions, which return torch's private value for the torch variant and veragged's value
of the same meaning (`veragged.fsdp.state.FSDPState`, `veragged.fsdp.group.ParamGroup`) for the
veragged variant. Nothing here changes what either implementation does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from tests.harness.conformance import impl_name

__all__ = [
    "all_states", "group_max_input_buffers", "groups_of", "is_root", "lazy_init",
    "managed_param_fqns", "max_input_buffers", "module_fqn", "modules_to_run_forward",
    "param_fqns", "param_locations", "reduce_dtype", "shard_dim", "state_of",
]


def _torch() -> bool:
    return impl_name() == "torch"


def state_of(module: nn.Module) -> Any:
    """The fully_shard state of `module` (torch: `fully_shard.state(module)`)."""
    if _torch():
        from torch.distributed.fsdp import fully_shard

        return fully_shard.state(module)
    return module._get_fsdp_state()


def lazy_init(module: nn.Module) -> None:
    """Run the lazy initialisation a first forward through `module` would run."""
    if _torch():
        state_of(module)._lazy_init()
    else:
        state_of(module).lazy_init()


def is_root(module: nn.Module) -> Optional[bool]:
    state = state_of(module)
    return state._is_root if _torch() else state.is_root


def all_states(module: nn.Module) -> list:
    """The states of the tree `module`'s state belongs to, in the root's order."""
    state = state_of(module)
    return list(state._state_ctx.all_states if _torch() else state.ctx.all_states)


def groups_of(module: nn.Module) -> list:
    """The parameter groups of `module`'s fully_shard call (torch: FSDPParamGroups; veragged:
    one ParamGroup per DBuffer)."""
    state = state_of(module)
    return list(state._fsdp_param_groups if _torch() else state.groups)


def _names(root: nn.Module) -> dict[int, str]:
    """Module id -> its first fqn under `root` (a module held twice keeps its first name)."""
    names: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
    return names


def module_fqn(root: nn.Module, group: Any) -> str:
    """The fqn (from `root`) of the module(s) whose fully_shard call made `group`, joined by
    ", " for a call on several modules (torch's `FSDPParamGroup._module_fqn`)."""
    if _torch():
        return group._module_fqn
    names = _names(root)
    for state_module in root.modules():
        state = getattr(state_module, "_veragged_state", None)
        if state is not None and any(g is group for g in state.groups):
            return ", ".join(names[id(m)] for m in state.modules)
    raise AssertionError(f"{group!r} belongs to no fully_shard call under the root")


def param_fqns(root: nn.Module, group: Any) -> set[str]:
    """The fqns (from `root`) of `group`'s parameters (torch's `FSDPParam._param_fqn`)."""
    if _torch():
        if all(p._param_fqn is not None for p in group.fsdp_params):  # set at lazy init
            return {p._param_fqn for p in group.fsdp_params}
        names = _names(root)
        return {
            f"{names[id(p._module_info.module)]}.{p._module_info.param_name}".lstrip(".")
            for p in group.fsdp_params
        }
    prefix = module_fqn(root, group)
    state_modules = next(
        s.modules for m in root.modules()
        if (s := getattr(m, "_veragged_state", None)) is not None
        and any(g is group for g in s.groups)
    )
    if len(state_modules) > 1:  # veragged names them "<index>.<fqn>" within the call
        names = _names(root)
        return {
            f"{names[id(state_modules[int(i)])]}.{rest}".lstrip(".")
            for i, _, rest in (f.partition(".") for f in group.fqns)
        }
    return {f"{prefix}.{f}" if prefix else f for f in group.fqns}


def managed_param_fqns(root: nn.Module, module: nn.Module) -> set[str]:
    """The fqns (from `root`) of the parameters `module`'s fully_shard call manages (torch's
    `_get_managed_states` of `_get_managed_modules`, as sharded into its groups)."""
    return set().union(*(param_fqns(root, g) for g in groups_of(module)))


def param_locations(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Per parameter of `module`'s fully_shard call, in the call's order, every (module,
    attribute name) that holds it (torch's `ParamModuleInfo`: the module and name, then the
    shared modules and names; veragged's `ParamGroup.locations`)."""
    if _torch():
        return [
            [(info.module, info.param_name),
             *zip(info.shared_modules, info.shared_param_names)]
            for g in groups_of(module) for info in (p._module_info for p in g.fsdp_params)
        ]
    return [list(places) for g in groups_of(module) for places in g.locations]


def modules_to_run_forward(module: nn.Module) -> set:
    state = state_of(module)
    return set(state._modules_to_run_forward if _torch() else state.modules_to_run)


def max_input_buffers(root: nn.Module) -> int:
    """The reduce-scatter input-buffer cap the tree resolved to (torch: the comm context's)."""
    state = state_of(root)
    return state._comm_ctx.reduce_scatter_max_input_buffers if _torch() else state.ctx.max_reducing


def group_max_input_buffers(module: nn.Module) -> int:
    """The cap set on `module`'s own fully_shard call (torch keeps it per parameter group)."""
    if _torch():
        return groups_of(module)[0].reduce_scatter_max_input_buffers
    return state_of(module).max_reduce_scatter_buffers


def reduce_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The dtype `module`'s fully_shard call reduces gradients in, once lazily initialised
    (torch: `FSDPParamGroup._reduce_dtype`, resolved over the trainable parameters, or over the
    floating-point ones if none is trainable; veragged: the reduce dtype of the DBuffers of those
    same parameters, None unless they agree)."""
    if _torch():
        return groups_of(module)[0]._reduce_dtype
    floating = [g for g in groups_of(module) if g.buffer.dtype.is_floating_point]
    trainable = [g for g in floating if any(p.requires_grad for p in g.sharded)]
    dtypes = {g.buffer.reduce_dtype for g in trainable or floating}
    return dtypes.pop() if len(dtypes) == 1 else None


def shard_dim(placement: Any) -> Optional[int]:
    """The tensor dim a data-parallel placement shards (`Shard(d)`: d). veragged gives
    `shard_placement_fn -> Shard(0)` as a RaggedShard whose rank boundaries fall between rows of
    dim 0: `dims=(0,)` (rows of dim 0), or `dims=()` (the tensor whole on one rank, which cuts
    no row); both are 0 here. A RaggedShard that cuts inside rows (veragged's default,
    element-wise) or any other placement: None."""
    if isinstance(placement, Shard):
        return placement.dim
    dims = getattr(placement, "dims", None)
    if dims is not None and getattr(placement, "local_units", None) is not None:
        return 0 if tuple(dims) in ((), (0,)) else None
    return None
