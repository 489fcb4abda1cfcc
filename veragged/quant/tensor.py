"""`BlockScaledWeight`: the unsharded parameter of a `compute="fp8"` weight ([Note: FP8 compute]
in linear.py).

A wrapper tensor subclass around the dequantised weight (the DBuffer's unsharded view, in the
param dtype) that also reaches the weight's gathered 8-bit data and scales. `F.linear` with it
as the weight runs `block_scaled_linear`; every other op sees the dequantised weight (the
subclass unwraps in `__torch_dispatch__`), so shapes, dtypes, tied uses, `.grad` and autograd
behave as for a plain parameter, and gradients are plain tensors.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from veragged.quant.formats import BlockFormat
from veragged.quant.linear import block_scaled_linear

__all__ = ["BlockScaledWeight"]

_aten = torch.ops.aten
_REWRAP = {_aten.detach.default, _aten.alias.default}


class BlockScaledWeight(torch.Tensor):
    """The dequantised weight `dequantized` (shape, dtype and device are its) and the owner of
    its 8-bit operands (`operands()`: E4M3 data [out, in] and GEMM-layout fp32 scales, valid
    while the owner is unsharded). Made by `QuantDBuffer` for each `compute="fp8"` tensor.
    """

    dequantized: torch.Tensor
    fmt: BlockFormat

    @staticmethod
    def __new__(cls, dequantized: torch.Tensor, fmt: BlockFormat, owner: weakref.ref,
                index: int, name: str):
        t = torch.Tensor._make_wrapper_subclass(
            cls, dequantized.shape, strides=dequantized.stride(), dtype=dequantized.dtype,
            device=dequantized.device, requires_grad=dequantized.requires_grad)
        t.dequantized, t.fmt = dequantized, fmt
        t._owner, t._index, t._name = owner, index, name
        return t

    def __init__(self, *args, **kwargs):
        super().__init__()

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E4M3 data [out, in], fp32 scales [out / tile, round_up(in / tile, 4)])."""
        owner = self._owner()
        if owner is None:
            raise RuntimeError(f"BlockScaledWeight {self._name!r}: its DBuffer is gone")
        return owner.gemm_operands(self._index)

    def _like(self, dequantized: torch.Tensor) -> "BlockScaledWeight":
        return BlockScaledWeight(dequantized, self.fmt, self._owner, self._index, self._name)

    def __repr__(self) -> str:
        return (f"BlockScaledWeight({self._name!r}, {self.fmt}, shape={list(self.shape)}, "
                f"dtype={self.dtype})")

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"BlockScaledWeight {self._name!r} is the unsharded view of a compute='fp8' "
            "weight during forward/backward; save the module's state_dict (the master "
            "parameters), not the unsharded parameter")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (isinstance(weight, cls) and not isinstance(x, cls)
                    and not isinstance(bias, cls)):
                return block_scaled_linear(x, weight, bias, weight.fmt, weight.operands)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REWRAP:
            return args[0]._like(func(args[0].dequantized))
        unwrap = lambda t: t.dequantized  # noqa: E731
        return func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
