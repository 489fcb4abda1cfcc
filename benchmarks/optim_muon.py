"""Distributed Muon step, 4 gloo ranks on CPU, the example's Llama model under veragged.fully_shard.

Three ways to run the same optimizer step (the results are bitwise equal; tests/optim checks it):

  owners       veragged: each matrix orthogonalised once, on its LPT-balanced owner; matrices
               move in micro-groups, one all-to-all each, pipelined with Newton-Schulz;
  replicated   every rank gathers every matrix and orthogonalises all of them (what DDP-style
               Muon does under FSDP);
  per-matrix   owners as above but one matrix per all-to-all (capacity 1: no micro-groups).

Columns: median step time of the slowest rank (ms) and its ratio to `replicated`, the number of
micro-groups, and the plan's max/mean load. Prints a table and one JSON line.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import torch
import torch.distributed as dist

import veragged
from tests.harness import get_mesh, run_on_ranks
from tests.harness.grads import set_grads
from veragged.models.llama import Llama, LlamaConfig, muon_param_groups

WORLD = 4
SIZES = {"small": (256, 4), "medium": (512, 4)}
QUICK_SIZES = {"tiny": (64, 2)}
MODES = {
    "owners": dict(owners="lpt"),
    "replicated": dict(owners="replicated"),
    "per-matrix": dict(owners="lpt", capacity=1),
}


def _worker(mode, dim, layers, steps):
    cfg = LlamaConfig(vocab=256, dim=dim, layers=layers, heads=4, hidden=int(8 * dim / 3))
    torch.manual_seed(0)
    model = Llama(cfg)
    for block in model.blocks:
        veragged.fully_shard(block, mesh=get_mesh())
    veragged.fully_shard(model, mesh=get_mesh())
    opt = veragged.optim.Muon(muon_param_groups(model), lr=0.02, **MODES[mode])
    params = list(model.parameters())
    times = []
    for step in range(steps + 2):
        set_grads(params, step)
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= 2:
            times.append(elapsed.item())
    plan = opt.owner_plans[0] if opt.owner_plans else None
    return {
        "step_s": statistics.median(times),
        "groups": len(plan.groups) if plan else 0,
        "ratio": plan.ratio if plan else 1.0,
        "matrices": len(plan.owners) if plan else 0,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one tiny model, 2 steps")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    sizes, steps = (QUICK_SIZES, 2) if args.quick else (SIZES, args.steps)
    out = sys.stderr if args.json else sys.stdout
    header = f"{'model':7} {'mode':11} {'step ms':>8} {'vs repl':>8} {'groups':>7} {'max/mean':>9}"
    print(header, file=out)
    rows = {}
    for name, (dim, layers) in sizes.items():
        rows[name] = {
            m: run_on_ranks(_worker, WORLD, args=(m, dim, layers, steps), timeout=600)[0]
            for m in MODES
        }
        base = rows[name]["replicated"]["step_s"]
        for m, r in rows[name].items():
            r["vs_replicated"] = r["step_s"] / base
            print(
                f"{name:7} {m:11} {r['step_s'] * 1e3:8.1f} {r['vs_replicated']:8.2f} "
                f"{r['groups']:7d} {r['ratio']:9.3f}",
                file=out,
            )
    summary = {"benchmark": "optim_muon", "world_size": WORLD, "steps": steps, "models": rows}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
