"""Muon, Shampoo and SOAP steps on 4 gloo ranks (owners vs SC vs layer-wise), and the owner
plan's load balance on the Qwen3 family at DP 16-128 under each optimizer's cost model.

Part 1, step time. The example's Llama under veragged.fully_shard (each block, then the root),
synthetic gradients (tests.harness.grads.set_grads), the same param groups in every mode: one
per transformer block, plus one for the embedding, output head and final norm marked non-matrix
(Muon `use_muon=False`, Shampoo and SOAP `precondition=False`, so they step elementwise). Modes:

  owners      owners="lpt": each matrix computed once, on its LPT-balanced owner; matrices move
              in micro-groups, one all-to-all each, pipelined with the compute;
  SC          owners="replicated": every rank gathers every matrix and computes all of them
              (Canzona's synchronous baseline, what DDP-style implementations do);
  local       owners="local": the locality-aware plan (a matrix one rank holds whole is
              computed there; here FSDP splits every dense matrix, so it plans as lpt does,
              ties going to the rank holding more of a matrix);
  layer-wise  owners="layer": each param group (a transformer block) whole on one rank, blocks
              by LPT over their costs, one exchange (NVIDIA's layer-wise distributed optimizer,
              Distributed Shampoo's per-parameter assignment).

Settings: Muon defaults (5 Newton-Schulz steps); Shampoo precondition_frequency=1 (inverse
roots of every factor on every step: the worst case for Shampoo, and the one where the matrix
work dominates most), max_preconditioner_dim=1024; SOAP defaults, precondition_frequency=10
(max_precond_dim=10000), measured over steps covering several eigenbasis refreshes. The results
of all modes are bitwise equal (tests/optim). Columns: the median over the measured steps
(warmup excluded) of the slowest rank's step time (each rank's elapsed time after a barrier,
all_reduce MAX), the mean (which, unlike the median, charges SOAP's refresh steps), the speedup
vs SC (median), the median of the slowest rank's time inside `_compute_many` (the owner's
matrix work; the rest of a step is the exchange, the elementwise work and waiting), and the
plan's max/mean load. Target: owners >= 3x faster than SC for every optimizer (the ideal is ~4x
on 4 ranks when the matrix work dominates). 4 ranks share the machine's cores, SC and owners alike.

Part 2, balance. Every 2-D weight of the transformer layers of Qwen3-1.7B .. 32B (q, k, v, o,
gate, up, down per layer, each its own matrix; the embedding, head and norms stay elementwise,
as in part 1), the shapes of benchmarks/optim_owners.py, at DP 16, 32, 64, 128 under each
optimizer's cost model with its defaults: Muon "flops" (ns_steps 5), Shampoo "shampoo" (f=1,
D=1024), SOAP "soap" (f=10, D=10000); strategies lpt, alpha (alpha=1, buckets = layers) and, for
reference, layer. `bound` is max(largest matrix cost, total / world) / (total / world); `tight`
is benchmarks/optim_owners.py's stronger lower bound (also: some rank takes k + 1 of the
k world + 1 costliest matrices; the exact optimum of the two costliest matrix kinds alone).
Target for lpt: ratio <= 1.05 wherever the bound allows it, equal to the bound elsewhere; a row
where lpt is above both 1.05 and `bound` but equal to `tight` is optimal ("@tight"): no plan does
better on those shapes.

Part 3, MoE. Muon on veragged.models.moe's MoE (16 experts per layer, [E, dim, hidden] stacks,
each expert one matrix: [Note: matrices of a stack]) under veragged.fully_shard with experts
planned whole (granularity: one expert), owners "local" (locality-aware: an expert is computed
on the rank that holds it), "lpt", "layer" and "replicated" (SC), synthetic gradients. Columns:
the median step time of the slowest rank, the bytes every rank received from the others in the
step's all-to-alls and all-gathers (`veragged.tools.peer_traffic.PeerTraffic`, summed over ranks),
the expert elements the plan sends to their owners, and the plan's max/mean load. Target: local
sends <= 0.2x lpt's bytes and is no slower than lpt.

Part 4, batched owner compute ([Note: batched owner products]). The MoE of part 3 in one
process (an owner's work: every matrix whole), each optimizer with its part-1 settings, twice:
same-shape products batched where a probe found that bitwise, and `batched.one_by_one()`.
Columns: the median step time, the launches of one step (veragged.tools.write_counter.LaunchCounter:
every dispatched op but views and allocations), the matrix products among them (mm, addmm, bmm,
baddbmm) and whether the two runs' parameters are bitwise equal after the steps. On a GPU the
launch count is what a step of many small matrices is bound by; on 2 CPU cores the time moves
less.

Prints the tables, whether each target is met, then one JSON line with every number (`--json`:
only the JSON on stdout). `--quick`: a tiny model and two DP sizes (a smoke run for tests).
The default run takes about 6 minutes on 2 CPU cores, most of it in SC's Shampoo and SOAP steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 4
# (dim, layers) of the Llama; hidden = 8 dim / 3 (SwiGLU), heads 4, vocab 256.
MODEL = (384, 4)
QUICK_MODEL = (64, 2)
OPTIMIZERS = ("Muon", "Shampoo", "SOAP")
MODES = {"owners": "lpt", "local": "local", "SC": "replicated", "layer-wise": "layer"}
# warmup, measured steps: SOAP's 30 cover three refreshes (steps 10, 20, 30 of its counter).
STEPS = {"Muon": (2, 6), "Shampoo": (1, 3), "SOAP": (2, 30)}
QUICK_STEPS = {"Muon": (1, 2), "Shampoo": (1, 2), "SOAP": (1, 3)}
SPEEDUP_TARGET = 3.0
RATIO_TARGET = 1.05
DP_SIZES = (16, 32, 64, 128)
QUICK_DP_SIZES = (16, 128)
# Each optimizer's owner-plan cost model and its defaults (part 2).
COST_MODELS = {
    "Muon": dict(cost="flops", ns_steps=5),
    "Shampoo": dict(cost="shampoo", precondition_frequency=1, max_preconditioner_dim=1024),
    "SOAP": dict(cost="soap", precondition_frequency=10, max_preconditioner_dim=10000),
}


def _make_optimizer(name, model, owners):
    import veragged

    blocks = [{"params": list(b.parameters())} for b in model.blocks]
    inner = {id(p) for b in model.blocks for p in b.parameters()}
    rest = [p for p in model.parameters() if id(p) not in inner]  # embed, head, final norm
    if name == "Muon":
        groups = blocks + [{"params": rest, "use_muon": False}]
        return veragged.optim.Muon(groups, lr=0.02, owners=owners)
    groups = blocks + [{"params": rest, "precondition": False}]
    if name == "Shampoo":
        return veragged.optim.Shampoo(groups, lr=0.01, precondition_frequency=1,
                                      max_preconditioner_dim=1024, owners=owners)
    return veragged.optim.SOAP(groups, lr=3e-3, precondition_frequency=10, owners=owners)


def fully_sharded_llama(dim, layers):
    """Part 1's Llama (hidden 8 dim / 3, 4 heads, vocab 256) under veragged.fully_shard on
    this process group's ranks: each block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh

    import veragged
    from veragged.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab=256, dim=dim, layers=layers, heads=4, hidden=int(8 * dim / 3))
    torch.manual_seed(0)
    model = Llama(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        veragged.fully_shard(block, mesh=mesh)
    veragged.fully_shard(model, mesh=mesh)
    return model


def _worker(name, mode, dim, layers, warmup, steps):
    from tests.harness.grads import set_grads

    model = fully_sharded_llama(dim, layers)
    opt = _make_optimizer(name, model, MODES[mode])
    # Time inside the owner compute (the matrix work), per step, on this rank.
    computing = [0.0]
    compute = opt._compute_many

    def timed_compute(ms, fulls):
        start = time.perf_counter()
        out = compute(ms, fulls)
        computing[0] += time.perf_counter() - start
        return out

    opt._compute_many = timed_compute
    params = list(model.parameters())
    times, compute_times = [], []
    for step in range(warmup + steps):
        set_grads(params, step)
        computing[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        both = torch.tensor([time.perf_counter() - start, computing[0]], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(both[0].item())
            compute_times.append(both[1].item())
    plan = opt.owner_plans[0] if opt.owner_plans else None
    return {
        "step_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "compute_s": statistics.median(compute_times),
        "steps_s": times,
        "ratio": plan.ratio if plan else None,
        "groups": len(plan.groups) if plan else None,
        "matrices": len(opt.matrices()),
    }


def step_times(dim, layers, step_counts):
    """Every optimizer and mode on one pool of WORLD ranks (started once; each run builds its
    own model and optimizer)."""
    from tests.harness.pool import get_pool

    pool = get_pool(WORLD, device="cpu")
    rows = {}
    for name in OPTIMIZERS:
        warmup, steps = step_counts[name]
        rows[name] = {}
        for mode in MODES:
            rows[name][mode] = pool.run(
                _worker, name, mode, dim, layers, warmup, steps, timeout=1800
            )[0]
            rows[name][mode].update(warmup=warmup, steps=steps)
        base = rows[name]["SC"]["step_s"]
        for r in rows[name].values():
            r["speedup_vs_sc"] = base / r["step_s"]
    return rows


# Part 3: Muon on an MoE whose experts the planner keeps whole (one expert per block).
MOE = dict(dim=192, hidden=96, experts=16, layers=2)
QUICK_MOE = dict(dim=32, hidden=16, experts=16, layers=1)
MOE_MODES = {"local": "local", "lpt": "lpt", "layer-wise": "layer", "SC": "replicated"}
MOE_STEPS, QUICK_MOE_STEPS = (2, 6), (1, 2)
BYTES_TARGET = 0.2


def _moe_worker(mode, spec, warmup, steps):
    from torch.distributed.device_mesh import init_device_mesh

    import veragged
    from tests.harness.grads import set_grads
    from veragged.models.moe import MoE, MoEConfig
    from veragged.tools.peer_traffic import PeerTraffic

    cfg = MoEConfig(vocab=256, dim=spec["dim"], layers=spec["layers"], heads=4,
                    experts=spec["experts"], top_k=2, hidden=spec["hidden"])
    torch.manual_seed(0)
    model = MoE(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def whole_experts(fqn, p):
        return p[0].numel() if p.ndim == 3 else None

    for block in model.blocks:
        veragged.fully_shard(block, mesh=mesh, granularity_fn=whole_experts)
    veragged.fully_shard(model, mesh=mesh, granularity_fn=whole_experts)
    blocks = [{"params": list(b.parameters())} for b in model.blocks]
    inner = {id(p) for b in model.blocks for p in b.parameters()}
    rest = [p for p in model.parameters() if id(p) not in inner]
    opt = veragged.optim.Muon(blocks + [{"params": rest, "use_muon": False}], lr=0.02,
                              owners=MOE_MODES[mode])
    params = list(model.parameters())
    times = []
    for step in range(warmup + steps):
        set_grads(params, step)
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        t = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(t.item())
    set_grads(params, warmup + steps)
    with PeerTraffic() as traffic:
        opt.step()
    received = torch.tensor(traffic.bytes, dtype=torch.int64)
    dist.all_reduce(received)  # every rank's bytes from the others: the network's total
    experts = [m for m in opt.matrices() if m.index is not None]
    moved = sum(m.layout.numel - m.layout.size(m.owner) for m in experts
                if m.owner is not None) if opt.owner_plans else None
    plan = opt.owner_plans[0] if opt.owner_plans else None
    return {
        "step_s": statistics.median(times),
        "steps_s": times,
        "bytes": int(received.item()),
        "expert_elements_moved": moved,
        "ratio": plan.ratio if plan else None,
        "matrices": len(opt.matrices()),
        "experts": len(experts),
    }


def moe_step_times(spec, step_counts):
    from tests.harness.pool import get_pool

    pool = get_pool(WORLD, device="cpu")
    warmup, steps = step_counts
    rows = {}
    for mode in MOE_MODES:
        rows[mode] = pool.run(_moe_worker, mode, spec, warmup, steps, timeout=1800)[0]
    for r in rows.values():
        r["time_vs_lpt"] = r["step_s"] / rows["lpt"]["step_s"]
        r["bytes_vs_lpt"] = r["bytes"] / rows["lpt"]["bytes"] if rows["lpt"]["bytes"] else None
    return rows


def print_moe_table(rows, spec, out):
    print(f"Muon on an MoE ({spec['experts']} experts per layer, {spec['layers']} layers, dim "
          f"{spec['dim']}, expert hidden {spec['hidden']}; experts planned whole), {WORLD} gloo "
          "ranks (slowest rank)", file=out)
    head = ["owners", "step ms", "vs lpt", "bytes/step", "vs lpt", "expert elems moved",
            "ratio"]
    lines = []
    for mode, r in rows.items():
        moved = "-" if r["expert_elements_moved"] is None else f"{r['expert_elements_moved']:,}"
        lines.append([
            mode, f"{r['step_s'] * 1e3:.1f}", f"{r['time_vs_lpt']:.2f}", f"{r['bytes']:,}",
            "-" if r["bytes_vs_lpt"] is None else f"{r['bytes_vs_lpt']:.2f}", moved,
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
        ])
    _print_lines(head, lines, out)


PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")
BATCH_STEPS, QUICK_BATCH_STEPS = 6, 2


def batched_compute(spec, steps):
    """Part 4: each optimizer on the plain MoE, batched and one by one, in this process."""
    from veragged.optim import batched
    from veragged.tools.write_counter import LaunchCounter
    from tests.harness.grads import set_grads
    from veragged.models.moe import MoE, MoEConfig

    cfg = MoEConfig(vocab=256, dim=spec["dim"], layers=spec["layers"], heads=4,
                    experts=spec["experts"], top_k=2, hidden=spec["hidden"])
    rows = {}
    modes = {"batched": contextlib.nullcontext, "one by one": batched.one_by_one}
    for name in OPTIMIZERS:  # the two runs step in turn, so drifts of the machine hit both
        runs = {}
        for mode in modes:
            torch.manual_seed(0)
            model = MoE(cfg)
            runs[mode] = (list(model.parameters()), _make_optimizer(name, model, "lpt"))
        times = {mode: [] for mode in modes}
        for step in range(steps + 1):  # the first (probes, SOAP's setup) untimed
            for mode, (params, opt) in runs.items():
                set_grads(params, step)
                with modes[mode]():
                    start = time.perf_counter()
                    opt.step()
                    if step:
                        times[mode].append(time.perf_counter() - start)
        row = {}
        for mode, (params, opt) in runs.items():
            set_grads(params, steps + 1)
            with modes[mode](), _ProductCounter() as products, LaunchCounter() as launches:
                opt.step()
            row[mode] = {"step_s": statistics.median(times[mode]), "steps_s": times[mode],
                         "launches": sum(launches.counts.values()),
                         "products": products.count}
        row["bitwise"] = all(torch.equal(a, b) for a, b in zip(runs["batched"][0],
                                                                runs["one by one"][0]))
        row["time_ratio"] = row["batched"]["step_s"] / row["one by one"]["step_s"]
        row["launch_ratio"] = row["batched"]["launches"] / row["one by one"]["launches"]
        rows[name] = row
    return rows


class _ProductCounter(TorchDispatchMode):
    """Counts the matrix products dispatched (mm, addmm, bmm, baddbmm)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in PRODUCTS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def print_batch_table(rows, spec, out):
    print(f"Batched owner compute: the MoE of part 3 ({spec['experts']} experts per layer) in one "
          "process, batched vs one by one", file=out)
    head = ["optimizer", "step ms", "one-by-one ms", "time ratio", "launches", "one-by-one",
            "products", "one-by-one", "bitwise"]
    lines = []
    for name, r in rows.items():
        b, o = r["batched"], r["one by one"]
        lines.append([name, f"{b['step_s'] * 1e3:.1f}", f"{o['step_s'] * 1e3:.1f}",
                      f"{r['time_ratio']:.2f}", f"{b['launches']:,}", f"{o['launches']:,}",
                      f"{b['products']:,}", f"{o['products']:,}",
                      "yes" if r["bitwise"] else "NO"])
    _print_lines(head, lines, out)


def print_step_table(rows, dim, layers, out):
    print(f"Step time, {WORLD} gloo ranks, Llama dim {dim}, {layers} layers (slowest rank)",
          file=out)
    head = ["optimizer", "mode", "step ms", "mean ms", "vs SC", "compute ms", "load ratio",
            "steps"]
    lines = []
    for name, modes in rows.items():
        for mode, r in modes.items():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            lines.append([name, mode, f"{r['step_s'] * 1e3:.1f}", f"{r['mean_s'] * 1e3:.1f}",
                          f"{r['speedup_vs_sc']:.2f}x", f"{r['compute_s'] * 1e3:.1f}", ratio,
                          f"{r['warmup']}+{r['steps']}"])
    _print_lines(head, lines, out)


def _print_lines(head, lines, out):
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    for line in [head, ["-" * w for w in widths]] + lines:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)), file=out)


def _load_optim_owners():
    """benchmarks/optim_owners.py (Qwen3 configs, shapes, the tight bound) as a module."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_owners.py")
    spec = importlib.util.spec_from_file_location("_optim_owners", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def balance(dp_sizes, models):
    import veragged  # noqa: F401  (registers torch.ops.veragged.plan_owners)
    from veragged.optim.owners import block_costs, plan_owners

    oo = _load_optim_owners()
    rows = []
    for model in models:
        shapes, layers = oo.muon_shapes(oo.QWEN3[model])
        for name, options in COST_MODELS.items():
            costs = block_costs(shapes, **options)
            total, largest = sum(costs), max(costs)
            for m in dp_sizes:
                lpt = plan_owners(shapes, m, strategy="lpt", **options)
                alpha = plan_owners(shapes, m, strategy="alpha", buckets=layers, **options)
                layer = plan_owners(shapes, m, strategy="layer", buckets=layers, **options)
                bound = max(largest, total / m) / (total / m)
                tight = oo.bound_ratio(costs, m, max(lpt.loads))
                assert bound <= tight * (1 + 1e-12) and tight <= lpt.ratio * (1 + 1e-12)
                rows.append({
                    "model": model, "optimizer": name, "cost": options["cost"], "dp": m,
                    "lpt": lpt.ratio, "alpha": alpha.ratio, "layer": layer.ratio,
                    "bound": bound, "tight": tight,
                    "lpt_verdict": _verdict(lpt.ratio, bound, tight),
                    "alpha_verdict": _verdict(alpha.ratio, bound, tight),
                })
    return rows


def _verdict(ratio, bound, tight):
    """"met" (<= 1.05, or at the bound where the bound is above 1.05), "@tight" (above both but
    at the tight lower bound: optimal), or "miss"."""
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-9)  # noqa: E731
    if ratio <= RATIO_TARGET or close(ratio, bound):
        return "met"
    if close(ratio, tight):
        return "@tight"
    return "miss"


def print_balance_table(rows, out):
    print("Owner plan load ratio (max/mean) on Qwen3 per cost model; bound = max(largest, "
          "total/dp) / (total/dp)", file=out)
    head = ["model", "optimizer", "cost", "dp", "lpt", "alpha", "layer", "bound", "tight",
            "lpt target", "alpha target"]
    lines = [[r["model"], r["optimizer"], r["cost"], str(r["dp"])]
             + [f"{r[k]:.4f}" for k in ("lpt", "alpha", "layer", "bound", "tight")]
             + [r["lpt_verdict"], r["alpha_verdict"]] for r in rows]
    _print_lines(head, lines, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, few steps, two DP sizes and one Qwen3 model")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--dim", type=int, help=f"Llama width (default {MODEL[0]})")
    parser.add_argument("--layers", type=int, help=f"Llama layers (default {MODEL[1]})")
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    dim, layers = QUICK_MODEL if args.quick else MODEL
    dim, layers = args.dim or dim, args.layers or layers
    step_counts = QUICK_STEPS if args.quick else STEPS
    dp_sizes = QUICK_DP_SIZES if args.quick else DP_SIZES
    models = list(_load_optim_owners().QWEN3)
    models = models[:1] if args.quick else models

    steps = step_times(dim, layers, step_counts)
    print_step_table(steps, dim, layers, out)
    speedups = {name: modes["owners"]["speedup_vs_sc"] for name, modes in steps.items()}
    slow = [f"{n} {s:.2f}x" for n, s in speedups.items() if s < SPEEDUP_TARGET]
    speed_met = not slow
    print(f"target owners >= {SPEEDUP_TARGET:g}x vs SC: "
          + ("met" if speed_met else "NOT met (" + ", ".join(slow) + ")"), file=out)
    print(file=out)

    moe_spec = QUICK_MOE if args.quick else MOE
    moe = moe_step_times(moe_spec, QUICK_MOE_STEPS if args.quick else MOE_STEPS)
    print_moe_table(moe, moe_spec, out)
    local, lpt = moe["local"], moe["lpt"]
    moe_bytes_met = local["bytes_vs_lpt"] is not None and local["bytes_vs_lpt"] <= BYTES_TARGET
    moe_time_met = local["step_s"] <= lpt["step_s"]
    print(f"target local bytes <= {BYTES_TARGET:g}x lpt's: "
          + ("met" if moe_bytes_met else f"NOT met ({local['bytes_vs_lpt']})")
          + f"; local no slower than lpt: {'met' if moe_time_met else 'NOT met'} "
          f"({local['time_vs_lpt']:.2f}x)", file=out)
    print(file=out)

    batch = batched_compute(moe_spec, QUICK_BATCH_STEPS if args.quick else BATCH_STEPS)
    print_batch_table(batch, moe_spec, out)
    print("batched results bitwise the one-by-one ones: "
          + ("yes" if all(r["bitwise"] for r in batch.values()) else "NO"), file=out)
    print(file=out)

    rows = balance(dp_sizes, models)
    print_balance_table(rows, out)
    verdicts = [r["lpt_verdict"] for r in rows]
    ratio_met = all(v == "met" for v in verdicts)
    optimal = sum(v == "@tight" for v in verdicts)
    missed = [f"{r['model']} {r['optimizer']} dp={r['dp']}" for r in rows
              if r["lpt_verdict"] == "miss"]
    print(f"target lpt ratio <= {RATIO_TARGET} or = bound: "
          + ("met" if ratio_met else
             f"NOT met in {len(rows) - verdicts.count('met')} of {len(rows)} rows "
             f"({optimal} at the tight lower bound, i.e. optimal; "
             f"{len(missed)} above it{': ' + '; '.join(missed) if missed else ''})"),
          file=out)
    summary = {
        "benchmark": "optim_matrix",
        "world_size": WORLD,
        "model": {"dim": dim, "layers": layers, "hidden": int(8 * dim / 3), "heads": 4,
                  "vocab": 256},
        "settings": {"Muon": "defaults", "Shampoo": "precondition_frequency=1, "
                     "max_preconditioner_dim=1024", "SOAP": "precondition_frequency=10"},
        "step": steps,
        "moe": {"spec": moe_spec, "rows": moe, "bytes_target": BYTES_TARGET,
                "bytes_met": moe_bytes_met, "time_met": moe_time_met},
        "batched": batch,
        "speedup_target": SPEEDUP_TARGET,
        "speedup_met": speed_met,
        "cost_models": COST_MODELS,
        "balance": rows,
        "ratio_target": RATIO_TARGET,
        "ratio_met": ratio_met,
        "ratio_at_tight_bound": optimal,
        "ratio_missed": missed,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
