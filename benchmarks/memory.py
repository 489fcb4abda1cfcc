"""Peak memory of a training step, veragged.fully_shard vs torch's fully_shard, by kind and phase.

Measured by torch's `MemTracker` (torch.distributed._tools.mem_tracker) through
`veragged.tools.memory.tracked_step`: the model is built, sharded (every block and the root)
and given its optimizer under the tracker, so every buffer either FSDP keeps is counted from its
allocation on; one warm-up step (optimizer states appear), then the measured step. Both sides
run in the same job, torch's first.

Part 1, gloo ranks on CPU (rank 0's numbers; `--world`): the example models
  llama  veragged.models.llama.Llama (dim `--dim`, `--layers` layers, vocab 256, 2 x 32 tokens);
  moe    veragged.models.moe.MoE (fused experts, top-2 routing);
  lora   the llama with LoRA adapters (rank 8) on q and v, the base frozen before fully_shard
         (its q, k, v unfused);
in fp32 or bf16 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), with
`reshard_after_forward` True or False, and AdamW (both sides), Muon or AdamW8bit (veragged
only: `-` in torch's columns).

Part 2, one process under FakeTensorMode and a fake process group (`veragged.tools.memory.
estimate`): the presets of `veragged.tools.memory.MODELS` (Llama-3 8B widths, DeepSeek-V3 and
GPT-OSS MoE layers) at 8, 256 and 1,024 ranks, AdamW, fp32. Nothing is allocated or computed.

A model marked `*` ran with `set_reduce_scatter_unused_params(True)` on both sides
(`--unused-params on|both`): every trainable parameter gets a gradient, so ours carries no verdict
flags. Without it, ours holds a few more bytes than the layouts (`verdict_bytes` in the JSON:
at most the flags of every group's gradient buffer and sharded gradients, [Note: unreached
parameters]), which torch's step has no counterpart for: it aborts when ranks reach different
parameters.

Columns (bytes per rank, MiB or GiB; ratio = veragged / torch, below 1 is better):
  peak      the step's peak of live bytes (the largest phase peak);
  param, grad, optim, act, temp   what was live at that peak by MemTracker's kind (parameters,
            gradients, optimizer states, tensors made in forward, tensors made in backward);
  fwd, bwd, opt   each phase's own peak (forward; backward; clipping + step + zero_grad).

Default (`--quick`-sized, about 2 minutes on 2 cores): part 1 for llama and moe at 2 ranks, fp32,
reshard True, AdamW; part 2 for gpt-oss-layers at 256 ranks (1,024 tokens). `--full`: part 1
over worlds 2 and 4, fp32/bf16, reshard True/False, AdamW/Muon/AdamW8bit and LoRA; part 2 every
preset at 8, 256 and 1,024 ranks. Prints a table and one JSON line (`--json`: only the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import multiprocessing
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.harness.pool import get_pool
from veragged.tools.memory import (MODELS, estimate, make_optimizer, optimizer_shard_kwargs,
                                    shard_model, tracked_step)
from benchmarks._meta import commit_id

VOCAB, BATCH, SEQ = 256, 2, 32
SIDES = ("torch", "veragged")
TORCH_PEER = {"adamw"}
KIND_COLS = ("param", "grad", "optim", "act", "temp")


class LoRALinear(nn.Module):
    """`base(x) + B(A(x)) * alpha / r` (PEFT's LoRA), as benchmarks/lora_bytes.py."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def build_model(name: str, dim: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    if name in ("llama", "lora"):
        from veragged.models.llama import Llama, LlamaConfig
        model = Llama(LlamaConfig(vocab=VOCAB, dim=dim, layers=layers, heads=4,
                                  hidden=int(8 * dim / 3), max_seq=SEQ, fused=name == "llama"))
        if name == "lora":
            for block in model.blocks:
                block.q, block.v = LoRALinear(block.q), LoRALinear(block.v)
            for n, p in model.named_parameters():
                p.requires_grad_(".lora_" in n)
        return model
    from veragged.models.moe import MoE, MoEConfig
    return MoE(MoEConfig(vocab=VOCAB, dim=dim, layers=layers, heads=4, experts=8, top_k=2,
                         hidden=dim))


def _worker(case: dict) -> dict:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (dist.get_world_size() * BATCH, SEQ + 1), generator=g)
    tokens = data[rank * BATCH : (rank + 1) * BATCH]
    out = {}
    for side in case["sides"]:
        def build():
            m = build_model(case["model"], case["dim"], case["layers"])
            kw = optimizer_shard_kwargs(case["optimizer"], side)
            shard_model(m, side, mesh, mp=case["bf16"], reshard_after_forward=case["reshard"],
                        **kw)
            # Every trainable parameter gets a gradient: no verdicts. torch 2.11's fully_shard has
            # no such setter; its reduce-scatter is the same when every parameter is reached.
            if case.get("unused") and hasattr(m, "set_reduce_scatter_unused_params"):
                m.set_reduce_scatter_unused_params(True)
            if side == "veragged":
                out["verdict_bytes"] = verdict_bytes(m)
            return m, make_optimizer(case["optimizer"], m)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[side] = tracked_step(build, tokens).as_dict()
        dist.barrier()
    return out


def verdict_bytes(model: nn.Module) -> int:
    """The most bytes veragged's verdict flags ([Note: unreached parameters]) can hold at once:
    every group's flags in its gradient buffer (a slot per rank) and in its sharded gradients.
    The one thing in our step torch's has no counterpart for (torch aborts when ranks reach
    different parameters); 0 with `set_reduce_scatter_unused_params(True)`. Read at build time,
    before the first backward lays the buffers out, so it is the layout made at fully_shard
    (flags for every trainable tensor)."""
    total = 0
    for mod in model.modules():
        state = getattr(mod, "_veragged_state", None)
        for g in getattr(state, "groups", None) or ():
            if g.reduce_scatter_unused_params:
                continue
            lay, buf = g.buffer.grads.layout, g.buffer
            total += lay.flags * (len(lay.sizes) * buf.reduce_dtype.itemsize + buf.dtype.itemsize)
    return total


def part1_cases(args) -> list[dict]:
    if args.full:
        grid = itertools.product((2, 4), ("llama", "moe"), (False, True), (True, False),
                                 ("adamw", "muon", "adamw8bit"))
        cases = [dict(world=w, model=m, bf16=b, reshard=r, optimizer=o)
                 for w, m, b, r, o in grid]
        cases += [dict(world=w, model="lora", bf16=False, reshard=True, optimizer="adamw")
                  for w in (2, 4)]
    else:
        unused = {"off": (False,), "on": (True,), "both": (False, True)}[args.unused_params]
        cases = [dict(world=args.world, model=m, bf16=args.bf16, reshard=True,
                      optimizer="adamw", unused=u) for m in args.models.split(",")
                 for u in unused]
    for c in cases:
        c["dim"], c["layers"] = (args.dim, args.layers)
        c["sides"] = SIDES if c["optimizer"] in TORCH_PEER else ("veragged",)
    return cases


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _row(label: str, r: dict, fmt) -> str:
    k, ph = r["by_kind"], r["phases"]
    return (f"{label} {fmt(r['peak']):>8} " + " ".join(f"{fmt(k[c]):>7}" for c in KIND_COLS)
            + f" {fmt(ph['forward']):>7} {fmt(ph['backward']):>7} {fmt(ph['optimizer']):>7}")


def _estimate_job(q, model, world, impl, seq):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r = estimate(model, world, impl=impl, seq=seq)
    q.put((r.as_dict(), [str(x.message) for x in w if "data_ptr" in str(x.message)
                         or "data pointer" in str(x.message)]))


def run_estimate(model: str, world: int, impl: str, seq: int | None) -> tuple[dict, list]:
    """`estimate` in a fresh process (a fake default group per world size)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_estimate_job, args=(q, model, world, impl, seq))
    p.start()
    res = q.get()
    p.join()
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks, part 1 (2)")
    parser.add_argument("--models", default="llama,moe", help="part 1: llama, moe, lora")
    parser.add_argument("--dim", type=int, default=128, help="part 1 width (128)")
    parser.add_argument("--layers", type=int, default=4, help="part 1 layers (4)")
    parser.add_argument("--bf16", action="store_true", help="part 1 in bf16 (mixed precision)")
    parser.add_argument("--unused-params", default="off", choices=("off", "on", "both"),
                        help="part 1: set_reduce_scatter_unused_params(True) on both sides "
                             "(on), not (off, default) or each (both)")
    parser.add_argument("--fake-models", default="gpt-oss-layers",
                        help="part 2 presets (comma list; 'none' skips part 2)")
    parser.add_argument("--fake-worlds", default="256", help="part 2 world sizes (256)")
    parser.add_argument("--fake-seq", type=int, default=1024,
                        help="part 2 tokens per rank (1024; 0: the preset's own)")
    parser.add_argument("--full", action="store_true", help="the whole matrix (long)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    if args.full:
        args.fake_models, args.fake_worlds = ",".join(MODELS), "8,256,1024"

    rows = []
    print("Part 1: gloo ranks, rank 0, MiB", file=out)
    print(f"{'world':>5} {'model':6} {'dtype':5} {'reshard':7} {'optim':9} {'side':8} "
          f"{'peak':>8} " + " ".join(f"{c:>7}" for c in KIND_COLS)
          + f" {'fwd':>7} {'bwd':>7} {'opt':>7} {'ratio':>6}", file=out)
    pools = {}
    for case in part1_cases(args):
        pool = pools.get(case["world"]) or pools.setdefault(case["world"],
                                                            get_pool(case["world"], device="cpu"))
        res = pool.run(_worker, case, timeout=1200)[0]
        row = {k: v for k, v in case.items() if k != "sides"}
        row.setdefault("unused", False)
        row.update(res)
        if "torch" in res:
            row["ratio"] = res["veragged"]["peak"] / res["torch"]["peak"]
        rows.append(row)
        head = (f"{case['world']:5d} {case['model'] + ('*' if case.get('unused') else ''):6} "
                f"{'bf16' if case['bf16'] else 'fp32':5} {str(case['reshard']):7} "
                f"{case['optimizer']:9}")
        for side in SIDES:
            if side in res:
                ratio = f" {row['ratio']:6.2f}" if side == "veragged" and "ratio" in row else ""
                print(_row(f"{head} {side:8}", res[side], _mib) + ratio, file=out)

    fake_rows = []
    if args.fake_models != "none":
        print("\nPart 2: one process, FakeTensorMode + fake process group, rank 0, GiB", file=out)
        print(f"{'world':>5} {'model':18} {'side':8} {'peak':>8} "
              + " ".join(f"{c:>7}" for c in KIND_COLS)
              + f" {'fwd':>7} {'bwd':>7} {'opt':>7} {'ratio':>6}", file=out)
        for model in args.fake_models.split(","):
            for world in (int(w) for w in args.fake_worlds.split(",")):
                row = {"model": model, "world": world}
                for side in SIDES:
                    row[side], warned = run_estimate(model, world, side, args.fake_seq or None)
                    row[side + "_data_ptr_warnings"] = len(warned)
                row["ratio"] = row["veragged"]["peak"] / row["torch"]["peak"]
                fake_rows.append(row)
                for side in SIDES:
                    ratio = f" {row['ratio']:6.2f}" if side == "veragged" else ""
                    print(_row(f"{world:5d} {model:18} {side:8}", row[side], _gib) + ratio,
                          file=out)
    print(json.dumps({"benchmark": "memory", "date": datetime.date.today().isoformat(),
                      "commit": commit_id(), "torch": torch.__version__, "rows": rows,
                      "fake_rows": fake_rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
