"""Profiler ranges of one training step ([Note: trace ranges] in veragged/runtime/trace.py).

Two gloo ranks run a forward and backward of a root with two sharded blocks under
`torch.profiler.profile(activities=[CPU])` and read the ranges back from the profiler's events.
On each rank every phase's range is there, with torch's name and module suffix where torch's
FSDP2 has the phase and a `veragged::` name where it is ours, nested and in the order the
iteration runs them (`EXPECTED`). The torch-named ranges are those torch's own fully_shard
opens for the same step: the same names, each as many times. The ranges come from the hooks
and the DBuffer, not from the runtime's streams: the same tree appears under the
current-stream runtime (the CPU's; the CUDA one under `VERAGGED_TEST_DEVICE=cuda`) and under
the happens-before recorder's virtual side streams (the deferring path of the CUDA runtime).
Block-scaled 8-bit weights add their quantisation inside the all-gather and their
dequantisation inside the copy-out.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile

import veragged
from tests.fsdp._reference import Block
from tests.harness import get_mesh, run_on_ranks
from veragged.runtime import trace as tr
from veragged.runtime import use_runtime
from veragged.tools.happens_before import recorder_factory

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}

# One step of veragged's fully_shard on `Model` (2 ranks, default settings: the root keeps its
# parameters after forward, one reduce-scatter in flight), a range per line, indented under the
# range it runs in. The blocks' inputs need no gradient (the first block's is the data), so the
# post-backwards of the root and of layers.0 run in the root's end-of-backward callback, as
# torch's do.
EXPECTED = """
FSDP::root_pre_forward
FSDP::cast_forward_inputs
FSDP::pre_forward
  FSDP::all_gather
  FSDP::all_gather_copy_out
FSDP::cast_forward_inputs
FSDP::pre_forward (layers.0)
  FSDP::all_gather (layers.0)
  FSDP::all_gather_copy_out (layers.0)
FSDP::post_forward (layers.0)
FSDP::cast_forward_inputs
FSDP::pre_forward (layers.1)
  FSDP::all_gather (layers.1)
  FSDP::all_gather_copy_out (layers.1)
FSDP::post_forward (layers.1)
FSDP::post_forward
FSDP::cast_forward_outputs
FSDP::pre_backward
  FSDP::backward_prefetch for layers.1
    FSDP::all_gather (layers.1)
FSDP::pre_backward (layers.1)
  FSDP::all_gather_copy_out (layers.1)
  FSDP::backward_prefetch for layers.0
    FSDP::all_gather (layers.0)
FSDP::post_backward_reshard (layers.1)
FSDP::post_backward_reduce (layers.1)
  veragged::land_grads (layers.1)
FSDP::pre_backward (layers.0)
  FSDP::all_gather_copy_out (layers.0)
FSDP::root_post_backward_callback
  FSDP::post_backward_reshard
  FSDP::post_backward_rs_wait ()
    veragged::finish_reduce (layers.1)
  FSDP::post_backward_reduce
    veragged::land_grads
  FSDP::post_backward_reshard (layers.0)
  FSDP::post_backward_rs_wait (layers.0)
    veragged::finish_reduce
  FSDP::post_backward_reduce (layers.0)
    veragged::land_grads (layers.0)
  veragged::finish_reduce (layers.0)
"""


def _tree(text: str) -> list[tuple[int, str]]:
    """(depth, name) per line of `EXPECTED`-style text."""
    return [((len(line) - len(line.lstrip())) // 2, line.strip())
            for line in text.strip("\n").splitlines()]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _is_ours(e) -> bool:
    """A range opened by fully_shard (`record_function`; not an op like `veragged::land_`)."""
    user = getattr(e, "is_user_annotation", None)
    if user is None:
        user = e.scope == int(torch._C._profiler.RecordScope.USER_SCOPE)
    return user and e.name.startswith(("FSDP::", "veragged::"))


def _step_ranges(impl: str, runtime: str = "current", quant: bool = False):
    """The ranges of the second step (the first one initialises), as (depth, name) by start;
    depth counts the enclosing ranges that are fully_shard's."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    root_mp = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.float64)
    extra = {}
    if quant:  # the blocks' matrices all-gathered in 8 bits
        fmt = veragged.BlockFP8()
        extra = {"quant_fn": lambda n, p: fmt if p.ndim == 2 else None}
    torch.manual_seed(0)
    with contextlib.ExitStack() as stack:
        if runtime == "recorder":
            stack.enter_context(use_runtime(recorder_factory([])))
        model = Model()
        for layer in model.layers:
            IMPLS[impl](layer, mesh=get_mesh(), mp_policy=mp, **extra)
        IMPLS[impl](model, mesh=get_mesh(), mp_policy=root_mp)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x).sum().backward()
    ranges = []
    for e in prof.events():
        if not _is_ours(e):
            continue
        depth, p = 0, e.cpu_parent
        while p is not None:
            depth += _is_ours(p)
            p = p.cpu_parent
        ranges.append((e.time_range.start, depth, e.name))
    return [(d, n) for _, d, n in sorted(ranges)]


def _show(ranges) -> str:
    return "\n".join("  " * d + n for d, n in ranges)


@pytest.mark.parametrize("runtime", [
    "current",
    pytest.param("recorder", marks=pytest.mark.cpu_only("the recorder stands in for the CUDA "
                                                        "runtime's streams on the CPU")),
])
def test_step_ranges_in_order_on_each_rank(runtime):
    per_rank = run_on_ranks(_step_ranges, 2, args=("veragged", runtime))
    for rank, ranges in enumerate(per_rank):
        assert ranges == _tree(EXPECTED), f"rank {rank}:\n{_show(ranges)}"


# Ranges older torches open that ours has no phase for: torch 2.11 wraps its per-parameter
# accumulation of unsharded gradients (`accumulate_unsharded_grad_if_needed`) in one each
# post-backward, gone by 2.15; ours adds gradients up in the landing ([Note: gradient landing]).
TORCH_ONLY = {"FSDP::post_backward_accumulate"}


def test_torch_named_ranges_are_torchs():
    """Each torch-named range is opened as often as torch's fully_shard opens it in the same
    step; ours only add `veragged::` ranges (and torch-named ones the installed torch lacks)."""
    expected = collections.Counter(n for _, n in _tree(EXPECTED) if n.startswith("FSDP::"))
    ours = run_on_ranks(_step_ranges, 2, args=("veragged",))
    theirs = run_on_ranks(_step_ranges, 2, args=("torch",))
    for rank in range(2):
        torch_names = collections.Counter(n for _, n in theirs[rank])
        assert torch_names, "torch's fully_shard opened no range"
        mine = collections.Counter(n for _, n in ours[rank] if n.startswith("FSDP::"))
        differ = {n: (mine[n], c) for n, c in torch_names.items()
                  if mine[n] != c and n.split(" (")[0] not in TORCH_ONLY}
        assert not differ, f"rank {rank}: (ours, torch's) times opened: {differ}"
        assert set(mine) - set(torch_names) <= {"FSDP::post_backward_rs_wait ()",
                                                "FSDP::post_backward_rs_wait (layers.0)"}
        assert mine == expected


def _with_conversions(tree: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """`tree` for blocks whose matrices are block-scaled 8-bit: each forward all-gather of a
    block quantises this rank's slot first, each copy-out dequantises every rank's tiles (the
    backward all-gathers send the bytes the forward quantised)."""
    out = []
    for d, n in tree:
        out.append((d, n))
        base, _, fqn = n.partition(" (")
        if not fqn.startswith("layers."):
            continue
        if base == "FSDP::all_gather" and d == 1:  # in the pre-forward, not a prefetch
            out.append((d + 1, f"veragged::quantize ({fqn}"))
        elif base == "FSDP::all_gather_copy_out":
            out.append((d + 1, f"veragged::dequantize ({fqn}"))
    return out


def test_quantized_weights_trace_their_conversions():
    per_rank = run_on_ranks(_step_ranges, 2, args=("veragged", "current", True))
    expected = _with_conversions(_tree(EXPECTED))
    assert len(expected) == len(_tree(EXPECTED)) + 6
    for rank, ranges in enumerate(per_rank):
        assert ranges == expected, f"rank {rank}:\n{_show(ranges)}"


def test_no_range_without_a_profiler():
    """Outside a profile a range is the shared no-op context (no `record_function`, whose
    dispatch costs microseconds per phase); inside one it records."""
    assert tr.trace(tr.PRE_FORWARD, "layers.0") is tr.NO_RANGE
    assert tr.trace_label(tr.prefetch_label, "forward", "layers.0") is tr.NO_RANGE
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with tr.trace(tr.PRE_FORWARD, "layers.0"):
            pass
        with tr.trace_label(tr.rs_wait_label, ""):
            pass
    names = [e.name for e in prof.events() if _is_ours(e)]
    assert names == ["FSDP::pre_forward (layers.0)", "FSDP::post_backward_rs_wait ()"]
