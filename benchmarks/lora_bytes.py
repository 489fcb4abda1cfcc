"""LoRA backward bytes: veragged.fully_shard vs torch's fully_shard, gloo ranks on CPU.

Model: veragged.models.llama's Llama with q/k/v apart (`fused=False`; default dim 64, 4 blocks,
4 heads, SwiGLU width 170, vocab 256, fp32), PEFT-style LoRA adapters on q and v (`LoRALinear`:
the base `nn.Linear` plus `lora_A` (dim -> r) and `lora_B` (r -> dim) Linear submodules, no bias,
scaling alpha / r; default r 8). `lora_B` starts small and random rather than PEFT's zeros, so
that every adapter's gradient is non-zero (the bytes do not depend on it). Each block and then
the root are sharded, the same way on both sides, over a 1-D mesh of every rank; each step is
forward, backward, `torch.optim.AdamW.step()` and `zero_grad()`, on the same batches.

Scenarios (which parameters require grad, and when that is decided):
  lora            the base weights (everything but the adapters) frozen BEFORE fully_shard:
                  veragged plans them in DBuffers of their own, so backward's reduce-scatter
                  and gradient buffer hold only the adapters ([Note: frozen parameters] in
                  veragged/fsdp/api.py); each rank slot still ends with the verdict flags
                  ([Note: unreached parameters] in veragged/dbuffer/grad_layout.py);
  lora_all_grads  as `lora`, with `set_reduce_scatter_unused_params(True)` on both sides
                  (torch 2.15 only): every trainable parameter gets a gradient, so no flags;
  unfreeze_after  as `lora`, then after one training step the blocks' RMSNorm weights are
                  unfrozen (`requires_grad_(True)`): in veragged they sit in the blocks' frozen
                  DBuffers, which then give gradient room to them alone ([Note: compacted
                  gradients]), one reduce-scatter more per block than torch;
  freeze_after    everything requires grad at fully_shard time; after one training step the
                  base weights are frozen: veragged's DBuffers then give gradient room to the
                  adapters alone, each rank slot as large as the largest rank's share of them
                  (the adapters keep the ranks the layout gave them; torch splits each evenly).
After the change (if any), one more training step, then the measured one.

Columns (per rank, one forward + backward; ratio is veragged / torch, below 1 is better):
  RS B       bytes of backward's reduce-scatters: per call the larger of its input and output,
             i.e. the unsharded gradient buffer it scatters (`WriteCounter.collective_bytes`,
             see [Note: what WriteCounter counts] in veragged/tools/write_counter.py);
  AR B       bytes of backward's all-reduces (HSDP only; 0 on this 1-D mesh);
  grad buf   the largest gradient buffer one reduce-scatter scatters: the input tensor of the
             largest reduce-scatter call, counted the same way on both sides (veragged: one
             DBuffer's gradient buffer, as allocated in backward; torch: one FSDPParamGroup's
             reduce-scatter input, its copied-in unsharded gradients). Not the sum of buffers
             alive at once (both sides keep at most one reduction in flight besides the one
             being filled), which the per-call sizes in the JSON line let one bound;
  AG B       bytes of the all-gathers of forward plus backward (per call the gathered output;
             `reshard_after_forward=True`, so backward gathers again);
  AG n       all-gather calls in forward plus backward: veragged issues one per DBuffer, so a
             module with both frozen and trainable parameters costs one more than torch's.
The JSON line also holds, per side, every reduce-scatter call's size, the number of trainable
parameters, and (veragged) the gradient-buffer size of every DBuffer that holds a parameter
requiring grad (the reduce-scatter inputs should be exactly these), and `grad_max_diff`: the
largest difference between the two sides' full gradients of the parameters requiring grad
(the same work on both sides, to fp32 round-off).

Prints a table and one JSON line (`--json`: only the JSON). Default: 2 and 4 ranks, every
scenario, 2 warm-up steps (about 40 s on 2 idle CPU cores, mostly starting the ranks).
`--quick`: the same model and ranks, the `lora` and `lora_all_grads` scenarios only, 1 warm-up
step (about 30 s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import veragged
from veragged.tools.write_counter import WriteCounter
from veragged.models.llama import Llama, LlamaConfig
from tests.harness.pool import get_pool
from benchmarks._meta import commit_id

BATCH, SEQ, VOCAB = 2, 32, 256
SCENARIOS = ("lora", "lora_all_grads", "unfreeze_after", "freeze_after")
# lora_all_grads: `set_reduce_scatter_unused_params(True)` on both sides (torch 2.15; torch 2.11
# has no such mode): every trainable parameter gets a gradient, so veragged sends no verdict
# flags ([Note: unreached parameters] in veragged/dbuffer/grad_layout.py).
HAS_ALL_GRADS = hasattr(torch.distributed.fsdp.FSDPModule, "set_reduce_scatter_unused_params")
SIDES = ("torch", "veragged")


class LoRALinear(nn.Module):
    """PEFT-style LoRA: `base_layer(x) + lora_B(lora_A(x)) * alpha / r`."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)  # PEFT: zeros (see the module docstring)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _is_block_norm(name: str) -> bool:
    return name.startswith("blocks.") and ("attn_norm" in name or "mlp_norm" in name)


def _build(kind: str, scenario: str, spec: dict, mesh) -> nn.Module:
    torch.manual_seed(0)
    dim = spec["dim"]
    model = Llama(LlamaConfig(vocab=VOCAB, dim=dim, layers=spec["layers"], heads=4,
                              hidden=int(8 * dim / 3), max_seq=SEQ, fused=False))
    for block in model.blocks:
        block.q = LoRALinear(block.q, spec["rank"], 2.0 * spec["rank"])
        block.v = LoRALinear(block.v, spec["rank"], 2.0 * spec["rank"])
    if scenario != "freeze_after":  # the base frozen before fully_shard
        for name, p in model.named_parameters():
            p.requires_grad_(_is_adapter(name))
    shard = veragged.fully_shard if kind == "veragged" else torch_fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    if scenario == "lora_all_grads":
        model.set_reduce_scatter_unused_params(True)  # recurses into the blocks
    return model


def _change(model: nn.Module, scenario: str) -> None:
    """The requires_grad change made after fully_shard (and one step), if any."""
    for name, p in model.named_parameters():
        if scenario == "unfreeze_after" and _is_block_norm(name):
            p.requires_grad_(True)
        elif scenario == "freeze_after" and not _is_adapter(name):
            p.requires_grad_(False)


def _step(model, opt, tokens) -> None:
    model.loss(tokens).backward()
    opt.step()
    opt.zero_grad()


class _PerCall(WriteCounter):
    """`WriteCounter` that also keeps each collective call's size, as it tallies it."""

    def __init__(self):
        super().__init__(attribute=None)
        self.calls: list[tuple[str, int]] = []

    def _note_collective(self, func, args, kwargs) -> None:
        op = str(func)
        with self._lock:
            before = self.collective_bytes[op]
        super()._note_collective(func, args, kwargs)
        with self._lock:
            self.calls.append((op, self.collective_bytes[op] - before))


def _kind(op: str) -> str | None:
    if "reduce_scatter" in op:
        return "rs"
    if "allgather" in op or "all_gather" in op:
        return "ag"
    if "allreduce" in op or "all_reduce" in op:
        return "ar"
    return None


def _dbuffer_grad_bytes(model: nn.Module) -> list[int]:
    """veragged: the gradient-buffer size of every DBuffer holding a parameter requiring grad."""
    sizes = []
    for m in model.modules():
        state = getattr(m, "_veragged_state", None)
        if state is None or state.modules[0] is not m:
            continue
        for g in state.groups:
            b = g.buffer
            if any(p.requires_grad for p in b.params):
                sizes.append(b.grads.flat.numel() * b.grads.flat.element_size())
    return sizes


def _full_grads(model: nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad
            out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _worker(spec: dict, scenarios: list, warmup: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (warmup + 1, world * BATCH, SEQ + 1), generator=g)
    local = data[:, rank * BATCH : (rank + 1) * BATCH]
    out = {}
    for scenario in scenarios:
        res, grads = {}, {}
        for kind in SIDES:
            model = _build(kind, scenario, spec, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for i in range(warmup):
                _step(model, opt, local[i])
                if i == 0:
                    _change(model, scenario)
            with _PerCall() as fwd:
                loss = model.loss(local[-1])
            with _PerCall() as bwd:
                loss.backward()
            grads[kind] = _full_grads(model)
            r = {
                "rs_bytes": 0, "ar_bytes": 0, "ag_bytes": 0, "ag_calls": 0, "rs_calls": [],
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            }
            for phase, counter in (("fwd", fwd), ("bwd", bwd)):
                for op, n in counter.calls:
                    k = _kind(op)
                    if k == "ag":
                        r["ag_bytes"] += n
                        r["ag_calls"] += 1
                    elif k is not None and phase == "bwd":
                        r[f"{k}_bytes"] += n
                        if k == "rs":
                            r["rs_calls"].append(n)
            r["grad_buf_max"] = max(r["rs_calls"], default=0)
            if kind == "veragged":
                r["dbuffer_grad_bytes"] = _dbuffer_grad_bytes(model)
            opt.zero_grad()
            res[kind] = r
            del model, opt
        names = set(grads["torch"]) | set(grads["veragged"])
        res["grad_names_match"] = set(grads["torch"]) == set(grads["veragged"])
        res["grad_max_diff"] = max(
            ((grads["torch"][n] - grads["veragged"][n]).abs().max().item()
             for n in names if n in grads["torch"] and n in grads["veragged"]), default=0.0)
        out[scenario] = res
    return out


def _ratio(a, b):
    return a / b if b else (float("nan") if a else 1.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="comma list of gloo rank counts (2,4)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma list of " + ", ".join(SCENARIOS))
    parser.add_argument("--dim", type=int, default=64, help="model width (64)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (4)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank on q and v (8)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="training steps before the measured one (default 2, --quick 1; "
                             "at least 2 with a *_after scenario: its requires_grad change "
                             "comes after the first)")
    parser.add_argument("--quick", action="store_true",
                        help="the lora scenarios only (lora, lora_all_grads), 1 warm-up step")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if args.quick:
        scenarios = ["lora", "lora_all_grads"] if HAS_ALL_GRADS else ["lora"]
    else:
        scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        if not HAS_ALL_GRADS and args.scenarios == ",".join(SCENARIOS):
            scenarios.remove("lora_all_grads")
    for s in scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r}: choose from {SCENARIOS}")
        if s == "lora_all_grads" and not HAS_ALL_GRADS:
            parser.error(f"scenario {s!r} needs torch's set_reduce_scatter_unused_params "
                         f"(torch 2.15), not in torch {torch.__version__}")
    for w in worlds:
        if w < 2:
            parser.error(f"--worlds: each rank count must be at least 2, got {w}")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    least = 2 if any(s.endswith("_after") for s in scenarios) else 1
    if warmup < least:
        parser.error(f"--warmup must be at least {least} for scenarios {scenarios}, "
                     f"got {warmup}")
    spec = {"dim": args.dim, "layers": args.layers, "rank": args.rank}
    rows = []
    for world in worlds:
        pool = get_pool(world, timeout_s=300, device="cpu")
        per_rank = pool.run(_worker, spec, scenarios, warmup)
        for scenario in scenarios:
            r = {"world": world, "scenario": scenario}
            for kind in SIDES:
                sides = [pr[scenario][kind] for pr in per_rank]
                r[kind] = dict(sides[0])
                for key in ("rs_bytes", "ar_bytes", "ag_bytes", "grad_buf_max"):
                    r[kind][key] = max(s[key] for s in sides)  # the same on every rank
                r[kind]["same_on_all_ranks"] = all(s == sides[0] for s in sides)
            r["grad_max_diff"] = max(pr[scenario]["grad_max_diff"] for pr in per_rank)
            r["grad_names_match"] = all(pr[scenario]["grad_names_match"] for pr in per_rank)
            t, v = r["torch"], r["veragged"]
            r["rs_ratio"] = _ratio(v["rs_bytes"], t["rs_bytes"])
            r["grad_buf_ratio"] = _ratio(v["grad_buf_max"], t["grad_buf_max"])
            r["ag_ratio"] = _ratio(v["ag_bytes"], t["ag_bytes"])
            rows.append(r)
    if not args.json:
        print(f"{'world':>5} {'scenario':14} {'torch RS B':>11} {'ours RS B':>11} {'ratio':>6} "
              f"{'torch AR B':>10} {'ours AR B':>9} {'torch grad buf':>14} "
              f"{'ours grad buf':>13} {'ratio':>6} {'torch AG B':>11} {'ours AG B':>11} "
              f"{'ratio':>6} {'AG n torch/ours':>15} {'grad diff':>9}")
        for r in rows:
            t, v = r["torch"], r["veragged"]
            print(f"{r['world']:5d} {r['scenario']:14} {t['rs_bytes']:11,d} {v['rs_bytes']:11,d} "
                  f"{r['rs_ratio']:6.2f} {t['ar_bytes']:10,d} {v['ar_bytes']:9,d} "
                  f"{t['grad_buf_max']:14,d} {v['grad_buf_max']:13,d} {r['grad_buf_ratio']:6.2f} "
                  f"{t['ag_bytes']:11,d} {v['ag_bytes']:11,d} {r['ag_ratio']:6.2f} "
                  f"{t['ag_calls']:>7d}/{v['ag_calls']:<7d} {r['grad_max_diff']:9.1e}")
        print(f"(per rank, one forward + backward; RS/AR: backward's reduce-scatters and "
              f"all-reduces, the larger of each call's input and output; grad buf: the largest "
              f"reduce-scatter input; AG: forward + backward all-gathers; model: Llama dim "
              f"{args.dim}, {args.layers} blocks, LoRA r {args.rank} on q and v, fp32)")
    print(json.dumps({
        "benchmark": "lora_bytes",
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "torch": torch.__version__,
        "spec": spec,
        "warmup": warmup,
        "rows": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
