"""Python side of the 8-bit AdamW kernel: the quantisation maps, the fake kernel, the wrapper.

The kernels are C++ (CPU) and CUDA; see [Note: AdamW8bit kernel] in csrc/optim/adamw8bit.h.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["adamw8bit_step_", "dynamic_map"]

QMAP_SIZE = 256


@functools.lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    # Dettmers' dynamic exponent/fraction code, built as bitsandbytes'
    # create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for each decade
    # 10^-6 .. 10^0, the midpoints of an even split of [0.1, 1] (1, 2, 4, ... 64 of them signed,
    # twice as many unsigned), scaled by the decade in fp32; mirrored when signed; plus 0 and 1.
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


def _check(param, grad, m_codes, v_codes, m_absmax, v_absmax, qmap_signed, qmap_unsigned,
           step, block_size) -> None:
    """The checks of check_adamw8bit_args (csrc/optim/adamw8bit.h), on metadata only."""
    op = "adamw8bit_step_"
    if block_size <= 0:
        raise ValueError(f"{op}: block_size must be > 0, got {block_size}")
    if step < 1:
        raise ValueError(f"{op}: step must be >= 1, got {step}")
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: param must be float32, bfloat16 or float16, got {param.dtype}")
    n = param.numel()
    blocks = -(-n // block_size)
    expected = {
        "param": (param, param.dtype, n),
        "grad": (grad, param.dtype, n),
        "m_codes": (m_codes, torch.uint8, n),
        "v_codes": (v_codes, torch.uint8, n),
        "m_absmax": (m_absmax, torch.float32, blocks),
        "v_absmax": (v_absmax, torch.float32, blocks),
        "qmap_signed": (qmap_signed, torch.float32, QMAP_SIZE),
        "qmap_unsigned": (qmap_unsigned, torch.float32, QMAP_SIZE),
    }
    for name, (t, dtype, numel) in expected.items():
        if t.dtype != dtype:
            raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")
        if t.numel() != numel:
            raise ValueError(
                f"{op}: {name} must have {numel} elements (param has {n}, block_size "
                f"{block_size}), got {t.numel()}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        if t.device != param.device:
            raise ValueError(f"{op}: {name} is on {t.device} but param is on {param.device}")


@torch.library.register_fake("veragged::adamw8bit_step_")
def _adamw8bit_step_fake(param, grad, m_codes, v_codes, m_absmax, v_absmax, qmap_signed,
                         qmap_unsigned, lr, beta1, beta2, eps, weight_decay, step, block_size):
    _check(param, grad, m_codes, v_codes, m_absmax, v_absmax, qmap_signed, qmap_unsigned,
           step, block_size)


def adamw8bit_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    v_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_absmax: torch.Tensor,
    qmap_signed: torch.Tensor,
    qmap_unsigned: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    block_size: int,
) -> None:
    """One fused 8-bit AdamW step of a flat shard holding whole blocks, all in place.

    `param`/`grad`: the shard (same dtype: fp32, bf16 or fp16); `m_codes`/`v_codes`: uint8,
    one per element; `m_absmax`/`v_absmax`: fp32, one per block of `block_size` elements (the
    last may be partial); `qmap_*`: `dynamic_map(True)` / `dynamic_map(False)`; `step`: the
    step number after this update (>= 1). See [Note: AdamW8bit kernel].
    """
    torch.ops.veragged.adamw8bit_step_(
        param, grad, m_codes, v_codes, m_absmax, v_absmax, qmap_signed, qmap_unsigned,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step),
        int(block_size),
    )
