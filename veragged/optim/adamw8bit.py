"""`AdamW8bit`: block-wise 8-bit AdamW whose state is the same for any world size.

[Note: AdamW8bit on RaggedShard]
bitsandbytes and torchao quantise each rank's local shard in blocks of 256 elements counted from
the shard's start, and decide 8-bit versus fp32 state from the shard's size, so the state (and
the training run) changes with the world size. Here a parameter's quantisation blocks are
defined on the *global* flattened tensor: block b is elements [b*block_size, (b+1)*block_size),
the last block may be partial. A parameter whose global numel is >= `min_8bit_size` gets 8-bit
state; each rank's shard must then hold whole blocks (start on a block boundary, end on one or
at the tensor's end), which `veragged.fully_shard(..., granularity_fn=adamw8bit_granularity())`
guarantees (under tensor parallelism, block sizes are restricted as [Note: AdamW8bit blocks under
TP] says). Each rank then updates its blocks with no communication, and since the kernel's
result for a block depends only on that block ([Note: AdamW8bit kernel]), codes, absmax and
parameters are bitwise those of a single process.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from veragged.optim.blocks import absmax_layout
from veragged.optim.common import (
    GradPresence,
    check_grad_agreement,
    consume_backward_verdicts,
    local,
    local_grads,
)
from veragged.optim.kernels import adamw8bit_multi_step_, dynamic_map, zero_code
from veragged.placement.api import from_local
from veragged.placement.layout import ragged_mesh_dim

__all__ = ["AdamW8bit", "adamw8bit_granularity"]

_8BIT_KEYS = ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax")
_FP32_KEYS = ("exp_avg", "exp_avg_sq")


def adamw8bit_granularity(
    block_size: int = 256, min_8bit_size: int = 4096
) -> Callable[[str, nn.Parameter], int | None]:
    """The `granularity_fn(fqn, param)` for `veragged.fully_shard` that never cuts a block.

    Rule, on the parameter's global numel n (use the optimizer's `block_size` and
    `min_8bit_size`):
    - n < min_8bit_size (fp32 state, element-wise math): None, any cut is fine;
    - n % block_size == 0: block_size;
    - otherwise n: the whole tensor stays on one rank. A granularity must divide n, and every cut
      at a multiple of a proper divisor g of n is a block boundary only if block_size divides g,
      which then divides n: so no smaller granularity keeps the partial last block whole.
    """
    _check_int("block_size", block_size, 1)
    _check_int("min_8bit_size", min_8bit_size, 0)

    def granularity(fqn: str, param: nn.Parameter) -> int | None:
        n = param.numel()
        if n == 0 or n < min_8bit_size:
            return None
        return block_size if n % block_size == 0 else n

    return granularity


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with block-wise 8-bit moments, for plain tensors and sharded DTensor parameters.

    Semantics are `torch.optim.AdamW(foreach=False)`'s, with decoupled weight decay applied first
    (`p *= 1 - lr*wd`), then `m = lerp(m, g, 1-b1)`, `v = b2*v + (1-b2)*g*g` and
    `p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`, bc_i = 1 - b_i^step; the math is fp32 for
    fp32, bf16 and fp16 parameters (gradients of the parameter's dtype).

    A parameter whose global numel is >= `min_8bit_size` keeps m and v as uint8 codes (one per
    element, signed dynamic map for m, unsigned for v) and one fp32 absmax per block of
    `block_size` elements of the global flattened tensor: 2 + 8/block_size bytes per parameter
    (2.03 for 256) instead of 8. Smaller parameters keep fp32 `exp_avg`/`exp_avg_sq` and are
    updated with torch's own ops in torch's order, so fp32 ones match `torch.optim.AdamW`
    bitwise. See [Note: AdamW8bit kernel] (csrc/optim/adamw8bit.h) for the quantisation and
    [Note: AdamW8bit on RaggedShard] for why the state does not depend on the world size.

    NaN/Inf: an element whose gradient is not finite is skipped by the 8-bit kernel (parameter
    untouched, its m and v set to 0), as in bitsandbytes; fp32-state parameters follow torch
    (non-finite values propagate).

    Parameters may be plain tensors or DTensors: a RaggedShard (e.g. from `veragged.fully_shard`;
    other mesh dims Replicate), a `Shard(0)` (torch FSDP2) or Replicate, and FSDP over tensor
    parallelism: `Shard(d)` on TP/EP mesh dims (one tensor dim d) with a RaggedShard or
    StridedRaggedShard on the FSDP dim and Replicate on an HSDP dim. No rank's shard may cut a
    quantisation block ([Note: AdamW8bit blocks under TP]): for one flat-range mesh dim every
    rank's range starts and ends on block boundaries (or at the tensor's end); under `Shard(d)`
    `block_size` must divide the TP-local row length `prod(local_shape[d:])` on every TP rank
    (for d = 0 the numel of each TP piece; e.g. a rowwise (4096, 11008) weight on tp=8 allows
    divisors of 1376), and each FSDP cut of a TP block must fall on a block boundary. Otherwise
    the constructor raises ValueError naming the parameter, the block size, the shapes and the
    rank; shard with `granularity_fn=adamw8bit_granularity(...)`.

    State, created for every parameter on every rank at construction: `step` (float32 scalar
    tensor, as torch) and either `exp_avg`/`exp_avg_sq` (fp32) or `exp_avg_codes`/
    `exp_avg_sq_codes` (uint8, shaped like the local shard) and `exp_avg_absmax`/
    `exp_avg_sq_absmax` (fp32, one per local block). For DTensor parameters they are DTensors:
    codes and fp32 moments with the parameter's placements, absmax 1-D of global shape
    (num_blocks,) with `RaggedShard((0,), blocks_per_rank)` on the sharded mesh dim (under
    `Shard(d)`: global shape `shape[:d] + (shape[d] // f, inner // g)`, placed like the
    parameter, [Note: AdamW8bit blocks under TP]), so `torch.distributed.checkpoint` saves them
    and reloads them on any dp and tp size. Gradients
    missing on some ranks are agreed on first, as `grad_agreement` says ([Note: symmetric grad
    presence]).

    One step launches the 8-bit kernel once per param group, dtype and device, for all its 8-bit
    parameters ([Note: AdamW8bit multi-tensor launch]): with `veragged.fully_shard`, one launch
    per DBuffer group and dtype.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        grad_agreement: str = "auto",
    ):
        self.grad_agreement = check_grad_agreement("AdamW8bit", grad_agreement)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            block_size=block_size,
            min_8bit_size=min_8bit_size,
        )
        _check_hyperparams(defaults)
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparams(group)
        names = group.get("param_names")
        index = len(self.param_groups) - 1
        for i, p in enumerate(group["params"]):
            name = names[i] if names else f"param_groups[{index}]['params'][{i}]"
            if p.is_complex():
                raise ValueError(f"AdamW8bit: parameter {name} is complex ({p.dtype}); complex "
                                 "parameters are not supported (torch.optim.AdamW steps them "
                                 "as pairs of reals: use it for those)")
            self.state[p] = self._new_state(p, group, name)

    def _new_state(self, p: torch.Tensor, group: dict, name: str) -> dict:
        state = {"step": torch.tensor(0.0, dtype=torch.float32)}
        loc = local(p)
        if not _is_8bit(p, group):
            for key in _FP32_KEYS:
                state[key] = _like_param(p, torch.zeros(loc.shape, dtype=torch.float32,
                                                        device=loc.device))
            return state
        bs = group["block_size"]
        layout = absmax_layout(p, bs, name)
        zs, zu = zero_code(True), zero_code(False)
        blocks = math.ceil(loc.numel() / bs)
        for key, zero in (("exp_avg", zs), ("exp_avg_sq", zu)):
            codes = torch.full(loc.shape, zero, dtype=torch.uint8, device=loc.device)
            absmax = torch.zeros(blocks, dtype=torch.float32, device=loc.device)
            state[f"{key}_codes"] = _like_param(p, codes)
            state[f"{key}_absmax"] = _absmax_like(p, absmax, layout)
        return state

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._qmaps:
            self._qmaps[device] = (dynamic_map(True, device), dynamic_map(False, device))
        return self._qmaps[device]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`; fully_shard's backward records of these parameters then serve
        no later step ([Note: grad verdicts for optimizers], dbuffer/grads.py)."""
        super().zero_grad(set_to_none)
        consume_backward_verdicts(p for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        presence = GradPresence(params, self.grad_agreement, type(self).__name__)
        grads = iter(local_grads(params, presence.verdicts()))
        for group in self.param_groups:
            launches: dict[tuple, _Launch] = {}  # (dtype, device) -> the 8-bit shards
            for p in group["params"]:
                g = next(grads)
                if g is not None:
                    self._step_param(p, g, group, self.state[p], launches)
            for launch in launches.values():
                launch.run(self._maps(launch.device), group)
        presence.finish()
        return loss

    def _step_param(self, p: torch.Tensor, g: torch.Tensor, group: dict, state: dict,
                    launches: dict) -> None:
        """Steps an fp32-state parameter now; adds an 8-bit one to its launch."""
        if g.is_sparse:
            raise ValueError("AdamW8bit does not support sparse gradients")
        loc = local(p)
        if g.shape != loc.shape:
            g = g.reshape(loc.shape)
        state["step"] += 1
        step = state["step"].item()
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        if "exp_avg_codes" in state:
            key = (loc.dtype, loc.device)
            if key not in launches:
                launches[key] = _Launch(loc.device)
            launches[key].add(loc, g, state, int(step))
            return
        else:
            # torch's _single_tensor_adam, op for op (so fp32 parameters match it bitwise).
            work = loc if loc.dtype == torch.float32 else loc.float()
            g = g.to(torch.float32)
            exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
            if wd != 0:
                work.mul_(1 - lr * wd)
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
            work.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if work is not loc:
            loc.copy_(work)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's `load_state_dict`, without its cast of every floating state tensor to the
        parameter's dtype (which would turn uint8 codes into floats and round fp32 absmax and
        moments to bf16). `block_size` and `min_8bit_size` must be those saved, and every
        parameter's state must have its layout's keys and dtypes; ValueError otherwise."""
        for i, (mine, saved) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
            for key in ("block_size", "min_8bit_size"):  # they fix the state's layout
                if saved.get(key) != mine[key]:
                    raise ValueError(
                        f"AdamW8bit.load_state_dict: param group {i} was saved with "
                        f"{key}={saved.get(key)!r} but this optimizer has {key}={mine[key]!r}"
                    )
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        groups = [(g, p) for g in self.param_groups for p in g["params"]]
        for pid, (group, p) in zip(saved_ids, groups):
            saved = state_dict["state"].get(pid)
            if saved is None:
                raise ValueError(
                    f"AdamW8bit.load_state_dict: no state for parameter {pid}; AdamW8bit "
                    "state dicts hold every parameter"
                )
            state = self.state[p]
            keys = _8BIT_KEYS if _is_8bit(p, group) else _FP32_KEYS
            missing = [k for k in keys if k not in saved]
            if missing:
                raise ValueError(
                    f"AdamW8bit.load_state_dict: parameter {pid} (shape {list(p.shape)}) needs "
                    f"state {missing} with block_size={group['block_size']}, "
                    f"min_8bit_size={group['min_8bit_size']}; the saved state has {sorted(saved)}"
                )
            for key in keys:
                value = saved[key].to(device=local(p).device)
                want = torch.uint8 if key.endswith("_codes") else torch.float32
                if value.dtype != want:
                    raise ValueError(
                        f"AdamW8bit.load_state_dict: parameter {pid} state {key!r} must be "
                        f"{want}, got {value.dtype}"
                    )
                state[key] = value


class _Launch:
    """The 8-bit shards of one param group, dtype and device: one kernel launch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.params: list[torch.Tensor] = []  # contiguous (copies of non-contiguous shards)
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[torch.Tensor] = []
        self.state: tuple[list[torch.Tensor], ...] = ([], [], [], [])
        self.steps: list[int] = []

    def add(self, loc: torch.Tensor, g: torch.Tensor, state: dict, step: int) -> None:
        work = loc if loc.is_contiguous() else loc.contiguous()
        if work is not loc:
            self.copy_back.append((loc, work))
        self.params.append(work)
        self.grads.append(g.contiguous())
        for out, key in zip(self.state, _8BIT_KEYS):
            out.append(local(state[key]))
        self.steps.append(step)

    def run(self, maps: tuple[torch.Tensor, torch.Tensor], group: dict) -> None:
        beta1, beta2 = group["betas"]
        adamw8bit_multi_step_(
            self.params, self.grads, *self.state, *maps, lr=group["lr"], beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], steps=self.steps,
            block_size=group["block_size"],
        )
        for loc, work in self.copy_back:
            loc.copy_(work)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"AdamW8bit: {name} must be an int >= {low}, got {value!r}")


def _check_hyperparams(group: dict) -> None:
    lr, eps, wd, betas = group["lr"], group["eps"], group["weight_decay"], group["betas"]
    if isinstance(lr, torch.Tensor):
        raise ValueError("AdamW8bit: lr must be a float, got a Tensor")
    if not 0.0 <= lr:
        raise ValueError(f"AdamW8bit: lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"AdamW8bit: eps must be >= 0, got {eps}")
    if not 0.0 <= wd:
        raise ValueError(f"AdamW8bit: weight_decay must be >= 0, got {wd}")
    if len(betas) != 2:
        raise ValueError(f"AdamW8bit: betas must be a pair, got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"AdamW8bit: betas[{i}] must be in [0, 1), got {b}")
    _check_int("block_size", group["block_size"], 1)
    _check_int("min_8bit_size", group["min_8bit_size"], 0)


def _is_8bit(p: torch.Tensor, group: dict) -> bool:
    n = p.numel()  # a DTensor's numel is the global one
    return n > 0 and n >= group["min_8bit_size"]


def _like_param(p: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """`loc` (this rank's part, shaped like p's local shard) as a tensor placed like `p`."""
    if not isinstance(p, DTensor):
        return loc
    return from_local(loc, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                      run_check=False)


def _absmax_like(p: torch.Tensor, loc: torch.Tensor, layout) -> torch.Tensor:
    """This rank's absmax as a tensor of all of `p`'s blocks (`layout`: its global shape and
    placements, [Note: AdamW8bit blocks under TP]; None for a plain tensor)."""
    if layout is None:
        return loc
    shape, placements = layout
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if ragged_mesh_dim(placements) is None:  # a torch DTensor: its local tensor has its shape
        loc = loc.view(compute_local_shape_and_global_offset(shape, p.device_mesh, placements)[0])
    return from_local(loc, p.device_mesh, placements, shape=shape, stride=stride,
                      run_check=False)
