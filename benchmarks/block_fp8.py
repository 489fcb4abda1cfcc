"""Block-scaled 8-bit all-gathers against bf16 and the peers' ways, gloo ranks on CPU.

One transformer block's weights in one group (dim D, SwiGLU width F: wq, wk, wv, wo D x D,
w1, w3 F x D, w2 D x F, two RMSNorm weights of D; fp32 masters), sharded over a 1-D mesh of
every rank; each row unshards the group once (after a warm-up) and counts what it did:

  bf16              veragged.fully_shard, param_dtype bf16 (the usual mixed-precision gather)
  block128          quant_fn BlockFP8() (128x128 tiles, fp32 scale_inv): [Note: block-scaled
                    weights] in veragged/quant/__init__.py
  block128_ue8m0    BlockFP8(scale="ue8m0")
  row128            BlockFP8(tile=(1, 128))
  mxfp8             MXFP8() (1x32, E8M0, FLOOR)
  tensorwise        torchao's float8 all-gather (`enable_fsdp_float8_all_gather` with
                    `precompute_float8_dynamic_scale_for_fsdp`), emulated on the same flat
                    shards: one all-reduce(MAX) of every weight's amax, then one all-gather of
                    the e4m3 bytes
  bf16_then_quant   torchao's blockwise and MXFP8 recipes: gather bf16, then every rank
                    quantises the full weights (128x128) after the gather

Columns: `B/elem` all-gathered bytes per weight element, padding, scales and norms included
(`WriteCounter.collective_bytes`: each all-gather's output), `B/w` the same for the 2-D
weights alone (the bf16 norms' bytes taken out; the issue's targets: 128x128 fp32 <= 1.0003,
1x128 and MXFP8 <= 1.032); `AG` and `AR` the all-gathers and
all-reduces of one unshard (counted by the same counter); `quant ms` the quantisation of one
unshard (this rank's tiles; bf16_then_quant: the full weights), `gather ms` the all-gather
alone, `quant/gather` their ratio (the issue's target: < 0.1; CPU/gloo here, the GPU row is in
scripts/gpu_check.sh); `transient MB` the buffers one unshard allocates (unsharded weights plus
the gathered bytes and the persistent 8-bit slot), from their sizes.
Prints a table and one JSON line. `--device cuda` runs one GPU per rank with NCCL (fresh
processes; `scripts/gpu_check.sh` runs it with every visible GPU: with one, the "all-gather" is
NCCL's copy of a world of one, so q/g there bounds the kernel, not the link).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import veragged
from veragged.quant import Packing
from veragged.tools.write_counter import WriteCounter
from benchmarks._meta import commit_id
from benchmarks.fsdp_step import add_device_argument, device_mesh, rank_runner

FORMATS = {"block128": veragged.BlockFP8(), "block128_ue8m0": veragged.BlockFP8(scale="ue8m0"),
           "row128": veragged.BlockFP8(tile=(1, 128)), "mxfp8": veragged.MXFP8()}
ROWS = ["bf16", *FORMATS, "tensorwise", "bf16_then_quant"]


class Block(nn.Module):
    def __init__(self, D: int, F: int):
        super().__init__()
        for n in ("wq", "wk", "wv", "wo"):
            setattr(self, n, nn.Linear(D, D, bias=False))
        self.w1, self.w3 = nn.Linear(D, F, bias=False), nn.Linear(D, F, bias=False)
        self.w2 = nn.Linear(F, D, bias=False)
        self.n1, self.n2 = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _counted(fn) -> WriteCounter:
    counter = WriteCounter(attribute=None)
    with counter:
        fn()
    return counter


def _summary(counter, elements):
    ag = sum(v for k, v in counter.collectives.items() if "gather" in k)
    ar = sum(v for k, v in counter.collectives.items() if "allreduce" in k or "all_reduce" in k)
    ag_bytes = sum(v for k, v in counter.collective_bytes.items() if "gather" in k)
    return dict(bytes_per_elem=ag_bytes / elements, all_gathers=ag, all_reduces=ar)


def _worker(D: int, F: int, repeats: int, device: str = "cpu") -> dict:
    world = dist.get_world_size()
    mesh = device_mesh(device)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else None
    out = {}
    for row in ["bf16", *FORMATS]:
        torch.manual_seed(0)
        block = Block(D, F).to(dev)
        elements = sum(p.numel() for p in block.parameters())
        fmt = FORMATS.get(row)
        veragged.fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16), quant_fn=(lambda n, p, f=fmt: f if p.ndim == 2 else None)
            if fmt else None)
        buf = block._get_fsdp_state().groups[0].buffer
        block.unshard()
        block.reshard()
        c = _counted(lambda: (block.unshard(), block.reshard()))
        r = _summary(c, elements)
        r["total_ms"] = _timed(lambda: (block.unshard(), block.reshard()), repeats)
        unsharded = buf.world * buf.shard_size * 2
        if fmt is None:
            gather_in = buf.shard.to(torch.bfloat16)
            gather_out = torch.empty(world * gather_in.numel(), dtype=torch.bfloat16,
                                     device=gather_in.device)
            r["quant_ms"] = 0.0
            r["transient_mb"] = unsharded / 2**20
        else:
            p = buf.packing
            r["quant_ms"] = _timed(lambda: torch.ops.veragged.quantize_tiles_(
                buf._qslot, buf.shard, buf._qtable, p.quantize_tiles, torch.bfloat16), repeats)
            gather_in = buf._qslot
            gather_out = torch.empty(p.gather_bytes, dtype=torch.uint8, device=dev)
            r["transient_mb"] = (unsharded + p.gather_bytes + p.slot_bytes) / 2**20
            r["padding"] = buf.layout.padding / buf.layout.world_size / buf.shard_size
            raw = (p.elements - p.quantized_elements) * 2  # the norms, sent in bf16
            r["bytes_per_weight_elem"] = (r["bytes_per_elem"] * elements - raw) / (
                p.quantized_elements)
        r["gather_ms"] = _timed(lambda: dist.all_gather_into_tensor(
            gather_out.view(torch.uint8), gather_in.view(torch.uint8)), repeats)
        out[row] = r
    # torchao tensorwise: one all-reduce of the weights' amaxes, then e4m3 bytes gathered.
    shard = out_shard = torch.randn(elements // world, device=dev)
    amax = torch.rand(7, device=dev)

    def tensorwise():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        q = (out_shard * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        dist.all_gather_into_tensor(torch.empty(world * q.numel(), dtype=torch.uint8,
                                                device=dev), q)

    c = _counted(tensorwise)
    r = _summary(c, elements)
    r["total_ms"] = _timed(tensorwise, repeats)
    r["quant_ms"] = _timed(lambda: (out_shard * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn),
                           repeats)
    r["gather_ms"] = r["total_ms"] - r["quant_ms"]
    r["transient_mb"] = (elements * 1 + elements * 2) / 2**20
    out["tensorwise"] = r
    # torchao blockwise / MXFP8: bf16 gathered, the full weights quantised on every rank.
    full = torch.randn(elements, device=dev).to(torch.bfloat16)
    from types import SimpleNamespace
    shapes = [(D, D)] * 4 + [(F, D), (F, D), (D, F)]
    entries, off = [], 0
    for s in shapes:
        n = s[0] * s[1]
        entries.append(SimpleNamespace(start=off, stop=off + n, shape=torch.Size(s)))
        off += n
    p = Packing(entries, [FORMATS["block128"]] * len(entries), off, 1, 0, torch.bfloat16, 256)
    qbuf = torch.empty(p.slot_bytes, dtype=torch.uint8, device=dev)
    table = p.quantize.to(full.device)
    r = dict(out["bf16"])
    r["quant_ms"] = _timed(lambda: torch.ops.veragged.quantize_tiles_(
        qbuf, full[:off], table, p.quantize_tiles, torch.bfloat16), repeats)
    r["total_ms"] = out["bf16"]["total_ms"] + r["quant_ms"]
    r["transient_mb"] = out["bf16"]["transient_mb"] + p.slot_bytes / 2**20
    out["bf16_then_quant"] = r
    del shard
    return out


#: (name, dim, kv dim, ffn) of the model-scale rows: Llama-3 8B and 70B blocks.
MODEL_SCALE = [("llama3_8b", 4096, 1024, 14336), ("llama3_70b", 8192, 1024, 28672)]


def model_scale(worlds=(2, 4, 8, 16, 64)) -> list[dict]:
    """Planned bytes per weight element of one transformer block at model scale, from the
    planner and the packed layout alone (no ranks, no data): what one all-gather of the block
    moves, padding and scales included, for 128x128 fp32 and MXFP8 (bf16 params, fp32
    masters: the DBuffer's alignment of 256 bytes of bf16)."""
    from types import SimpleNamespace

    from veragged.dbuffer.quantized import SLOT_ALIGN
    from veragged.planner import plan

    rows = []
    for name, D, KV, F in MODEL_SCALE:
        shapes = [(D, D), (KV, D), (KV, D), (D, D), (F, D), (F, D), (D, F)]
        for fname in ("block128", "mxfp8"):
            fmt = FORMATS[fname]
            planned = [fmt.plan_shape(sh) for sh in shapes]
            for world in worlds:
                layout = plan([n for n, _ in planned], [b for _, b in planned], world,
                              align=256 // 2)
                entries = [SimpleNamespace(start=a, stop=a + sh[0] * sh[1], shape=torch.Size(sh))
                           for (a, _), sh in zip(layout.ranges, shapes)]
                p = Packing(entries, [fmt] * len(shapes), layout.shard_size, world, 0,
                            torch.bfloat16, SLOT_ALIGN)
                rows.append(dict(model=name, format=fname, world=world,
                                 bytes_per_weight_elem=p.gather_bytes / p.elements,
                                 planner_padding=layout.padding / (world * layout.shard_size)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--repeats", type=int, default=5)
    add_device_argument(ap)
    args = ap.parse_args(argv)
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        args.world = world
        run = rank_runner(ap, args, timeout=600)
        per_rank = run(_worker, args.dim, args.ffn, args.repeats, args.device)
        rows = per_rank[0]
        for name in ROWS:
            r = rows[name]
            r["gather_ms"] = max(pr[name]["gather_ms"] for pr in per_rank)
            r["quant_ms"] = max(pr[name]["quant_ms"] for pr in per_rank)
            r["quant_over_gather"] = r["quant_ms"] / r["gather_ms"] if r["gather_ms"] else 0.0
            r["bytes_vs_bf16"] = r["bytes_per_elem"] / rows["bf16"]["bytes_per_elem"]
            r["mem_vs_bf16"] = r["transient_mb"] / rows["bf16"]["transient_mb"]
            results.append(dict(world=world, row=name, **r))
    head = (f"{'P':>2} {'row':<16} {'B/elem':>8} {'B/w':>8} {'vs bf16':>7} {'AG':>3} {'AR':>3} "
            f"{'quant ms':>9} {'gather ms':>9} {'q/g':>6} {'transient MB':>12} {'vs bf16':>7}")
    print(head)
    for r in results:
        bw = r.get("bytes_per_weight_elem")
        bw = f"{bw:>8.5f}" if bw is not None else f"{'-':>8}"
        print(f"{r['world']:>2} {r['row']:<16} {r['bytes_per_elem']:>8.5f} {bw} "
              f"{r['bytes_vs_bf16']:>7.4f} {r['all_gathers']:>3} {r['all_reduces']:>3} "
              f"{r['quant_ms']:>9.3f} {r['gather_ms']:>9.3f} {r['quant_over_gather']:>6.3f} "
              f"{r['transient_mb']:>12.2f} {r['mem_vs_bf16']:>7.3f}")
    scale = model_scale()
    print("\nModel scale (planner + packed layout only): bytes per weight element of one block")
    print(f"{'model':<11} {'format':<9} " + " ".join(f"{'P=' + str(w):>8}" for w in
                                                   sorted({r['world'] for r in scale})))
    for (m, f) in dict.fromkeys((r["model"], r["format"]) for r in scale):
        vals = [r["bytes_per_weight_elem"] for r in scale if (r["model"], r["format"]) == (m, f)]
        print(f"{m:<11} {f:<9} " + " ".join(f"{v:>8.5f}" for v in vals))
    commit = commit_id()
    print(json.dumps(dict(benchmark="block_fp8", date=datetime.date.today().isoformat(),
                          commit=commit, torch=torch.__version__, device=args.device, dim=args.dim, ffn=args.ffn,
                          rows=results, model_scale=scale)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
