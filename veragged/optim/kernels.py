"""Python side of the 8-bit AdamW kernel: the quantisation maps, the fake kernel, the wrapper.

The kernels are C++ (CPU) and CUDA; see [Note: AdamW8bit kernel] in csrc/optim/adamw8bit.h.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from veragged.runtime import caches

__all__ = ["adamw8bit_multi_step_", "dynamic_map", "zero_code"]

QMAP_SIZE = 256


@caches.register_function("optim.kernels dynamic maps")
@functools.lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    # Dettmers' dynamic exponent/fraction code, built as bitsandbytes'
    # create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for each decade
    # 10^-6 .. 10^0, the midpoints of an even split of [0.1, 1] (1, 2, 4, ... 64 of them signed,
    # twice as many unsigned), scaled by the decade in fp32; mirrored when signed; plus 0 and 1.
    # Constants, made with real tensors even under FakeTensorMode (memory estimates), where the
    # optimizer's states are then fake copies of them.
    with unset_fake_temporarily():
        return _build_map(signed)


def _build_map(signed: bool) -> torch.Tensor:
    values = [0.0, 1.0]
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        mids = (bounds[:-1] + bounds[1:]) / 2.0
        decade = (10 ** (i - 6)) * mids
        values += decade.tolist()
        if signed:
            values += (-decade).tolist()
    assert len(values) == QMAP_SIZE, len(values)
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 sorted fp32 values of the dynamic quantisation map (signed: m, unsigned: v).

    Same values as bitsandbytes' `create_dynamic_map(signed, 7, 8)`. A fresh tensor each call.
    """
    return _dynamic_map_cpu(bool(signed)).to(device=device, copy=True)


@caches.register_function("optim.kernels zero codes")
@functools.lru_cache(maxsize=None)
def zero_code(signed: bool) -> int:
    """The code of 0.0 in `dynamic_map(signed)`: what a zero moment is stored as."""
    with unset_fake_temporarily():
        return int((_dynamic_map_cpu(bool(signed)) == 0).nonzero()[0, 0])


_NAMES = ("params", "grads", "m_codes", "v_codes", "m_absmax", "v_absmax")


def _check_tensor(op, index, tensors, dtype, device, step, block_size) -> None:
    """check_adamw8bit_tensor (csrc/optim/adamw8bit.h) on metadata: the arguments of tensor
    `index` of the lists, named `params[index]`, `grads[index]`, ..."""
    at = f"[{index}]"
    if step < 1:
        raise ValueError(f"{op}: steps{at} must be >= 1, got {step}")
    param = tensors[0]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: {_NAMES[0]}{at} must be float32, bfloat16 or float16, got {dtype}")
    if param.dtype != dtype:
        raise ValueError(f"{op}: {_NAMES[0]}{at} is {param.dtype} but the first param is {dtype} "
                         "(one launch takes one dtype)")
    if tensors[1].dtype != dtype:
        raise ValueError(f"{op}: {_NAMES[1]}{at} dtype {tensors[1].dtype} differs from param "
                         f"dtype {dtype}")
    n = param.numel()
    blocks = -(-n // block_size)
    wants = ((dtype, n), (dtype, n), (torch.uint8, n), (torch.uint8, n),
             (torch.float32, blocks), (torch.float32, blocks))
    for name, t, (want, numel) in zip(_NAMES, tensors, wants):
        if t.dtype != want:
            raise ValueError(f"{op}: {name}{at} must be {want}, got {t.dtype}")
        if t.numel() != numel:
            raise ValueError(f"{op}: {name}{at} must have {numel} elements (param has {n}, "
                             f"block_size {block_size}), got {t.numel()}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name}{at} must be contiguous")
        if t.device != device:
            raise ValueError(f"{op}: {name}{at} is on {t.device} but param is on {device}")


def _check_qmaps(op, qmap_signed, qmap_unsigned, device) -> None:
    for name, q in (("qmap_signed", qmap_signed), ("qmap_unsigned", qmap_unsigned)):
        if q.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be {torch.float32}, got {q.dtype}")
        if q.numel() != QMAP_SIZE:
            raise ValueError(f"{op}: {name} must have {QMAP_SIZE} elements, got {q.numel()}")
        if not q.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        if q.device != device:
            raise ValueError(f"{op}: {name} is on {q.device} but param is on {device}")


def _check_block_size(op, block_size) -> None:
    if block_size <= 0:
        raise ValueError(f"{op}: block_size must be > 0, got {block_size}")


@torch.library.register_fake("veragged::adamw8bit_multi_step_")
def _adamw8bit_multi_step_fake(params, grads, m_codes, v_codes, m_absmax, v_absmax, qmap_signed,
                               qmap_unsigned, lr, beta1, beta2, eps, weight_decay, steps,
                               block_size):
    op = "adamw8bit_multi_step_"
    _check_block_size(op, block_size)
    lists = (grads, m_codes, v_codes, m_absmax, v_absmax, steps)
    for name, values in zip(_NAMES[1:] + ("steps",), lists):
        if len(values) != len(params):
            raise ValueError(f"{op}: {name} has {len(values)} entries but params has "
                             f"{len(params)}")
    if not params:
        return
    dtype, device = params[0].dtype, params[0].device
    _check_qmaps(op, qmap_signed, qmap_unsigned, device)
    for i, tensors in enumerate(zip(params, grads, m_codes, v_codes, m_absmax, v_absmax)):
        _check_tensor(op, i, tensors, dtype, device, steps[i], block_size)


def adamw8bit_multi_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    m_codes: list[torch.Tensor],
    v_codes: list[torch.Tensor],
    m_absmax: list[torch.Tensor],
    v_absmax: list[torch.Tensor],
    qmap_signed: torch.Tensor,
    qmap_unsigned: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    steps: list[int],
    block_size: int,
) -> None:
    """One fused 8-bit AdamW step of every flat shard of the lists in one kernel launch, all in
    place.

    Every list holds one entry per shard, each shard holding whole blocks: `params[i]`/`grads[i]`
    share one dtype (fp32, bf16 or fp16) and device across the lists; `m_codes[i]`/`v_codes[i]`:
    uint8, one per element; `m_absmax[i]`/`v_absmax[i]`: fp32, one per block of `block_size`
    elements (the last may be partial); `qmap_*`: `dynamic_map(True)` / `dynamic_map(False)`;
    `steps[i]`: shard i's step number after this update (>= 1). The results are bitwise those of
    one call per shard ([Note: AdamW8bit kernel], [Note: AdamW8bit multi-tensor launch]).
    """
    torch.ops.veragged.adamw8bit_multi_step_(
        params, grads, m_codes, v_codes, m_absmax, v_absmax, qmap_signed, qmap_unsigned,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        [int(s) for s in steps], int(block_size),
    )
