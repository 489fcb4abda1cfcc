"""Random ops and `torch.nn.init` on RaggedShard DTensors.

[Note: random ops on RaggedShard]
A random op on a RaggedShard DTensor gives, bitwise, what one process gets when it runs the op on
the full tensor with the same generator state, at any world size and any layout (including ranks
holding 0 elements, `dims=()` and 2-D meshes with Replicate, Shard or StridedRaggedShard):
- every rank draws the *full* tensor (the global shape, row-major, the local tensor's dtype and
  device) from the generator it is given (the default generator of that device if none), with
  the op's own arguments; the draw is identical on all ranks because their generator states are
  (every rank must have seeded it the same way, e.g. `torch.manual_seed(s)` everywhere; this is
  not checked, as a check would cost a collective per op);
- each rank copies its own elements out of it: the block it holds under the other placements
  and then its ragged rows of that block ([Note: ragged layout on an N-D mesh]), so replicate
  ranks of an HSDP mesh get the same values;
- the generator ends advanced exactly as the full draw left it, the same on every rank and the
  same as in one process, so the next op (random or not) stays in step.
Nothing is communicated. The cost is one full-size temporary per call on every rank (global
numel x itemsize bytes, e.g. 4 GiB for a 128k x 8192 fp32 embedding; freed when the op returns,
so `trunc_normal_`'s several draws never hold two) and the time to draw the full tensor on every
rank: the price of the bitwise guarantee. Tensors on the meta device draw nothing.

Covered: in-place `normal_`, `uniform_`, `bernoulli_` (float or 0-dim p), `exponential_`,
`random_`, `log_normal_`, `cauchy_`, `geometric_`, and the `rand_like`, `randn_like`,
`randint_like` factories. `torch.nn.init` functions that dispatch on tensor subclasses
(`normal_`, `uniform_`, `constant_`, `kaiming_uniform_`) are re-run here on the DTensor; the others
(`trunc_normal_`, `xavier_*`, `kaiming_normal_`, `zeros_`, `ones_`) reach the ops above and the
element-wise ops directly (fans from the global shape), and `trunc_normal_`'s rejection loop stays
in step on every rank because its `mask.any()` is a global reduction
(veragged/placement/reductions.py). The same holds when transformers' `guard_torch_init_functions`
has patched `torch.nn.init` (`patched_init` below) and at the dispatch level (code run under
`torch._C.DisableTorchFunctionSubclass()` reaches `__torch_dispatch__`, which serves the same aten
ops with `random_op`: same values). Functions that need other ops raise NotImplementedError naming
the op: `orthogonal_` needs the whole matrix for its QR and raises at `t_` or `linalg_qr`
(initialise a full tensor and copy it in: `full = torch.empty(p.shape); nn.init.orthogonal_(full);
p.copy_(full)`, each rank keeping its part), `sparse_` and `dirac_` (indexing), `eye_`
(`eye.out`). Random ops whose values depend on the tensor's values (`bernoulli_` with a tensor `p`,
`torch.bernoulli(x)`, `torch.normal(mean=x)`) or on a Partial placement raise too.
"""

from __future__ import annotations

import math
import types
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from veragged.placement.layout import spec_layout
from veragged.placement.tensor import RaggedDTensor, as_ragged

__all__ = ["RANDOM_FUNCTIONS", "RANDOM_PACKETS", "local_piece", "patched_init", "random_op"]

aten = torch.ops.aten

_INPLACE = (
    "normal_ uniform_ bernoulli_ exponential_ random_ log_normal_ cauchy_ geometric_".split()
)
_LIKE = "rand_like randn_like randint_like".split()


def local_piece(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's elements of `full` (the global tensor) under `spec`, as a flat view.

    The block under the non-ragged placements, then its ragged rows; see
    [Note: ragged layout on an N-D mesh].
    """
    layout = spec_layout(spec)
    block = full
    for d, (offset, size) in enumerate(zip(layout.block_offset, layout.block_shape)):
        if size != full.shape[d]:
            block = block.narrow(d, offset, size)
    start = layout.flat_offset
    return block.reshape(-1)[start : start + layout.local_numel]


def _op_name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _scalar_args(name, values):
    """The op's other arguments with 0-dim tensors unwrapped; others must not be tensors."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dim() != 0:
                raise NotImplementedError(
                    f"{name} on a RaggedShard DTensor with a tensor argument of shape "
                    f"{list(v.shape)}: only scalar (or 0-dim) arguments are supported, since the "
                    "full-tensor draw needs them on every rank"
                )
            if isinstance(v, DTensor):
                if any(isinstance(p, Partial) for p in v.placements):
                    raise ValueError(f"{name}: a 0-dim Partial DTensor argument must be reduced")
                v = v._local_tensor
        out.append(v)
    return out


def _check(name, dt) -> None:
    if any(isinstance(p, Partial) for p in dt.placements):
        raise NotImplementedError(
            f"{name} on a DTensor with Partial placements {dt.placements} is not supported"
        )


def random_op(func, args, kwargs):
    """Run random op `func` on the RaggedDTensor `args[0]`; see [Note: random ops on RaggedShard].

    `func` is a Tensor method / torch function (from `__torch_function__`) or an aten overload
    (from `__torch_dispatch__`).
    """
    name = _op_name(func)
    if not args:  # the tensor given by keyword
        kwargs = dict(kwargs)
        args = (kwargs.pop("input", kwargs.pop("self", None)),)
    dt = as_ragged(args[0])
    if not isinstance(dt, RaggedDTensor):
        raise NotImplementedError(f"{name}: expected a RaggedShard DTensor as its first argument")
    _check(name, dt)
    rest = _scalar_args(name, args[1:])
    kwargs = dict(zip(kwargs, _scalar_args(name, kwargs.values())))
    local = dt._local_tensor
    inplace = name.split(".")[0].endswith("_")  # "normal_" or aten's "normal_.default"
    if inplace and torch.is_grad_enabled() and dt.requires_grad:
        raise NotImplementedError(
            f"{name}: autograd does not flow through ops on RaggedShard DTensors; run it under "
            "torch.no_grad() (as torch.nn.init does)"
        )
    requires_grad = bool(kwargs.pop("requires_grad", False)) if not inplace else False
    full = torch.empty(dt.shape, dtype=local.dtype, device=local.device)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(full, *rest, **kwargs)
        piece = local_piece(out, dt._spec)
        if inplace:
            local.copy_(piece)
            return dt
        piece = piece.clone()
    return RaggedDTensor._wrap(piece, dt._spec, requires_grad=requires_grad)


# --- torch.nn.init functions that dispatch on subclasses -----------------------------------------
# These four call `handle_torch_function` on a tensor subclass, so `__torch_function__` receives
# the init function itself. They are re-run here on the DTensor, with torch's body, so that the
# in-place op inside reaches `random_op` (or the element-wise `fill_`).


def _init_normal_(tensor, mean=0.0, std=1.0, generator=None):
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator)


def _init_uniform_(tensor, a=0.0, b=1.0, generator=None):
    with torch.no_grad():
        return tensor.uniform_(a, b, generator=generator)


def _init_constant_(tensor, val):
    with torch.no_grad():
        return tensor.fill_(val)


def _init_kaiming_uniform_(
    tensor, a=0, mode="fan_in", nonlinearity="leaky_relu", generator=None
):
    if 0 in tensor.shape:
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=3)
        return tensor
    fan = torch.nn.init._calculate_correct_fan(tensor, mode)
    gain = torch.nn.init.calculate_gain(nonlinearity, a)
    bound = math.sqrt(3.0) * (gain / math.sqrt(fan))
    with torch.no_grad():
        return tensor.uniform_(-bound, bound, generator=generator)


def _torch_level() -> dict:
    table = {}
    for name in _INPLACE:
        table[getattr(torch.Tensor, name)] = lambda *a, _f=getattr(torch.Tensor, name), **k: (
            random_op(_f, a, k)
        )
    for name in _LIKE:
        table[getattr(torch, name)] = lambda *a, _f=getattr(torch, name), **k: random_op(_f, a, k)
    init = torch.nn.init
    table[init.normal_] = _init_normal_
    table[init.uniform_] = _init_uniform_
    table[init.constant_] = _init_constant_
    table[init.kaiming_uniform_] = _init_kaiming_uniform_
    return table


# `__torch_function__` entries: func -> handler(*args, **kwargs).
RANDOM_FUNCTIONS = _torch_level()
_INIT_BY_NAME = {
    name: RANDOM_FUNCTIONS[getattr(torch.nn.init, name)]
    for name in ("normal_", "uniform_", "constant_", "kaiming_uniform_")
}


def patched_init(func):
    """The handler of a `torch.nn.init` function reached under a patch of its name, or None.

    torch's `normal_`, `uniform_`, `constant_` and `kaiming_uniform_` pass the function that
    `torch.nn.init` *currently* holds under their name to `handle_torch_function`. Under a patch
    (transformers' `guard_torch_init_functions` replaces them by wrappers that skip tensors marked
    `_is_hf_initialized` and otherwise call torch's original), `__torch_function__` therefore
    receives the wrapper; the original is already running (the wrapper's check has passed), so
    it is served as torch's function of that name.
    """
    if type(func) is not types.FunctionType:
        return None
    init = torch.nn.init
    for name, handler in _INIT_BY_NAME.items():
        if getattr(init, name, None) is func:
            return handler
    return None
# aten packets served by `random_op` from `__torch_dispatch__`.
RANDOM_PACKETS = frozenset(getattr(aten, name) for name in _INPLACE + _LIKE)
