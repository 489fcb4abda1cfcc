"""fully_shard's stream orderings, checked on the CPU ([Note: streams and events] in
veragged/runtime/streams.py; the checker: veragged/tools/happens_before.py).

The training loops run under the happens-before recorder, whose virtual streams order work as an
accelerator's would. For each loop (1-D, mixed precision, HSDP, no reshard after forward,
`reshard_after_forward=2`, no-sync accumulation, activation checkpointing, CPU offload, two
forwards before one backward, frozen and unused modules, a custom reduce-scatter comm, torch's
Shard(1) chunks, FSDP over TP on a dp x tp mesh, expert parallelism) the tests
assert that
  (a) no buffer is read on one stream before the write that produced it on another is ordered
      before the read by an event or stream wait,
  (b) no buffer is freed or rewritten while a use on another stream may still run,
  (c) the all-gather of each block in forward does not wait for the compute of the block before
      it (implicit prefetch), nor in backward for the compute of the block after it,
  (d) a block's reduce-scatter does not hold back the backward compute of the block before it,
  (e) at most two blocks' unsharded buffers are alive at once besides the root's (FSDP2's bound),
and that deliberately broken runtimes (a missing wait, a free before the wait, a forgotten
post-optim ordering, an all-gather waiting for compute, a synchronous reduce-scatter) make these
checks fail. Values are checked too: the recorded run trains as the plain CPU run does, bitwise.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

import veragged
from tests.fsdp._reference import Block
from veragged.fsdp.group import ParamGroup
from veragged.runtime import use_runtime
from veragged.runtime.streams import DeferringStreams, Streams
from tests.harness import get_mesh, run_on_ranks
from veragged.tools.happens_before import Recorder, recorder_factory

BLOCKS, STEPS = 4, 2


class Model(nn.Module):
    def __init__(self, checkpointed: bool = False, unused: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(16, 4)
        self.spare = Block() if unused else None  # sharded, never run
        self.checkpointed = checkpointed

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return self.head(x)


def _data(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g)


def _build(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = Model(checkpointed=variant == "checkpoint", unused=variant == "frozen_unused")
    kw: dict = {"mesh": get_mesh()}
    if variant == "mixed_precision":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if variant == "no_reshard":
        kw["reshard_after_forward"] = False
    if variant == "reshard_to_2":
        kw["reshard_after_forward"] = 2
    if variant == "chunked":  # torch's Shard(1) chunks: gathered, then copied into place
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    if variant == "offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    if variant == "frozen_unused":
        for p in model.blocks[1].parameters():
            p.requires_grad_(False)
    blocks = list(model.blocks) + ([model.spare] if model.spare is not None else [])
    for b in blocks:
        veragged.fully_shard(b, **kw)
    veragged.fully_shard(model, **kw)
    if variant == "custom_rs":
        from tests.fsdp.test_custom_comms import RecordingReduceScatter
        model.set_custom_reduce_scatter(RecordingReduceScatter())
    return model


def _build_parallel(variant: str):
    """The TP (dp 2 x tp 2) Llama of tests/fsdp/test_tp.py or the EP (ep 2 in 4 ranks) MoE of
    tests/fsdp/test_ep.py, sharded by veragged; (model, loss of a step)."""
    import torch.distributed as dist

    if variant == "tp":
        from tests.fsdp.test_tp import _build_llama, _dp_index, _tokens
        mesh, model = _build_llama("veragged", (2, 2))
        return model, lambda step: model.loss(_tokens(step, _dp_index(mesh)))
    from tests.fsdp.test_ep import CFG, _shard_moe, _tokens
    model = _shard_moe("veragged", CFG, 2)
    return model, lambda step: model.loss(_tokens(step, dist.get_rank()))


def _train(variant: str, record: bool, broken: str = ""):
    """Train STEPS steps; with `record`, under the recorder. Returns the final parameters and,
    recorded, (violations, forward overlap misses, backward overlap misses, counts)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    recs: list[Recorder] = []
    with contextlib.ExitStack() as stack:
        if record:
            stack.enter_context(use_runtime(recorder_factory(recs)))
            for patch in _breakage(broken):
                stack.enter_context(patch)
        if variant in ("tp", "ep"):
            model, step_loss = _build_parallel(variant)
        else:
            model = _build(variant)
            step_loss = None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        def mark(label: str) -> None:
            if recs:
                recs[0].mark(label)

        def forward(x):
            mark("forward")
            return step_loss(x) if step_loss is not None else model(x).sum()

        for step in range(STEPS):
            if variant == "no_sync":
                model.set_requires_gradient_sync(False)
                loss = forward(_data(step, rank + 10))
                mark("backward")
                loss.backward()
                model.set_requires_gradient_sync(True)
            loss = forward(step if step_loss is not None else _data(step, rank))
            if variant == "two_forwards":
                loss = loss + forward(_data(step, rank + 20))
            mark("backward")
            loss.backward()
            opt.step()
            opt.zero_grad()
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
    if not record:
        return params, None
    rec = recs[0]
    return params, (list(rec.violations), _forward_overlap(rec), _backward_overlap(rec),
                    _counts(rec))


def _phases(rec: Recorder, kind: str) -> list[list]:
    """The ops of each forward (kind "forward") or backward phase, in order."""
    out, cur = [], None
    for op in rec.log:
        if op.kind == "mark":
            cur = [] if op.name.startswith(kind) else None
            if cur is not None:
                out.append(cur)
        elif cur is not None:
            cur.append(op)
    return out


def _forward_overlap(rec: Recorder) -> list[str]:
    """(c) in forward: each block's all-gather does not wait for the previous block's compute
    (the compute's read of its unsharded buffer, recorded when its forward was queued)."""
    misses = []
    for ops in _phases(rec, "forward"):
        last_read = None
        for op in ops:
            if op.kind == "read" and op.stream == "compute" and op.key[1] == "unsharded":
                last_read = op
            if op.kind == "write" and op.name == "all_gather" and last_read is not None:
                if last_read.key != op.key and Recorder.depends_on(op, last_read):
                    misses.append(f"forward all-gather of {op.key} waits for the compute of "
                                  f"{last_read.key}")
    return misses


def _backward_overlap(rec: Recorder) -> list[str]:
    """(c) and (d) in backward: an all-gather does not wait for the compute of the block being
    differentiated when it was launched, and the compute of a block does not wait for the
    reduce-scatter of the block after it."""
    misses = []
    for ops in _phases(rec, "backward"):
        rs_writes, computed = [], None
        for op in ops:
            if op.kind == "write" and op.name == "reduce_scatter":
                rs_writes.append(op)
            if op.kind == "read" and op.stream == "compute" and op.key[1] == "unsharded":
                computed = op
                if rs_writes and Recorder.depends_on(op, rs_writes[-1]):
                    misses.append(f"backward compute of {op.key} waits for the reduce-scatter "
                                  f"of {rs_writes[-1].key}")
            if op.kind == "write" and op.name == "all_gather" and computed is not None:
                # launched after `computed`'s compute finished queuing: the block before it in
                # forward is prefetched while the next one computes, never after it
                later = [o for o in ops if o.kind == "read" and o.stream == "compute"
                         and o.key[1] == "unsharded" and o.tick > computed.tick
                         and o.key == op.key]
                if later and Recorder.depends_on(op, later[0]):
                    misses.append(f"backward all-gather of {op.key} waits for its own compute")
    return misses


def _counts(rec: Recorder) -> dict:
    return {
        "all_gathers": len(rec.ops("launch", name="all_gather")),
        "reduce_scatters": len(rec.ops("launch", name="reduce_scatter")),
        "all_reduces": len(rec.ops("launch", name="all_reduce")),
        "collectives_on_compute": len([o for o in rec.log if o.kind == "launch" and o.name in (
            "all_gather", "reduce_scatter", "all_reduce") and o.stream == "compute"]),
        "pending_after": len(rec._pending),
        "peak_unsharded": rec.peak.get("unsharded", 0),
    }


def _breakage(broken: str) -> list:
    """Patches that remove one ordering of the runtime (the checker must then fail)."""
    if broken == "":
        return []
    if broken == "missing_wait":  # the compute stream does not wait for the all-gather
        def wait_for(self, handle, stream=None):
            Streams.wait_for(self, handle)
        return [mock.patch.object(Recorder, "wait_for", wait_for)]
    if broken == "free_before_wait":  # releases free at once, without the event
        def release(self, key, tensor, stream, mode="free"):
            Streams.release(self, key, tensor, stream, mode)
        return [mock.patch.object(DeferringStreams, "release", release)]
    if broken == "no_post_optim_order":  # the first all-gathers do not wait for the step
        return [mock.patch.object(Recorder, "wait_stream", lambda self, a, b=None: None)]
    if broken == "gather_waits_compute":  # every all-gather waits for the compute stream
        orig = ParamGroup.unshard

        def unshard(self, async_op=False):
            rt = self.buffer.rt
            rt.wait_stream(rt.stream("all_gather"))
            return orig(self, async_op)
        return [mock.patch.object(ParamGroup, "unshard", unshard)]
    if broken == "sync_reduce":  # the compute stream waits for each reduce-scatter at once
        orig = ParamGroup.post_backward

        def post_backward(self, ctx):
            orig(self, ctx)
            if self in ctx.reducing:
                ctx.reducing.remove(self)
                self.finish_reduce()
        return [mock.patch.object(ParamGroup, "post_backward", post_backward)]
    raise ValueError(broken)


VARIANTS = {  # variant: (world, mesh kwargs)
    "plain": (2, {}),
    "mixed_precision": (2, {}),
    "no_reshard": (2, {}),
    "reshard_to_2": (4, {}),
    "hsdp": (4, dict(mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard"))),
    "no_sync": (2, {}),
    "checkpoint": (2, {}),
    "offload": (2, {}),
    "two_forwards": (2, {}),
    "frozen_unused": (2, {}),
    "custom_rs": (2, {}),
    "chunked": (2, {}),
    "tp": (4, {}),  # the model makes its own meshes
    "ep": (4, {}),
}


def _run(variant: str, broken: str = ""):
    world, kw = VARIANTS[variant]
    return run_on_ranks(_train, world, args=(variant if variant != "hsdp" else "plain", True,
                                             broken), timeout=180, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_orderings_hold(variant):
    world, kw = VARIANTS[variant]
    plain = run_on_ranks(_train, world, args=(variant if variant != "hsdp" else "plain", False),
                         timeout=180, **kw)
    recorded = _run(variant)
    for (p_params, _), (r_params, (violations, fwd, bwd, counts)) in zip(plain, recorded):
        assert violations == [], violations[:5]
        assert fwd == [] and bwd == [], (fwd + bwd)[:5]
        assert counts["all_gathers"] > 0 and counts["reduce_scatters"] > 0, counts
        assert counts["collectives_on_compute"] == 0, counts
        assert counts["pending_after"] == 0, counts
        if variant == "hsdp":
            assert counts["all_reduces"] > 0, counts
        if variant in ("plain", "mixed_precision", "hsdp", "frozen_unused"):
            # as FSDP2: the block computing and the next one gathering, besides the root,
            # which keeps its parameters from forward to backward
            assert counts["peak_unsharded"] <= 3, counts
        for n, p in p_params.items():  # the recorder changes no value
            assert torch.equal(p, r_params[n]), n


@pytest.mark.parametrize("broken,check", [
    ("missing_wait", "violations"),
    ("free_before_wait", "violations"),
    ("no_post_optim_order", "violations"),
    ("gather_waits_compute", "forward"),
    ("sync_reduce", "backward"),
])
def test_broken_runtimes_are_caught(broken, check):
    res = _run("plain", broken)
    for _, (violations, fwd, bwd, _) in res:
        found = {"violations": violations, "forward": fwd, "backward": bwd}[check]
        assert found, (broken, violations[:3], fwd[:3], bwd[:3])
