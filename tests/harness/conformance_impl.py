"""Which implementation a conformance test runs on, and the stand-ins for what torch's tests
take from FSDP2 by name: `fully_shard`, `RegisterPostBackwardFunction` and its patch, and
`FSDPParamGroup` with `patch_unshard` / `patch_reshard` / `patch_post_backward`. Each resolves, at
the time of use, to torch's or veragged's object of the same role, per `impl_name()`, which
`tests/harness/conformance.py` sets around each test (`STATE`) and re-exports from here."""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.testing._internal import common_fsdp


class _State:
    """The test running in this (rank) process."""

    def __init__(self) -> None:
        self.impl = "torch"  # the implementation under test; set by conformance._run_test
        self.in_rank = False  # True while a rank runs a shipped test body
        self.sharded: list = []  # the modules the running test gave veragged.fully_shard


STATE = _State()


def impl_name() -> str:
    """The implementation under test in this process: "torch" or "veragged"."""
    return STATE.impl


def _impl_fully_shard() -> Callable[..., Any]:
    if STATE.impl == "torch":
        from torch.distributed.fsdp import fully_shard as impl
    else:
        from veragged import fully_shard as impl
    return impl


class _FullyShard:
    """`torch.distributed.fsdp.fully_shard` or `veragged.fully_shard`, per `impl_name()`.

    Compares equal to both (torch's tests use `fully_shard != torch.distributed.fsdp.fully_shard`
    to tell the eager function from `compiled_fsdp_test`'s compiling wrapper)."""

    __name__ = __qualname__ = "fully_shard"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = _impl_fully_shard()(*args, **kwargs)
        if STATE.impl == "veragged" and STATE.in_rank:  # for `_GroupView._module_fqn`
            module = args[0] if args else kwargs["module"]
            STATE.sharded.extend(module if isinstance(module, (list, tuple)) else [module])
        return out

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        from torch.distributed.fsdp import fully_shard as torch_impl

        from veragged import fully_shard as veragged_impl
        return other is torch_impl or other is veragged_impl

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<conformance fully_shard -> {STATE.impl}>"

    def state(self, module: Any) -> Any:
        """`fully_shard.state(module)` of the implementation under test (torch's composable
        API gives the function this attribute; an implementation without it raises the
        AttributeError a user's call would)."""
        return _impl_fully_shard().state(module)


fully_shard = _FullyShard()


class _ImplClass:
    """A private class of FSDP2 that torch's tests patch, standing for the implementation's own
    class of the same role: attribute reads and writes go to torch's class or veragged's,
    per `impl_name()` at the time of the access."""

    def __init__(self, torch_path: str, veragged_path: str):
        object.__setattr__(self, "_paths", {"torch": torch_path, "veragged": veragged_path})

    def resolve(self) -> type:
        module_name, _, cls_name = self._paths[STATE.impl].rpartition(".")
        return getattr(importlib.import_module(module_name), cls_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.resolve(), name, value)

    def __repr__(self) -> str:
        return f"<conformance {self._paths[STATE.impl]}>"


# FSDP2's autograd function whose backward runs the post-backward of a module's parameters;
# veragged's has the same role and signature (`backward(ctx, *grads)`).
RegisterPostBackwardFunction = _ImplClass(
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction",
    "veragged.fsdp.state.RegisterPostBackwardFunction",
)


@contextlib.contextmanager
def patch_register_post_backward_hook_backward(new_backward: Callable):
    """torch's `common_fsdp.patch_register_post_backward_hook_backward`, on the class of the
    implementation under test (see `RegisterPostBackwardFunction`)."""
    cls = RegisterPostBackwardFunction.resolve()
    orig_backward = cls.backward
    dist.barrier()
    cls.backward = new_backward
    try:
        yield
    finally:
        dist.barrier()
        cls.backward = orig_backward


class _GroupView:
    """A veragged `ParamGroup` under the private names of torch's `FSDPParamGroup` that torch's
    tests record events with (test_fully_shard_comm.py's `_get_unshard_with_record` etc.); any
    other attribute is the group's own.

    `_module_fqn`: the fqn, from the root, of the module(s) of the group's fully_shard call,
    ", "-joined (None before lazy init, as torch's). `_training_state`: torch's member of the
    same name. `_all_gather_result` / `_sharded_state`: None / SHARDED exactly when `unshard`
    would all-gather (`ParamGroup.needs_gather`), else a marker / UNSHARDED, so torch's
    "skip no-ops" test reads veragged's. `_reshard_after_forward`: the group's.

    In an `unshard` call only: veragged starts a prefetch's all-gather without changing the
    target group's state, where torch sets it to the phase prefetched for (FORWARD,
    PRE_BACKWARD) around the call; a group in neither its own forward nor its own backward
    (IDLE, or POST_BACKWARD after an earlier backward of a module run twice) reads as the phase
    the call runs in: PRE_BACKWARD inside autograd's backward, FORWARD outside it.
    """

    def __init__(self, group: Any, method: str):
        self._group, self._method = group, method

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    @property
    def _module_fqn(self) -> Optional[str]:
        states = [m._get_fsdp_state() for m in STATE.sharded]
        owners = [s for s in states if any(g is self._group for g in s.groups)]
        if not owners:
            raise AssertionError(f"{self._group!r} comes from no fully_shard call of this test")
        state = owners[0]
        roots = [s for s in state.ctx.all_states if s.is_root]
        if not roots:
            return None
        names: dict[int, str] = {}
        for name, m in roots[0].modules[0].named_modules(remove_duplicate=False):
            names.setdefault(id(m), name)
        return ", ".join(names[id(m)] for m in state.modules)

    @property
    def _training_state(self) -> Any:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        name = self._group.training_state.name
        if self._method == "unshard" and name in ("IDLE", "POST_BACKWARD"):
            name = "PRE_BACKWARD" if torch._C._current_graph_task_id() != -1 else "FORWARD"
        return TrainingState[name]

    @property
    def _all_gather_result(self) -> Any:
        return None if self._group.needs_gather else "in flight or done"

    @property
    def _sharded_state(self) -> Any:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        return ShardedState.SHARDED if self._group.needs_gather else ShardedState.UNSHARDED

    @property
    def _reshard_after_forward(self) -> bool:
        return self._group.reshard_after_forward


class _FSDPParamGroupClass:
    """torch's `FSDPParamGroup` for the torch class. For the veragged class, `ParamGroup`
    with each method (looked up when read, as a port reads `FSDPParamGroup.unshard` before
    patching it) taking a `_GroupView`, which the `patch_*` functions below hand the port's
    recording function in place of the group."""

    def __getattr__(self, name: str) -> Any:
        if STATE.impl == "torch":
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            return getattr(FSDPParamGroup, name)
        from veragged.fsdp.group import ParamGroup

        method = getattr(ParamGroup, name)
        if not callable(method):
            return method

        @functools.wraps(method)
        def on_group(view: _GroupView, *args: Any, **kwargs: Any) -> Any:
            return method(view._group, *args, **kwargs)

        return on_group

    def __repr__(self) -> str:
        return f"<conformance FSDPParamGroup -> {STATE.impl}>"


FSDPParamGroup = _FSDPParamGroupClass()


@contextlib.contextmanager
def _patch_group_method(name: str, new: Callable):
    """torch's `common_fsdp.patch_<name>` for the torch class; for veragged, `ParamGroup.<name>`
    calls `new(_GroupView(group, name), ...)`, except a `reshard` of a group that holds nothing
    unsharded (veragged calls it on every group at lazy init; it frees nothing, and torch makes
    no such call), which runs unrecorded."""
    if STATE.impl == "torch":
        with getattr(common_fsdp, f"patch_{name}")(new):
            yield
        return
    from veragged.fsdp.group import ParamGroup

    orig = getattr(ParamGroup, name)

    def patched(group: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "reshard" and not group.is_unsharded and not group.buffer.is_unsharded:
            return orig(group, *args, **kwargs)
        return new(_GroupView(group, name), *args, **kwargs)

    dist.barrier()
    setattr(ParamGroup, name, patched)
    try:
        yield
    finally:
        dist.barrier()
        setattr(ParamGroup, name, orig)


def patch_unshard(new_unshard: Callable):
    """torch's `common_fsdp.patch_unshard` on the implementation's group class."""
    return _patch_group_method("unshard", new_unshard)


def patch_reshard(new_reshard: Callable):
    """torch's `common_fsdp.patch_reshard` on the implementation's group class."""
    return _patch_group_method("reshard", new_reshard)


def patch_post_backward(new_post_backward: Callable):
    """torch's `common_fsdp.patch_post_backward` on the implementation's group class."""
    return _patch_group_method("post_backward", new_post_backward)
