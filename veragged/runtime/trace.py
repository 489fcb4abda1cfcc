"""Profiler ranges of fully_shard's phases, named once here.

[Note: trace ranges]
Every phase of an iteration opens a `record_function` range, so a profiler trace (CPU, and on
CUDA the kernels each range launched) reads as torch's FSDP2's does:
- A phase torch's FSDP2 also has gets torch's name (torch/distributed/fsdp/_fully_shard),
  with torch's suffix: the module's fqn relative to the root, `" (layers.0)"`, none for the
  root (`FSDPParamGroup._with_fqn`; the fqns of a `fully_shard([a, b])` group joined by ", ").
  - forward: `FSDP::root_pre_forward` (the iteration's first pre-forward: the wait for the
    optimizer), `FSDP::cast_forward_inputs`, `FSDP::pre_forward (m)` holding
    `FSDP::all_gather (m)` (copy-in and launch) and `FSDP::all_gather_copy_out (m)` (the wait,
    and a staged or dequantised copy), `FSDP::forward_prefetch for m`,
    `FSDP::post_forward (m)` (reshard), `FSDP::cast_forward_outputs`;
  - backward: `FSDP::pre_backward (m)` (all-gather again, gradient buffer, implicit
    `FSDP::backward_prefetch for m`), then per group `FSDP::post_backward_rs_wait (m)` (the
    oldest reduce-scatter finishing, torch's format: "()" for the root),
    `FSDP::post_backward_reduce (m)` (the reduce-scatter's launch), `FSDP::post_backward_reshard
    (m)`; `FSDP::root_post_backward_callback`; `FSDP::finalize_backward`.
  A state with several groups (one per DBuffer: dtype, requires_grad, mesh) opens the
  collective ranges once per group, under the same name.
- A phase that is ours gets a `veragged::` name, with the same suffix: `veragged::land_grads`
  (the gradients autograd stored landing in the gradient buffer, [Note: gradient landing]),
  `veragged::finish_reduce` (the wait for a reduce-scatter, HSDP all-reduce, and the write and
  binding of the sharded gradients), `veragged::resolve_grads` (gradients bound after their
  verdict or host copy, [Note: unreached parameters]), `veragged::quantize` and
  `veragged::dequantize` (block-scaled weights around the all-gather).
The ranges are opened by the hooks and the DBuffer, whichever runtime ([Note: streams and
events]) runs them, so the CPU runtime and the CUDA one trace the same ranges. With no profiler
active a range costs one check (`record_function` itself costs microseconds): a profiler
enabled on the calling thread (torch.profiler, torch.autograd.profiler, inherited by autograd's
threads) is seen; callbacks registered globally without one (an on-demand trace) are not.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import profiler as _autograd_profiler

__all__ = ["NO_RANGE", "enabled", "prefetch_label", "rs_wait_label", "trace", "trace_label",
           "with_fqn"]

# torch's FSDP2 names: the same phase, the same name.
ROOT_PRE_FORWARD = "FSDP::root_pre_forward"
CAST_FORWARD_INPUTS = "FSDP::cast_forward_inputs"
CAST_FORWARD_OUTPUTS = "FSDP::cast_forward_outputs"
PRE_FORWARD = "FSDP::pre_forward"
POST_FORWARD = "FSDP::post_forward"
ALL_GATHER = "FSDP::all_gather"
ALL_GATHER_COPY_OUT = "FSDP::all_gather_copy_out"
PRE_BACKWARD = "FSDP::pre_backward"
POST_BACKWARD_RS_WAIT = "FSDP::post_backward_rs_wait"
POST_BACKWARD_REDUCE = "FSDP::post_backward_reduce"
POST_BACKWARD_RESHARD = "FSDP::post_backward_reshard"
ROOT_POST_BACKWARD_CALLBACK = "FSDP::root_post_backward_callback"
FINALIZE_BACKWARD = "FSDP::finalize_backward"

# Ours.
LAND_GRADS = "veragged::land_grads"
FINISH_REDUCE = "veragged::finish_reduce"
RESOLVE_GRADS = "veragged::resolve_grads"
QUANTIZE = "veragged::quantize"
DEQUANTIZE = "veragged::dequantize"

NO_RANGE = contextlib.nullcontext()
_thread_profiler_enabled = torch._C._autograd._profiler_enabled


def enabled() -> bool:
    """Whether a profiler records ranges opened here now."""
    return _thread_profiler_enabled() or _autograd_profiler._is_profiler_enabled


def with_fqn(name: str, fqn: str = "") -> str:
    """`name` with torch's module suffix: `"FSDP::pre_forward (layers.0)"`; the root's fqn is
    empty, and gets none."""
    return f"{name} ({fqn})" if fqn else name


def trace(name: str, fqn: str = ""):
    """A `record_function` range `with_fqn(name, fqn)` while a profiler is active, else a
    no-op context."""
    if not enabled():
        return NO_RANGE
    return _autograd_profiler.record_function(with_fqn(name, fqn))


def rs_wait_label(fqn: str) -> str:
    """torch's `post_backward_rs_wait` label: the fqn always in parentheses."""
    return f"{POST_BACKWARD_RS_WAIT} ({fqn})"


def prefetch_label(pass_type: str, fqn: str) -> str:
    """torch's prefetch label (`pass_type` "forward" or "backward")."""
    return f"FSDP::{pass_type}_prefetch for {fqn}"


def trace_label(label_fn, *args):
    """A range labelled `label_fn(*args)` (built only while a profiler is active)."""
    if not enabled():
        return NO_RANGE
    return _autograd_profiler.record_function(label_fn(*args))
