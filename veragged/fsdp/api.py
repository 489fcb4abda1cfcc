"""`veragged.fully_shard`: FSDP2's API and behaviour on RaggedShard parameters and DBuffers."""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam as _TorchFSDPParam
from torch.distributed.tensor import DTensor, Shard

from veragged.dbuffer.buffer import DBuffer
from veragged.dbuffer.chunked import ChunkedDBuffer
from veragged.dbuffer.extension import EXTENSION_ATTRS, ExtensionDBuffer, has_extension
from veragged.dbuffer.quantized import QuantDBuffer
from veragged.dbuffer.replicated import ReplicatedDBuffer
from veragged.dbuffer.tp_param import TPParam, tp_block_size, tp_param
from veragged.fsdp import log, state_dict
from veragged.fsdp.dp_mesh import DpMesh, resolve_mesh, resolve_placement, split_param
from veragged.fsdp.group import ParamGroup
from veragged.fsdp.module import FSDPModule, UnshardHandle
from veragged.fsdp.state import FSDPState
from veragged.placement.collectives import alive
from veragged.placement.tensor import RaggedDTensor
from veragged.runtime import caches

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]

# Original parameters some fully_shard call took: a second call meeting one (a parameter tied
# across two calls) raises instead of silently untying it.
_MANAGED: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
_CLASS_CACHE: dict[type, type] = {}  # one FSDP class per original class (torch.compile guards)


# An unset `MixedPrecisionPolicy.reduce_dtype`: torch 2.15's FSDP2 computes, reduces and keeps
# gradients in the parameter's own dtype (its `FSDPParam.unsharded_grad_dtype` falls back to
# `orig_dtype`); torch 2.11's FSDP2, which has no such property, reduces in `param_dtype`. Ours
# follows the torch it runs with (the property is read, never called).
_UNSET_REDUCE_DTYPE_IS_ORIG = hasattr(_TorchFSDPParam, "unsharded_grad_dtype")


def _collect(modules: tuple[nn.Module, ...], ignored: set[int]):
    """Parameters of `modules` not managed by an inner fully_shard or by `replicate()`:
    [(fqn, param, locations)]."""
    found: dict[int, tuple[str, nn.Parameter, list]] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        if "replicate" in (mod.__dict__.get(REGISTRY_KEY) or {}):
            return  # managed by torch's composable replicate(), as torch's fully_shard leaves it
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            entry = found.setdefault(id(p), (prefix + name, p, []))
            entry[2].append((mod, name))
        for name, child in mod._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{name}.")

    for i, m in enumerate(modules):
        walk(m, f"{i}." if len(modules) > 1 else "")
    return list(found.values())


_POST_FORWARD_GROUPS: dict[tuple, dist.ProcessGroup] = caches.register(
    "fsdp.api post-forward groups", {})


def _post_forward_group(mesh: DeviceMesh, k: int) -> dist.ProcessGroup:
    """This rank's group of k consecutive ranks of the shard dim (of each replica with HSDP),
    as torch's `mesh.view(-1, k)`; made once per (mesh, k) by every rank together (again if
    the cached one was destroyed since: every rank sees the same destroyed groups)."""
    key = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), k)
    group = _POST_FORWARD_GROUPS.get(key)
    if group is None or not alive(group):
        group = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, k)).get_group(1)
        _POST_FORWARD_GROUPS[key] = group
    return group


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError("fully_shard needs torch.distributed to be initialized (or a mesh=)")
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def _no_deepcopy(*args, **kwargs):
    """`copy.deepcopy` of a sharded module: refused with torch's error (the copy would share or
    duplicate DBuffers that its collectives assume one owner of)."""
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"fully_shard expects an nn.Module or a list of them, got {module!r}")
    if isinstance(module, FSDPModule):  # torch's composable-API contract raises AssertionError
        raise AssertionError(
            "Each distinct composable distributed API can only be applied to a module once. "
            f"(fully_shard was already applied to this {type(module).__name__})"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and (
        type(module).forward is nn.Module.forward  # never called: its hooks would never run
    ):
        raise ValueError(
            "fully_shard does not support containers that do not implement forward: "
            f"{type(module).__name__}; shard the modules in it, or the module that calls them"
        )
    if isinstance(module, TorchFSDPModule):
        raise ValueError(
            f"{type(module).__name__} was already sharded by torch.distributed.fsdp.fully_shard"
        )


def _uses_extension(r: _Param) -> bool:
    """Whether parameter `r`'s local tensor defines torch's all-gather extension hooks
    ([Note: all-gather extensions]); most define none of their attributes, and only a tensor
    that defines some is checked further (both hooks, or `has_extension` raises)."""
    t = r.inner._local_tensor if isinstance(r.inner, DTensor) else r.inner
    return any(hasattr(t, a) for a in EXTENSION_ATTRS) and has_extension(t, r.fqn)


def _shard_dim(fqn, p, placement: Shard | None, world: int, info=None) -> int | None:
    """The dim `shard_placement_fn` asks for (None: the default), checked as torch checks it."""
    if placement is None:
        return None
    dim = placement.dim + p.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < p.ndim:  # torch's wording
        raise AssertionError(
            f"Shard dim {placement.dim} is invalid for {p.ndim}D tensor: {p.shape} ({fqn!r})"
        )
    shape = p.shape if info is None else info.local_shape  # TP: chunks of the local block
    if dim > 0 and shape[dim] % world:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {shape} "
            f"(world size: {world}; {fqn!r})"
        )
    return dim


def _block_size(fqn, p, granularity_fn, dim: int | None, info=None) -> int:
    if info is not None:  # the LCM rule: [Note: FSDP over TP]
        g = granularity_fn(fqn, p) if granularity_fn is not None else None
        return tp_block_size(fqn, info, g, rows=dim == 0)
    block = None
    if dim == 0:
        block = p.numel() // p.shape[0] if p.shape[0] else 1
    if granularity_fn is not None:
        g = granularity_fn(fqn, p)
        block = block if g is None else g
    block = 1 if block is None else block
    if not isinstance(block, int) or block < 1 or p.numel() % block:
        raise ValueError(
            f"granularity_fn({fqn!r}) = {block!r} must be a positive int dividing numel "
            f"{p.numel()}"
        )
    return block


def _post_forward(reshard_after_forward, dp: DpMesh) -> tuple[bool, object]:
    """(reshard after forward?, the post-forward group for an int) for one mesh, as torch."""
    if dp.replicate_only:  # torch's DDP mode has no post-forward reshard
        return False, None
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    k, world = reshard_after_forward, dp.shard_world
    if k < 1 or k > world or world % k:  # torch's wording
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{world}, not {k}"
        )
    return k > 1, (_post_forward_group(dp.mesh, k) if 1 < k < world else None)


def _fully_shard_state(module: nn.Module) -> FSDPState | None:
    """`fully_shard.state(module)`, as torch's composable API: the state of the fully_shard call
    that `module` was given to (one object per call), or None."""
    return getattr(module, "_veragged_state", None)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    dp_mesh_dims=None,
    granularity_fn: Callable[[str, nn.Parameter], int | None] | None = None,
    quant_fn: Callable[[str, nn.Parameter], object] | None = None,
):
    """Shard `module`'s parameters (those no inner `fully_shard` took) into DBuffers (`_bucket`).

    Every argument means what it means for `torch.distributed.fsdp.fully_shard`; apply it to
    the blocks first and the root last. `module` may be a list (one group for several
    modules). `mesh` is 1-D (FSDP) or 2-D `(replicate, shard)` (HSDP), or with `dp_mesh_dims`
    (torch's `DataParallelMeshDims`) the full SPMD mesh whose named dims are data-parallel
    ([Note: data-parallel meshes]; naming no shard dim: torch's DDP mode, [Note: replicated
    DBuffers]). `reshard_after_forward`: True, False, or None (True except
    for the root), or an int. `granularity_fn(fqn, param)` gives the block size in elements
    that no rank boundary may cut (None: element-wise); `shard_placement_fn` returning
    `Shard(0)` keeps rows whole, and returning torch's `ShardPlacementResult` also names the
    parameter's mesh. The sharded parameters are RaggedShard DTensors, views into their group's
    DBuffer; `Shard(d)` with d > 0 gives torch's equal chunks as `Shard(d)` DTensors in a
    DBuffer of their own ([Note: chunked parameters]). Parameters that are already DTensors on
    a tensor/expert-parallel mesh (`parallelize_module`) are sharded by their local blocks over
    `mesh`, onto the combined mesh ([Note: FSDP over TP]). Frozen parameters get DBuffers of
    their own, so backward communicates only what requires grad ([Note: frozen parameters]).
    Parameters whose tensors define torch's `fsdp_pre_all_gather` / `fsdp_post_all_gather`
    are sharded as torch's `Shard(0)` and all-gathered through them
    ([Note: all-gather extensions]). `quant_fn(fqn, param)` returning a `veragged.BlockFP8` or
    `veragged.MXFP8` (None: as usual) all-gathers that parameter in block-scaled 8 bits,
    quantised where its tiles live, with no scale exchange ([Note: block-scaled weights]).
    See [Note: fully_shard lifecycle].
    """
    call = _normalize_args(module, mesh, dp_mesh_dims, reshard_after_forward, mp_policy,
                           offload_policy)
    params, shared = _collect_params(call.modules, ignored_params)
    resolved = _resolve_params(params, shard_placement_fn, call.mesh)
    groups = [_make_group(bucket, call, granularity_fn, quant_fn)
              for bucket in _bucket(resolved)]
    if log.logger.isEnabledFor(logging.DEBUG):  # the groups' plans (nothing built otherwise)
        log.log_groups(", ".join(log.module_name(m) for m in call.modules), groups)
    state = FSDPState(call.modules, groups, mp_policy, call.auto)
    if shared:  # raised at the first forward, as torch does (torch's wording leads)
        state.init_error = ValueError(
            f"parameters {shared} are already managed by another fully_shard call (tied "
            "weights sharded in separate calls); call fully_shard([module_a, module_b]) so "
            "they land in one group, or shard their common parent"
        )
    _install(call.modules, state)
    return module


fully_shard.state = _fully_shard_state


class _Call(NamedTuple):
    """One `fully_shard` call's arguments, checked as torch checks them (`_normalize_args`)."""

    modules: tuple[nn.Module, ...]
    mesh: DpMesh  # the default mesh: [Note: data-parallel meshes]
    reshard_after_forward: bool | int
    auto: bool  # reshard_after_forward=None: True, except for the root (FSDPState)
    mp_policy: MixedPrecisionPolicy
    policy: dict  # the DBuffer keyword arguments that the two policies give


class _Param(NamedTuple):
    """One parameter of a `fully_shard` call and where it goes (`_resolve_params`)."""

    fqn: str
    param: nn.Parameter
    locations: list[tuple[nn.Module, str]]  # every (module, attribute name) holding it
    placement: Shard | None  # what shard_placement_fn asked for (None: the default)
    dp: DpMesh  # its mesh: [Note: data-parallel meshes]
    inner: torch.Tensor  # what its DBuffer holds (a DTensor: its TP part, [Note: FSDP over TP])
    view: object | None  # how it is presented on the full SPMD mesh (dp_mesh_dims), or None
    info: TPParam | None  # its tensor-parallel block, or None
    dim: int | None  # the dim its placement shards (None: the default), checked
    extension: bool  # its tensor defines all-gather extension hooks


class _Bucket(NamedTuple):
    """Parameters that share one DBuffer (`_bucket`)."""

    dp: DpMesh
    chunked: bool  # Shard(d > 0): [Note: chunked parameters]
    extension: bool  # [Note: all-gather extensions]
    params: list[_Param]


def _normalize_args(module, mesh, dp_mesh_dims, reshard_after_forward, mp_policy,
                    offload_policy) -> _Call:
    """Check the arguments (torch's errors, in torch's order) and resolve the default mesh."""
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        _check_module(m)
    mesh = mesh if mesh is not None else _default_mesh()
    default = resolve_mesh(mesh, dp_mesh_dims)
    auto = reshard_after_forward is None
    if auto:
        reshard_after_forward = True
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        if default.spmd_mesh is not None:  # torch's wording
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
        if reshard_after_forward == 1:
            warnings.warn(  # stacklevel: the caller of fully_shard
                "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
                "instead of reshard_after_forward=True (bool)", stacklevel=3,
            )
        _post_forward(reshard_after_forward, default)  # checked against the mesh now
    elif not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be None, a bool or an int, got {reshard_after_forward!r}"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    policy = dict(param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
                  reduce_in_own_dtype=_UNSET_REDUCE_DTYPE_IS_ORIG,
                  offload=offload, pin_memory=offload and offload_policy.pin_memory)
    return _Call(modules, default, reshard_after_forward, auto, mp_policy, policy)


def _collect_params(modules, ignored_params) -> tuple[list, list[str]]:
    """The parameters this call takes, [(fqn, param, locations)], refusing ones already
    sharded; and the fqns of those tied to an earlier call's (an error at lazy init)."""
    ignored = {id(p) for p in ignored_params or ()}
    params = _collect(modules, ignored)
    shared: list[str] = []
    for fqn, p, _ in params:
        if isinstance(p, RaggedDTensor) or getattr(p, "_veragged_fsdp", False):
            raise ValueError(
                f"parameter {fqn!r} is already sharded by fully_shard ({p.placements}); "
                "apply fully_shard once per parameter"
            )
        if _MANAGED.get(id(p)) is p:
            shared.append(fqn)
    return [e for e in params if e[0] not in shared], shared


def _resolve_params(params, shard_placement_fn, default: DpMesh) -> list[_Param]:
    """Each parameter's mesh and placement (shard_placement_fn), then its model-parallel part
    ([Note: data-parallel meshes], [Note: FSDP over TP]), whether its tensor defines all-gather
    extension hooks (by its type: hooks set on the local tensor later are taken at lazy init,
    [Note: all-gather extensions]) and the dim it is sharded along; refuses what is not
    supported, every placement checked (torch's errors) before any is refused."""
    found = []
    for fqn, p, locations in params:
        result = shard_placement_fn(p) if shard_placement_fn is not None else None
        placement, dp = resolve_placement(fqn, result, default)
        inner, view = split_param(fqn, p, dp)
        info = tp_param(fqn, inner, dp.mesh) if isinstance(inner, DTensor) else None
        if p.ndim == 0:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor "
                "with numel equal to 1 (or pass it in ignored_params)."
            )
        if not (inner._local_tensor if isinstance(inner, DTensor) else inner).is_contiguous():
            # The DBuffer would hold a contiguous copy: the unsharded parameter would silently
            # lose its memory format (channels_last), so refuse as torch does.
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: {fqn!r} has shape "
                f"{tuple(p.shape)} and stride {p.stride()}"
            )
        found.append(_Param(fqn, p, locations, placement, dp, inner, view, info, None, False))
    found = [r._replace(extension=_uses_extension(r)) for r in found]
    found = [r._replace(dim=_shard_dim(r.fqn, r.param, r.placement, r.dp.shard_world, r.info))
             for r in found]
    for r in found:
        if r.extension and r.dim:
            raise NotImplementedError(
                f"all-gather extensions with Shard({r.dim}) are not supported: {r.fqn!r} "
                "(its hooks are sharded as Shard(0))"
            )
        if r.extension and r.view is not None:
            raise NotImplementedError(
                f"all-gather extensions with dp_mesh_dims are not supported: {r.fqn!r}"
            )
    return found


# [Note: frozen parameters]
# A DBuffer's reduce-scatter covers the whole buffer ([Note: unreached parameters] needs every
# rank to issue the same collective), and its gradient buffer is as large as its parameters. So
# `fully_shard` plans the parameters that require grad and the frozen ones in DBuffers of their
# own (per mesh and dtype): a LoRA model's backward sends and holds only the adapters, as
# torch's FSDP2 sends only the parameters with gradients, and a DBuffer whose parameters are all
# frozen allocates no gradient buffer and reduces nothing. The price is one more all-gather per
# module whose parameters are mixed. `requires_grad_()` after `fully_shard` keeps the parameter
# layout but not the gradient one: each backward gives gradient room only to what then requires
# grad ([Note: compacted gradients]), so a DBuffer's reduce-scatter carries each rank's share of
# its trainable parameters, whichever were frozen or unfrozen since.
def _bucket(params: list[_Param]) -> list[_Bucket]:
    """One DBuffer per mesh, dtype and requires_grad ([Note: frozen parameters]); parameters
    that shard_placement_fn cuts along a later dim (torch's equal chunks) get one of their own
    ([Note: chunked parameters]), and so do those with all-gather extensions."""
    by_kind: dict[tuple, list[_Param]] = {}
    meshes: dict[tuple, DpMesh] = {}
    for r in params:
        meshes.setdefault(r.dp.key(), r.dp)
        chunked = bool(r.dim) and not r.dp.replicate_only  # nothing to chunk in DDP mode
        key = (r.dp.key(), r.param.dtype, chunked, r.param.requires_grad, r.extension)
        by_kind.setdefault(key, []).append(r)
    return [_Bucket(meshes[mesh_key], chunked, extension, entries)
            for (mesh_key, _, chunked, _, extension), entries in by_kind.items()]


def _make_group(bucket: _Bucket, call: _Call, granularity_fn, quant_fn=None) -> ParamGroup:
    """The DBuffer of one bucket and its `ParamGroup`, resharded (the sharded parameters
    registered in their modules)."""
    rafter, post_forward_group = _post_forward(call.reshard_after_forward, bucket.dp)
    buffer = _make_buffer(bucket, call, granularity_fn, quant_fn)
    for sharded, r in zip(buffer.params, bucket.params):
        with torch._C.DisableTorchFunctionSubclass():  # no ragged accumulation hooks
            sharded.requires_grad_(r.param.requires_grad)
        _MANAGED[id(r.param)] = r.param
    group = ParamGroup(
        [r.fqn for r in bucket.params],
        [r.locations for r in bucket.params],
        buffer,
        reshard_after_forward=rafter,
        post_forward_group=post_forward_group,
        views=[r.view for r in bucket.params],
    )
    group.reshard()
    return group


def _formats(bucket: _Bucket, quant_fn) -> list | None:
    """Each parameter's block-scaled format (`quant_fn`), or None when none has one; refuses
    the buckets that cannot quantise ([Note: block-scaled weights])."""
    if quant_fn is None:
        return None
    formats = [quant_fn(r.fqn, r.param) for r in bucket.params]
    named = [r.fqn for r, f in zip(bucket.params, formats) if f is not None]
    if not named:
        return None
    why = ("their tensors define all-gather extension hooks (which decide what travels)"
           if bucket.extension else
           "their dp_mesh_dims name no shard dim (DDP mode: nothing is gathered)"
           if bucket.dp.replicate_only else
           "shard_placement_fn cuts them along a dim > 0 (torch's equal chunks, not whole tiles)"
           if bucket.chunked else None)
    if why is not None:
        raise NotImplementedError(f"quant_fn gave block-scaled formats to {named}, but {why}")
    return formats


def _make_buffer(bucket: _Bucket, call: _Call, granularity_fn, quant_fn=None) -> DBuffer:
    """The kind of DBuffer the bucket's parameters need, holding them."""
    dp, entries = bucket.dp, bucket.params
    tensors = [(r.fqn, r.inner.detach()) for r in entries]
    infos = [r.info for r in entries]
    formats = _formats(bucket, quant_fn)
    if bucket.extension:
        owners = [r.locations[0][0] for r in entries]  # the hooks' `module`
        return ExtensionDBuffer(tensors, dp.mesh, modules=owners, mp_policy=call.mp_policy,
                                tp=infos, **call.policy)
    if dp.replicate_only:  # torch's DDP mode: [Note: replicated DBuffers]
        if granularity_fn is not None:
            raise ValueError(
                f"granularity_fn={granularity_fn!r} cannot apply to {[r.fqn for r in entries]}: "
                "their dp_mesh_dims name no shard dim (DDP mode), nothing is cut"
            )
        specs = [None if r.view is None else r.view.spec for r in entries]
        return ReplicatedDBuffer(tensors, dp.mesh, specs=specs, tp=infos, **call.policy)
    if bucket.chunked:
        return ChunkedDBuffer(tensors, dp.mesh, dims=[r.dim for r in entries], tp=infos,
                              **call.policy)
    blocks = [_block_size(r.fqn, r.param, granularity_fn, r.dim, r.info) for r in entries]
    if formats is not None:
        return QuantDBuffer(tensors, dp.mesh, formats=formats, block_sizes=blocks, tp=infos,
                            **call.policy)
    return DBuffer(tensors, dp.mesh, block_sizes=blocks, tp=infos, **call.policy)


def _install(modules: tuple[nn.Module, ...], state: FSDPState) -> None:
    """Make each module an `FSDPModule` run by `state`: its state, torch's composable registry
    entry, the state-dict hooks, and the class swap."""
    for m in modules:
        m._veragged_state = state
        # torch's composable registry: tooling that asks "is this module fully sharded?"
        # (`replicate` leaving FSDP parameters to FSDP) gets the answer it gets for torch's.
        m.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())
        # [Note: fully_shard state dicts] (state_dict.py)
        m.register_state_dict_pre_hook(functools.partial(state_dict.pre_state_dict, state))
        m._register_load_state_dict_pre_hook(
            functools.partial(state_dict.pre_load_state_dict, state, m))
        m.register_load_state_dict_post_hook(
            functools.partial(state_dict.post_load_state_dict, state))
        cls = type(m)
        if cls not in _CLASS_CACHE:
            _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                                     {"__deepcopy__": _no_deepcopy})
        m.__class__ = _CLASS_CACHE[cls]
