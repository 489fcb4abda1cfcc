"""`RaggedDTensor`, the DTensor subclass that carries RaggedShard placements, and its specs.

Stock DTensor cannot be told about a new placement: `redistribute` skips it silently and sharding
propagation and DCP treat it as Replicate. A subclass lets veragged own exactly the RaggedShard
cases without patching torch: `isinstance(x, DTensor)` still holds, torch code that calls
`full_tensor()`, `redistribute()` or the DCP hooks reaches the overrides below, and ops go through
[Note: ops on RaggedShard DTensors]. DTensors without a RaggedShard stay plain torch DTensors.

[Note: placement layers]
veragged/placement is layered: a module imports modules of its own layer or below, at top
level, never one above (inside placement/, only the package file imports ops.py and api.py):
  1. placements and their arithmetic: ragged_shard.py (RaggedShard), layout.py (a layout on an
     N-D mesh), boxes.py (a rank's rows as boxes: checkpoint and reductions), collectives.py,
     torch_callers.py (torch's functions that cannot take a RaggedShard);
  2. this module: the tensor classes and their specs (`make_spec`, `cached_spec`);
  3. what runs on them: redistribute.py; the op handlers fastpath.py, operands.py, factories.py,
     random_ops.py, amp.py, reductions.py (with reduce_parts.py), ragged_dim_reduce.py, norms.py;
  4. ops.py (which handler takes which op) and api.py (distribute_tensor, from_local).
The class calls up the stack at call time only: its `__torch_function__`/`__torch_dispatch__`
go to ops.py, `redistribute()`/`full_tensor()` and `to_local`'s backward to redistribute.py,
`from_local` to api.py. It reaches them through `_UP`, filled once by `connect_layers`, which
veragged/placement/__init__.py calls after importing every layer; importing any placement
module runs that package file first, so the class is always connected when it can be used.
tests/test_import_graph.py fails on any import cycle in veragged, function-local imports
included.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, Replicate
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types

from veragged import _C
from veragged.placement import boxes
from veragged.placement.layout import ragged_mesh_dim
from veragged.placement.torch_callers import refuse_torch_caller
from veragged.runtime import caches

__all__ = [
    "GRAD_VERDICTS", "RaggedDTensor", "RoutedDTensor", "accumulate_grads_locally", "as_ragged",
    "cached_spec", "connect_layers", "make_spec", "routed",
]

# id(sharded parameter) -> the object holding the grad/None verdict fully_shard's last backward
# gave it (dbuffer/grads.py's `Gradients`, kept weakly), for the optimizers: [Note: grad
# verdicts for optimizers]. Not an attribute of the parameter, which copies and pickles carry.
GRAD_VERDICTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

# func -> how ops.py handles it (ops.py classifies each func on its first call); the class
# answers metadata reads (kind META), the most frequent calls, itself.
OP_KINDS: dict = caches.register("placement.ops op kinds", {})
META = 0
_no_subclass_function = torch._C.DisableTorchFunctionSubclass


class _Up:
    """The layers above the class ([Note: placement layers])."""

    __slots__ = ("torch_function", "torch_dispatch", "redistribute", "from_local")


_UP = _Up()


def connect_layers(*, torch_function: Callable, torch_dispatch: Callable,
                   redistribute: Callable, from_local: Callable) -> None:
    """Give the class the layers above it ([Note: placement layers]); called once, by
    veragged/placement/__init__.py."""
    _UP.torch_function, _UP.torch_dispatch = torch_function, torch_dispatch
    _UP.redistribute, _UP.from_local = redistribute, from_local


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def make_spec(mesh: DeviceMesh, placements, shape, dtype, stride=None) -> DTensorSpec:
    shape = torch.Size(shape)
    return DTensorSpec(
        mesh,
        tuple(placements),
        TensorMeta(shape, tuple(stride or _contiguous_stride(shape)), dtype),
    )


# (id(mesh), placements, shape, stride, dtype) -> spec (the spec holds the mesh)
_SPECS: dict = caches.register("placement.tensor specs", {})


def cached_spec(mesh: DeviceMesh, placements, shape, dtype, stride=None) -> DTensorSpec:
    """`make_spec`, shared between calls with the same arguments: specs are not mutated once
    made (torch's sharding propagation shares its output specs the same way), and building
    one costs more than a small op. A mesh freed and its id reused gets a fresh entry."""
    shape = tuple(shape)
    stride = tuple(stride or _contiguous_stride(shape))
    key = (id(mesh), tuple(placements), shape, stride, dtype)
    spec = _SPECS.get(key)
    if spec is None or spec.mesh is not mesh:
        if len(_SPECS) > 4096:
            _SPECS.clear()
        spec = _SPECS[key] = make_spec(mesh, placements, shape, dtype, stride)
    return spec


def accumulate_grads_locally(dt) -> None:
    """Make gradient accumulation into leaf `dt` run on the local shards, and keep `.grad` ragged.

    The autograd engine adds a new gradient into an existing `.grad` in C++; on torch versions
    whose DTensor fast path skips a subclass's `__torch_dispatch__` (2.11), that add reaches
    torch's sharding propagation, which rejects RaggedShard, and the engine stores the gradient
    re-wrapped as a plain DTensor. A tensor hook runs before the engine's accumulation: it adds
    the existing `.grad` itself (a local element-wise add) and clears `.grad`, so the engine only
    stores the sum; a post-accumulate hook turns a plain DTensor `.grad` back into a
    RaggedDTensor. Installed once per leaf.
    """
    if not (isinstance(dt, RaggedDTensor) and dt.is_leaf and dt.requires_grad):
        return
    if getattr(dt, "_veragged_accumulates", False) or getattr(dt, "_veragged_fsdp", False):
        return  # fully_shard's parameters: [Note: submodule _apply]
    # A strong reference (a cycle through the tensor's hooks, which the garbage collector
    # traverses), not a weak one: torch.utils.swap_tensors refuses weakly referenced tensors,
    # and nn.Module._apply swaps every DTensor parameter ([Note: submodule _apply]).
    cell = [dt]

    @torch.utils.hooks.unserializable_hook  # an unpickled tensor gets it in __setstate__
    def add_existing(grad):
        x = cell[0]
        if x.grad is None:
            return None
        with torch.no_grad():
            total = as_ragged(x.grad) + as_ragged(grad)
        x.grad = None
        return total

    def keep_ragged(x):
        if x.grad is not None and type(x.grad) is not RaggedDTensor:
            x.grad = as_ragged(x.grad)

    dt.register_hook(add_existing)
    dt.register_post_accumulate_grad_hook(keep_ragged)
    dt._veragged_accumulates = True


def as_ragged(dt):
    """A plain DTensor whose spec holds a RaggedShard (made by torch code) as a RaggedDTensor."""
    if type(dt) is DTensor and ragged_mesh_dim(dt.placements) is not None:
        return RaggedDTensor(dt._local_tensor, dt._spec, requires_grad=dt.requires_grad)
    return dt


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: "RaggedDTensor", grad_placements):
        ctx.spec, ctx.grad_placements = dt._spec, grad_placements
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        if ctx.grad_placements is None or tuple(ctx.grad_placements) == spec.placements:
            return RaggedDTensor._wrap(grad.reshape(-1), spec), None
        dt = _UP.from_local(grad, spec.mesh, ctx.grad_placements, shape=spec.shape,
                            stride=spec.stride)
        return _UP.redistribute(dt, spec.mesh, spec.placements), None


class RaggedDTensor(DTensor):
    """A DTensor with a RaggedShard placement; its local tensor is the flat 1-D shard.

    Build one with `veragged.distribute_tensor`, `veragged.DTensor.from_local` (also
    `RaggedDTensor.from_local`) or by redistributing; see `veragged.placement` for semantics.
    """

    @staticmethod
    def _wrap(
        local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False
    ) -> "RaggedDTensor":
        """Wrap a flat local tensor under `spec` (its dtype follows `local`)."""
        if spec.tensor_meta.dtype != local.dtype:
            meta = spec.tensor_meta
            spec = DTensorSpec(
                spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, local.dtype)
            )
        return RaggedDTensor(local, spec, requires_grad=requires_grad)

    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements: Sequence[Placement] | None = None, **kwargs) -> DTensor:
        """`veragged.DTensor.from_local(...)`, as torch's `DTensor.from_local(...)` with
        RaggedShard placements allowed: `veragged.placement.api.from_local`."""
        return _UP.from_local(local_tensor, device_mesh, placements, **kwargs)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        refuse_torch_caller(self)  # [Note: torch's entry points without the routing]
        if not torch.is_grad_enabled():
            return self._local_tensor
        if grad_placements is not None:
            grad_placements = tuple(grad_placements)
        return _ToLocal.apply(self, grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """`DTensor.redistribute` for RaggedShard sources (see `veragged.redistribute`).

        `async_op=True` is served by `veragged.redistribute(..., async_op=True)`, which returns a
        handle; `forward_dtype`/`backward_dtype` are not supported here.
        """
        return _redistribute_ragged(self, device_mesh, placements, async_op, forward_dtype,
                                    backward_dtype)

    def detach(self) -> "RaggedDTensor":
        if torch._C._is_torch_function_enabled():
            return super().detach()  # through __torch_function__, as every op
        # Torch functions off (`nn.Parameter(dt)` under DisableTorchFunctionSubclass, as DBuffer
        # makes its parameters without the hooks of `requires_grad_`): aten.detach reaches the
        # C++ dispatcher, whose DTensor fast path in torch 2.11 skips a subclass's
        # `__torch_dispatch__` and returns a plain DTensor, while `nn.Parameter` requires
        # `detach()` to keep the type. What `__torch_dispatch__` does on later versions:
        return RaggedDTensor._wrap(self._local_tensor.detach(), self._spec)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        replicated = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Metadata reads (`x.grad`, `x.shape`, ...), the most frequent calls, answered here:
        # see ops.handle_torch_function (which classifies `func` on its first call).
        try:
            meta = OP_KINDS.get(func) is META
        except TypeError:  # an unhashable callable
            meta = False
        if meta:
            with _no_subclass_function():
                return func(*args, **kwargs) if kwargs else func(*args)
        return _UP.torch_function(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _UP.torch_dispatch(func, args, kwargs or {})

    # [Note: a RaggedDTensor has no storage]
    # As torch's DTensor, a RaggedDTensor is a wrapper without storage of its own:
    # `untyped_storage()` is the wrapper's (no data), answered by torch as for its DTensor
    # (ops.py lists it with the metadata reads), never the local shard's, and `data_ptr()` is 0.
    # (torch's C++ would add the wrapper's storage offset, which its DTensor constructor copies
    # from the local tensor, to the null pointer; a DBuffer's local shards are views at nonzero
    # offsets, where torch's FSDP2 shards start at 0.) torch's code tells wrappers from plain
    # tensors by exactly that:
    # - DCP's staging (`StateDictStager._offload_tensor`, used by `async_save`) copies a
    #   wrapper through its `__slots__` (`_local_tensor` staged to CPU, `_spec`); a nonzero
    #   pointer sends it down the plain-tensor branch (`set_` of a CPU storage into the
    #   wrapper: a crash);
    # - `Tensor.__reduce_ex__` pickles a wrapper as torch's DTensor pickles: its metadata, then
    #   the local shard and the spec, no gather. So a per-rank `torch.save` of a state dict and
    #   `async_save(async_checkpointer_type=PROCESS)` (which pickles the staged state dict to a
    #   background process) work, and `torch.load(weights_only=True)` takes the classes that
    #   placement/__init__.py registers as safe globals.
    # The local shard's storage is `dt._local_tensor.untyped_storage()`.

    def data_ptr(self) -> int:
        """0: a wrapper has no data of its own ([Note: a RaggedDTensor has no storage])."""
        return 0

    def __setstate__(self, state):
        """Unpickling ([Note: a RaggedDTensor has no storage]): torch's state (`__dict__`, then
        `_local_tensor` and `_spec`), less our flags, whose hooks did not travel."""
        dict_state, slots_state = state if isinstance(state, tuple) else (state, None)
        for k, v in _travelling(dict_state or {}).items():
            setattr(self, k, v)
        for k, v in (slots_state or {}).items():
            setattr(self, k, v)
        accumulate_grads_locally(self)

    # Distributed checkpoint: the rank's flat range as rectangular boxes (boxes.py).
    def __create_write_items__(self, fqn: str, object: Any):
        return boxes.create_write_items(fqn, self)

    def __create_chunk_list__(self):
        return boxes.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return boxes.get_tensor_shard(self, index)

    def __deepcopy__(self, memo):
        """A RaggedDTensor with a deep copy of the local shard, `.grad` and `__dict__`, as torch's
        DTensor copies (parameters stay parameters); the spec is shared, as it is immutable
        ([Note: a RaggedDTensor has no storage])."""
        if id(self) in memo:
            return memo[id(self)]
        out = RaggedDTensor(
            copy.deepcopy(self._local_tensor.detach(), memo), self._spec,
            requires_grad=self.requires_grad,
        )
        if isinstance(self, torch.nn.Parameter) or getattr(self, "_is_param", False):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        out.__dict__.update(copy.deepcopy(_travelling(self.__dict__), memo))
        accumulate_grads_locally(out)
        return out


# [Note: tensor attributes without __torch_function__]
# A tensor attribute (`.grad`, `.shape`, `.device`, `.requires_grad`, ...) is read many times per
# parameter per step: clipping reads `.grad` four times and `.device` once, optimizers and FSDP
# more. torch's getters call the class's `__torch_function__` first; torch's DTensor disables
# that hook altogether, RaggedDTensor routes ops through it, so every read paid a Python call
# (about 1.3 us, against torch's 0.2). The class therefore serves torch's own getters with
# subclasses' `__torch_function__` disabled, from C (`veragged._C.SubclassFunctionOff`,
# csrc/bindings/tensor_attrs.cpp): the answers are torch's (what `__torch_function__`'s
# metadata branch returned), a TorchFunctionMode still sees the reads as it sees torch's
# DTensor's, and a read costs what one on torch's DTensor does. Sets go through
# `__torch_function__` as before, except `.grad`'s, which torch's setter checks (dtype, device,
# shape, layout) with the hook disabled.
_ATTRIBUTES = (
    "shape dtype device requires_grad grad _grad is_leaf ndim layout grad_fn is_cuda is_cpu "
    "is_meta _base is_sparse is_quantized is_nested itemsize nbytes retains_grad output_nr "
    "_version _post_accumulate_grad_hooks _backward_hooks"
).split()
for _name in _ATTRIBUTES:
    setattr(RaggedDTensor, _name, _C.SubclassFunctionOff(
        torch._C.TensorBase.__dict__[_name], writes=_name == "grad"))
del _name


def _travelling(attrs: dict) -> dict:
    """The attributes a copy or an unpickled tensor takes: all but veragged's own flags, which
    say which hooks a tensor holds (the copy holds none of them until it installs its own)."""
    return {k: v for k, v in attrs.items() if not k.startswith("_veragged")}


def _redistribute_ragged(dt, device_mesh, placements, async_op, forward_dtype, backward_dtype):
    """`.redistribute` of a DTensor veragged handed out, when either side is ragged."""
    if async_op:
        raise ValueError(
            f"{type(dt).__name__}.redistribute(async_op=True) to or from RaggedShard is not "
            "supported: use veragged.redistribute(dt, mesh, placements, async_op=True), "
            "which returns a handle to wait on"
        )
    if forward_dtype is not None or backward_dtype is not None:
        raise ValueError(
            f"forward_dtype={forward_dtype} / backward_dtype={backward_dtype} "
            "are not supported for RaggedShard DTensors; cast with .to(dtype) first"
        )
    if placements is None:
        raise RuntimeError("placements is needed for redistribute!")
    return _UP.redistribute(dt, device_mesh or dt.device_mesh, placements)


class RoutedDTensor(DTensor):
    """A DTensor without RaggedShard placements as veragged hands it out.

    [Note: DTensors veragged hands out]
    `veragged.distribute_tensor`, `veragged.DTensor.from_local` and `veragged.redistribute`
    return a RaggedDTensor when the placements hold a RaggedShard and this class otherwise: a
    torch DTensor in every respect (its ops go through torch's sharding propagation and return
    torch DTensors, as torch's own would) except `redistribute`, which sends a RaggedShard
    target to `veragged.redistribute`. So a DTensor from veragged can always be redistributed
    to RaggedShard with its own method, while torch's method on torch's DTensors raises
    ([Note: torch's redistribute to RaggedShard], ragged_shard.py).
    """

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        if placements is not None and ragged_mesh_dim(placements) is not None:
            return _redistribute_ragged(self, device_mesh, placements, async_op, forward_dtype,
                                        backward_dtype)
        return super().redistribute(device_mesh, placements, async_op=async_op,
                                    forward_dtype=forward_dtype, backward_dtype=backward_dtype)

    def detach(self) -> "RoutedDTensor":
        # `nn.Parameter(x)` requires `x.detach()` to keep the type; torch's dispatch returns a
        # plain DTensor.
        out = super().detach()
        return RoutedDTensor(out._local_tensor, out._spec, requires_grad=False)


class _Route(torch.autograd.Function):
    """A torch DTensor as a RoutedDTensor over the same local tensor, in the autograd graph."""

    @staticmethod
    def forward(ctx, dt: DTensor):
        return RoutedDTensor(dt._local_tensor.view_as(dt._local_tensor), dt._spec,
                             requires_grad=dt.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        return grad


def routed(dt):
    """`dt` as veragged hands DTensors out ([Note: DTensors veragged hands out]): a plain torch
    DTensor without RaggedShard becomes a RoutedDTensor (a leaf stays a leaf); anything else is
    returned as is."""
    if type(dt) is not DTensor or ragged_mesh_dim(dt._spec.placements) is not None:
        return dt
    if dt.grad_fn is None:
        return RoutedDTensor(dt._local_tensor, dt._spec, requires_grad=dt.requires_grad)
    return _Route.apply(dt)


# torch's foreach paths (optimizers, clip_grad_norm_) take only the exact types in these lists;
# torch registers DTensor itself (torch/distributed/tensor/__init__.py), not its subclasses.
# RaggedDTensor runs every _foreach_* op, so it registers the same way.
for _types in (_optim_foreach_types, _util_foreach_types):
    for _cls in (RaggedDTensor, RoutedDTensor):
        if _cls not in _types:
            _types.append(_cls)
