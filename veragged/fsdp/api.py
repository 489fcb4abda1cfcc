"""`veragged.fully_shard`: FSDP2's API on RaggedShard parameters and DBuffers."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from veragged.dbuffer.buffer import DBuffer
from veragged.fsdp.group import ParamGroup, RootState

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]


class UnshardHandle:
    """Returned by `FSDPModule.unshard(async_op=True)`; `wait()` finishes the all-gather."""

    def __init__(self, group: ParamGroup):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into every module `fully_shard` was applied to (as FSDP2 does)."""

    _veragged_group: ParamGroup | None  # None: every parameter belongs to an inner fully_shard
    _veragged_root: RootState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        group = self._veragged_group
        if group is None:
            return UnshardHandle(None) if async_op else None
        group.unshard(async_op=async_op)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        if self._veragged_group is not None:
            self._veragged_group.reshard()

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        modules = self.modules() if recurse else [self]
        groups = [m._veragged_group for m in modules if isinstance(m, FSDPModule)]
        return [g for g in groups if g is not None]

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        for g in self._groups(recurse):
            g.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for g in self._groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        for g in self._groups(recurse):
            g.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._veragged_root.forward_prefetch[self._veragged_group] = [_group_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._veragged_root.backward_prefetch[self._veragged_group] = [
            _group_of(m) for m in modules
        ]


def _group_of(module) -> ParamGroup:
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"expected a module that fully_shard was applied to, got {type(module).__name__}"
        )
    if module._veragged_group is None:
        raise ValueError(f"{type(module).__name__} has no parameters of its own to prefetch")
    return module._veragged_group


def _collect(module: nn.Module, ignored: set[int]):
    """Parameters of `module` not managed by an inner fully_shard: [(fqn, param, locations)]."""
    found: dict[int, tuple[str, nn.Parameter, list]] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            entry = found.setdefault(id(p), (prefix + name, p, []))
            entry[2].append((mod, name))
        for name, child in mod._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return list(found.values())


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError("fully_shard needs torch.distributed to be initialized (or a mesh=)")
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    granularity_fn: Callable[[str, nn.Parameter], int | None] | None = None,
) -> nn.Module:
    """Shard `module`'s parameters (those no inner `fully_shard` took) into one DBuffer.

    Same meaning of every argument as `torch.distributed.fsdp.fully_shard`; apply it to the
    blocks first and the root last. `mesh` is 1-D (FSDP) or 2-D `(replicate, shard)` (HSDP).
    `granularity_fn(fqn, param)` gives the block size in elements that no rank boundary may cut
    (None: element-wise); the planner keeps those blocks whole, and the sharded parameters are
    RaggedShard DTensors, views into the group's DBuffer. See [Note: fully_shard lifecycle].
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"offload_policy={offload_policy!r}: CPU offload is not supported yet"
        )
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim} dims"
        )
    ignored = {id(p) for p in ignored_params or ()}
    params = _collect(module, ignored)
    children = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    groups = [c._veragged_group for c in children if c._veragged_group is not None]
    group = None
    if params:
        blocks = []
        for fqn, p, _ in params:
            block = granularity_fn(fqn, p) if granularity_fn is not None else None
            block = 1 if block is None else block
            if not isinstance(block, int) or block < 1 or p.numel() % block:
                raise ValueError(
                    f"granularity_fn({fqn!r}) = {block!r} must be a positive int dividing "
                    f"numel {p.numel()}"
                )
            blocks.append(block)
        buffer = DBuffer(
            [(fqn, p.detach()) for fqn, p, _ in params],
            mesh,
            shard_dim=-1,
            block_sizes=blocks,
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
        )
        for sharded, (_, p, _) in zip(buffer.params, params):
            sharded.requires_grad_(p.requires_grad)
        group = ParamGroup(
            module,
            [loc for *_, loc in params],
            buffer,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
        )
        group.reshard()
        groups.append(group)
        # The hooks gather, free and swap parameters: they run eagerly, also when the module is
        # compiled (torch.compile then compiles the forward between them).
        module.register_forward_pre_hook(
            torch.compiler.disable(group.pre_forward), with_kwargs=True
        )
        module.register_forward_hook(torch.compiler.disable(group.post_forward))
    root = RootState(groups)
    for m in [module, *children]:
        m._veragged_root = root
    module._veragged_group = group
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return module
