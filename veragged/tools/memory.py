"""Peak memory of a training step by kind and phase, and "does this fit at N ranks".

Built on torch's `MemTracker` (torch.distributed._tools.mem_tracker), which counts every tensor
storage an op allocates, by the kind torch gives it: parameter, buffer, gradient, activation
(allocated in forward), temporary (allocated in backward), optimizer state, other.

- `tracked_step(build, batch, ...)`: build a sharded model and its optimizer under the tracker
  (so every buffer a FSDP keeps is seen from its allocation on), run `warmup` steps, then one
  measured step; returns the step's peak by kind and the peak of each phase (forward, backward,
  optimizer: clipping, `step()` and `zero_grad()`). Works on real ranks and on one process.
- `estimate(model, world, ...)`: the same on one process, under `FakeTensorMode` with a fake
  process group of `world` ranks: no memory is allocated and nothing is computed, so a model of
  billions of parameters at 1,024 ranks is measured on a laptop in seconds. It is rank 0's
  view; with `fully_shard` every rank holds the same up to padding.
- `fits(model, world, device_bytes, ...)`: `estimate`'s peak against a device's memory.

From the command line::

    python -m veragged.tools.memory --model llama3-8b --world 256 --device-gib 80
    python -m veragged.tools.memory --model deepseek-v3-layers --world 1024 --impl both

`--impl both` measures torch's `fully_shard` as well (the ratio is ours over torch's).

What it does not count: the caching allocator's fragmentation and rounding (on CUDA devices,
MemTracker rounds each storage to 512 bytes; under FakeTensorMode the device is the CPU, so no
rounding), communication library buffers (NCCL), and the CUDA context. Preset models (`MODELS`)
are the example models of `veragged.models` at published sizes; their MoE routes tokens evenly
over the experts (`BalancedMoE`), as a fake tensor has no values to route by.

What it relies on in torch: MemTracker is a private tool (`torch.distributed._tools`), and
`tracked_step` starts a new peak mid-step by setting two of its private fields (`_peak_mem`,
`_peak_mem_snap`, as its `__enter__` does; torch 2.11 to 2.15 name them so). It also overrides
MemTracker's `_track_module_params_and_buffers`, whose gradient hooks raise on a frozen
parameter, to hook only trainable ones (through `_param_to_grad_hook_handles` and
`_update_and_maybe_create_winfos`, as torch's own). A torch that renames
them makes `tracked_step` raise, naming them, rather than report a wrong peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["KINDS", "MODELS", "MemoryReport", "estimate", "fits", "main", "make_optimizer",
           "optimizer_shard_kwargs", "shard_model", "tracked_step"]

# MemTracker's kinds (`_MemRefType` values) under the names this module reports.
KINDS = {"Parameter": "param", "Buffer": "buffer", "Gradient": "grad", "Activation": "act",
         "Temp": "temp", "Optstate": "optim", "Other": "other"}
PHASES = ("forward", "backward", "optimizer")


@dataclass
class MemoryReport:
    """One rank's memory in one measured training step, in bytes."""

    peak: int  # the step's peak of live bytes
    by_kind: dict[str, int]  # what the live bytes were at that peak, by kind (KINDS' values)
    phases: dict[str, int]  # each phase's own peak (PHASES)
    phase_kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    before: int = 0  # live bytes when the step began (sharded parameters, optimizer state...)
    params: int = 0  # the model's parameters (elements, unsharded)
    world: int = 1

    def as_dict(self) -> dict:
        return {"peak": self.peak, "by_kind": self.by_kind, "phases": self.phases,
                "phase_kinds": self.phase_kinds, "before": self.before, "params": self.params,
                "world": self.world}


def _kinds(snap: dict) -> tuple[int, dict[str, int]]:
    total, kinds = 0, {v: 0 for v in KINDS.values()}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            if k == "Total":
                total += v
            else:
                kinds[KINDS.get(getattr(k, "value", k), "other")] += v
    return total, kinds


def _reset_peak(tracker) -> None:
    """Start a new peak from what is live now. MemTracker resets its peak only when entered
    afresh, which would drop its module hooks mid-step, so this sets its peak fields (torch
    2.15's `_peak_mem`, `_peak_mem_snap`) as `__enter__` does."""
    if not (hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap")):
        raise RuntimeError(
            f"veragged.tools.memory: this torch ({torch.__version__})'s MemTracker has no "
            "_peak_mem/_peak_mem_snap fields to start a phase's peak from; the tool knows "
            "torch 2.11 to 2.15's")
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: s["Total"] for dev, s in tracker._peak_mem_snap.items()}


def _make_tracker():
    """torch's MemTracker, except that it installs gradient hooks only on parameters that
    require a gradient: torch's registers them on every parameter a module's forward sees, and
    `register_hook` raises on a frozen one (LoRA's base weights)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            frozen = any(not p.requires_grad for p in module.parameters())
            out = super()._track_module_params_and_buffers(
                module, install_grad_hooks=install_grad_hooks and not frozen)
            if install_grad_hooks and frozen:  # torch's hooks, on the trainable ones only
                def hook(grad):
                    self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(hook),
                            p.register_post_accumulate_grad_hook(lambda q: hook(q.grad)))
            return out

    return Tracker()


def tracked_step(build: Callable[[], tuple[nn.Module, object]], batch: torch.Tensor,
                 loss_fn: Callable | None = None, warmup: int = 1,
                 clip: float | None = 1.0) -> MemoryReport:
    """Build (`build()` -> (sharded model, optimizer)) and train under torch's MemTracker;
    report the last of `warmup + 1` steps. A step is `loss_fn(model, batch)` (default
    `model.loss(batch)`), `backward()`, `clip_grad_norm_(clip)` (None: no clipping),
    `opt.step()`, `opt.zero_grad()`."""
    loss_fn = loss_fn or (lambda m, b: m.loss(b))
    tracker = _make_tracker()
    phases: dict[str, int] = {}
    phase_kinds: dict[str, dict[str, int]] = {}
    with tracker:
        model, opt = build()
        params = sum(p.numel() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]
        for i in range(warmup + 1):
            last = i == warmup
            tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
            tracker.track_external(model, opt)  # (re)label parameters, gradients, states
            _reset_peak(tracker)
            before, _ = _kinds(tracker.get_tracker_snapshot())
            loss = loss_fn(model, batch)
            if last:
                phases["forward"], phase_kinds["forward"] = _kinds(
                    tracker.get_tracker_snapshot("peak"))
                _reset_peak(tracker)
            loss.backward()
            del loss
            if last:
                phases["backward"], phase_kinds["backward"] = _kinds(
                    tracker.get_tracker_snapshot("peak"))
                _reset_peak(tracker)
            if clip is not None and trainable:
                torch.nn.utils.clip_grad_norm_(trainable, max_norm=clip)
            opt.step()
            opt.zero_grad()
            if last:
                phases["optimizer"], phase_kinds["optimizer"] = _kinds(
                    tracker.get_tracker_snapshot("peak"))
    name = max(PHASES, key=lambda p: phases[p])
    world = dist.get_world_size() if dist.is_initialized() else 1
    return MemoryReport(peak=phases[name], by_kind=phase_kinds[name], phases=phases,
                        phase_kinds=phase_kinds, before=before, params=params, world=world)


# --- sharding ------------------------------------------------------------------------------

def shard_model(model: nn.Module, impl: str, mesh, *, mp: bool = False,
                reshard_after_forward: bool = True, **kwargs) -> nn.Module:
    """`impl` ("veragged" or "torch") fully_shard on every `model.blocks[i]`, then the root.
    `mp`: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if impl == "veragged":
        from veragged.fsdp.api import fully_shard as shard
    elif impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
        kwargs.pop("granularity_fn", None)
    else:
        raise ValueError(f"impl must be 'veragged' or 'torch', got {impl!r}")
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, **kwargs}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def optimizer_shard_kwargs(name: str, impl: str = "veragged") -> dict:
    """What veragged's fully_shard needs for optimizer `name` (`make_optimizer`): AdamW8bit
    quantises whole 256-element blocks, so its parameters are sharded on block boundaries."""
    if impl == "veragged" and name == "adamw8bit":
        import veragged.optim
        return {"granularity_fn": veragged.optim.adamw8bit_granularity()}
    return {}


def make_optimizer(name: str, model: nn.Module):
    """"adamw" (torch's, default arguments), "muon" or "adamw8bit" (veragged.optim)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params)
    import veragged.optim
    if name == "muon":
        from veragged.models.llama import muon_param_groups
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]}
                  for g in muon_param_groups(model)]
        return veragged.optim.Muon([g for g in groups if g["params"]], lr=0.02)
    if name == "adamw8bit":
        return veragged.optim.AdamW8bit(params)
    raise ValueError(f"unknown optimizer {name!r}: adamw, muon or adamw8bit")


# --- preset models --------------------------------------------------------------------------

def _balanced_moe(cfg):
    """veragged.models.moe.MoE whose MoE layers send every expert the same number of token
    copies (tokens * top_k / experts): shapes that need no values, so it runs on fake
    tensors; the router still runs and weighs the outputs."""
    from veragged.models import moe as moe_mod

    class BalancedMoELayer(moe_mod.MoELayer):
        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            weights, _ = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
            n = x.shape[0] * self.top_k
            e = self.num_experts
            counts = [n // e + (1 if i < n % e else 0) for i in range(e)]
            rows = torch.arange(n, device=x.device) // self.top_k
            ys = self.experts(x[rows], counts) * weights.reshape(-1, 1)
            return torch.zeros_like(x).index_add(0, rows, ys).reshape(shape)

    model = moe_mod.MoE(cfg)
    for block in model.blocks:
        old = block.moe
        new = BalancedMoELayer.__new__(BalancedMoELayer)
        new.__dict__ = old.__dict__
        block.moe = new
    return model


def _llama(**kw):
    from veragged.models.llama import Llama, LlamaConfig
    return lambda: Llama(LlamaConfig(**kw))


def _moe(**kw):
    from veragged.models.moe import MoEConfig
    return lambda: _balanced_moe(MoEConfig(**kw))


# name: (model factory, batch, sequence length, note)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, str]] = {
    "llama3-8b": (_llama(vocab=128256, dim=4096, layers=32, heads=32, hidden=14336,
                         max_seq=8192), 1, 8192,
                  "Llama-3 8B's widths (32 layers, dim 4096, SwiGLU 14336, vocab 128256) on "
                  "veragged.models.llama.Llama: full-width K/V (no GQA), so 8.8B parameters"),
    "deepseek-v3-layers": (_moe(vocab=129280, dim=7168, layers=2, heads=128, experts=256,
                                top_k=8, hidden=2048), 1, 4096,
                           "2 DeepSeek-V3 MoE layers (dim 7168, 256 experts of 2048, top-8; "
                           "plain attention, no MLA or shared expert) with its vocabulary"),
    "gpt-oss-layers": (_moe(vocab=201088, dim=2880, layers=2, heads=45, experts=128, top_k=4,
                            hidden=2880), 1, 4096,
                       "2 GPT-OSS-120B MoE layers (dim 2880, 128 experts of 2880, top-4; "
                       "45 heads of 64, no sinks or biases) with its vocabulary"),
}


# --- one-process estimates ------------------------------------------------------------------

@contextlib.contextmanager
def fake_world(world: int):
    """A fake process group of `world` ranks (this process is rank 0) and a 1-D CPU mesh on
    it; the default group is destroyed on exit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimate() needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def estimate(model: str | Callable[[], nn.Module], world: int, *, impl: str = "veragged",
             optimizer: str = "adamw", mp: bool = False, reshard_after_forward: bool = True,
             batch: int | None = None, seq: int | None = None,
             vocab: int | None = None) -> MemoryReport:
    """Rank 0's peak memory in a training step of `model` (a `MODELS` name or a factory of an
    unsharded model with `.blocks` and `.loss(tokens)`) sharded by `impl`'s fully_shard over
    `world` ranks, measured on this one process under FakeTensorMode and a fake process group.
    `batch` x `seq` tokens per rank (presets: their own; else 1 x 512)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if isinstance(model, str):
        factory, b, s, _ = MODELS[model]
        batch, seq = batch or b, seq or s
    else:
        factory = model
        batch, seq = batch or 1, seq or 512
    with fake_world(world) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        def build():
            m = factory()
            shard_model(m, impl, mesh, mp=mp, reshard_after_forward=reshard_after_forward,
                        **optimizer_shard_kwargs(optimizer, impl))
            return m, make_optimizer(optimizer, m)

        v = vocab or _vocab(factory)
        tokens = torch.randint(0, v, (batch, seq + 1))
        report = tracked_step(build, tokens)
    report.world = world
    return report


def _vocab(factory) -> int:
    with torch.device("meta"):
        m = factory()
    return m.embed.num_embeddings


def fits(model: str | Callable[[], nn.Module], world: int, device_bytes: int,
         **kwargs) -> tuple[bool, MemoryReport]:
    """Whether `estimate(model, world, **kwargs)`'s peak fits in `device_bytes` per rank."""
    report = estimate(model, world, **kwargs)
    return report.peak <= device_bytes, report


# --- command line ---------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m veragged.tools.memory",
        description="Peak memory of a training step at N ranks (one process, FakeTensorMode).")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--world", default="8,256,1024",
                        help="comma list of world sizes (default 8,256,1024)")
    parser.add_argument("--impl", default="veragged", choices=("veragged", "torch", "both"))
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "muon", "adamw8bit"))
    parser.add_argument("--bf16", action="store_true",
                        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    parser.add_argument("--no-reshard", action="store_true",
                        help="reshard_after_forward=False")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=None, help="sequence length")
    parser.add_argument("--device-gib", type=float, default=None,
                        help="device memory per rank: answer whether the peak fits")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    impls = ("torch", "veragged") if args.impl == "both" else (args.impl,)
    out = sys.stderr if args.json else sys.stdout
    print(f"{MODELS[args.model][3]}", file=out)
    print(f"{'world':>6} {'impl':8} {'peak GiB':>9} " + " ".join(
        f"{k + ' GiB':>10}" for k in ("param", "grad", "optim", "act", "temp")) +
        f" {'fwd GiB':>8} {'bwd GiB':>8} {'opt GiB':>8}" +
        (" fits" if args.device_gib else ""), file=out)
    rows, ok = [], True
    for world in (int(w) for w in args.world.split(",")):
        row = {"world": world}
        for impl in impls:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                r = estimate(args.model, world, impl=impl, optimizer=args.optimizer,
                             mp=args.bf16, reshard_after_forward=not args.no_reshard,
                             batch=args.batch, seq=args.seq)
            row[impl] = r.as_dict()
            k, ph = r.by_kind, r.phases
            fit = ""
            if args.device_gib:
                good = r.peak <= args.device_gib * 2**30
                ok = ok and (good or impl != "veragged")
                fit = "  yes" if good else "   no"
            print(f"{world:6d} {impl:8} {_gib(r.peak):>9} " + " ".join(
                f"{_gib(k[x]):>10}" for x in ("param", "grad", "optim", "act", "temp")) +
                f" {_gib(ph['forward']):>8} {_gib(ph['backward']):>8} "
                f"{_gib(ph['optimizer']):>8}{fit}", file=out)
        if len(impls) == 2:
            row["ratio"] = row["veragged"]["peak"] / row["torch"]["peak"]
            print(f"{'':6} {'ratio':8} {row['ratio']:9.2f}   (veragged / torch)", file=out)
        rows.append(row)
    print(json.dumps({"tool": "veragged.tools.memory", "model": args.model,
                      "optimizer": args.optimizer, "bf16": args.bf16,
                      "reshard_after_forward": not args.no_reshard,
                      "device_bytes": args.device_gib and int(args.device_gib * 2**30),
                      "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
