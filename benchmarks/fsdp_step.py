"""Training-step cost of veragged.fully_shard vs torch's fully_shard, 4 gloo ranks on CPU.

The example's Llama model at a few sizes, fp32, AdamW, each block and the root sharded, the same
batches for both, in one run. Columns (ratios are veragged / torch; below 1 is better):

  step ms    median over `--steps` (after 2 warm-up steps) of the slowest rank's step time;
  peak MiB   growth of the process's peak RSS over the training steps (CPU has no allocator
             statistics), the largest over ranks: parameters, gradients, optimizer state and
             FSDP's buffers;
  copied KiB bytes written by copy-like ops outside collectives in one step, per rank, minus
             what the model itself copies (veragged.testing.copies.CopyCounter);
  padding    padded elements / parameter elements: the planner's for veragged, dim-0 chunk
             padding per parameter for torch.

Targets (issue 4): step time <= 0.9x, peak memory <= 0.85x, 0 bytes copied. Prints a table and
one JSON line (`--json`: only the JSON).
"""

import argparse
import json
import math
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from veragged.testing import get_mesh, run_on_ranks
from veragged.testing.copies import CopyCounter
from veragged.testing.llama import Llama, LlamaConfig

WORLD = 4
SIZES = {"tiny": (128, 2), "small": (256, 4), "medium": (512, 4)}
QUICK_SIZES = {"tiny": (64, 2)}
BATCH, SEQ = 2, 64


def _rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(kind, dim, layers, steps):
    mesh, rank = get_mesh(), dist.get_rank()
    cfg = LlamaConfig(vocab=256, dim=dim, layers=layers, heads=4, hidden=int(8 * dim / 3), max_seq=SEQ)
    torch.manual_seed(0)
    model = Llama(cfg)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab, (steps + 3, WORLD * BATCH, SEQ + 1), generator=g)
    local = data[:, rank * BATCH : (rank + 1) * BATCH]
    with CopyCounter() as plain:
        model.loss(local[0]).backward()
    model.zero_grad(set_to_none=True)
    shard = veragged.fully_shard if kind == "veragged" else torch_fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(tokens):
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()

    rss0 = _rss_mib()
    for i in range(2):
        step(local[i])
    times = []
    for i in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(local[2 + i])
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    with CopyCounter() as counter:
        step(local[-1])
    peak = torch.tensor([_rss_mib() - rss0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if kind == "veragged":
        groups = {g for m in model.modules() if isinstance(m, veragged.FSDPModule)
                  for g in m._veragged_state.groups}
        padding = sum(gr.buffer.layout.padding for gr in groups)
    else:
        padding = sum(
            (-p.shape[0] % WORLD) * (p.numel() // p.shape[0]) for p in Llama(cfg).parameters()
        )
    numel = sum(p.numel() for p in Llama(cfg).parameters())
    return {
        "step_s": statistics.median(times),
        "peak_mib": peak.item(),
        "copied_bytes": counter.copied - plain.copied,
        "padding": padding / numel,
        "params": numel,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="one tiny model, 3 steps")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    sizes, steps = (QUICK_SIZES, 3) if args.quick else (SIZES, args.steps)
    out = sys.stderr if args.json else sys.stdout
    print(
        f"{'model':8} {'params':>8} {'torch ms':>9} {'ours ms':>8} {'ratio':>6} {'torch MiB':>10} "
        f"{'ours MiB':>9} {'ratio':>6} {'torch KiB cp':>13} {'ours KiB cp':>12} {'pad torch':>10} {'pad ours':>9}",
        file=out,
    )
    rows = {}
    for name, (dim, layers) in sizes.items():
        r = {}
        for kind in ("torch", "veragged"):
            r[kind] = run_on_ranks(_worker, WORLD, args=(kind, dim, layers, steps), timeout=600)[0]
        t, v = r["torch"], r["veragged"]
        rows[name] = {
            "dim": dim,
            "layers": layers,
            "torch": t,
            "veragged": v,
            "time_ratio": v["step_s"] / t["step_s"],
            "memory_ratio": v["peak_mib"] / t["peak_mib"] if t["peak_mib"] > 0 else math.nan,
        }
        print(
            f"{name:8} {v['params'] / 1e6:7.2f}M {t['step_s'] * 1e3:9.1f} {v['step_s'] * 1e3:8.1f} "
            f"{rows[name]['time_ratio']:6.2f} {t['peak_mib']:10.1f} {v['peak_mib']:9.1f} "
            f"{rows[name]['memory_ratio']:6.2f} {t['copied_bytes'] / 1024:13.1f} {v['copied_bytes'] / 1024:12.1f} "
            f"{t['padding']:10.2%} {v['padding']:9.2%}",
            file=out,
        )
    print(json.dumps({"benchmark": "fsdp_step", "world_size": WORLD, "steps": steps, "models": rows}))


if __name__ == "__main__":
    main()
