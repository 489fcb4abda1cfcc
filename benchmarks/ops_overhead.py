"""Per-op overhead of ops on RaggedShard DTensors vs the same ops on torch's Shard(0) DTensors.

The optimizer step's ops on `--n` small tensors (shapes of a model's norms, biases and small
matrices; rows a multiple of the world size, so Shard(0) is even), once as veragged
`RaggedShard((0,), even units)` DTensors and once as torch `Shard(0)` DTensors with the same
shapes and local sizes: the kernels do the same work, the difference is the Python/dispatch
overhead around them. Rows, per call:

  add_ mul_ addcdiv_ lerp_ sqrt     one call per tensor (`x.add_(y, alpha=..)`, ..., `torch.sqrt`),
                                    time per tensor
  _foreach_*                        one call on the list of N tensors
  _foreach_norm                     one call; this rank's partial norms (no communication, both)
  vector_norm                       per tensor `torch.linalg.vector_norm(x).full_tensor()`: the
                                    global norm on every rank (one all-reduce per tensor, both)
  get_total_norm / clip_grad_norm_  torch.nn.utils on the N tensors / on N parameters' grads
                                    (one all-reduce, both)
  adamw_step / adamw_fused_step     torch.optim.AdamW(foreach=True) / (fused=True) `.step()` on
                                    N parameters (torch's fused AdamW on Shard(0): CPU kernel)

Timing: each row runs `--reps` calls per round, rounds alternate torch and veragged, and the
reported time is the best (minimum) over `--rounds` rounds, as `timeit` reports, gc disabled while
timing. The clock is this process's CPU time (`time.process_time`, `--clock cpu`, the default): the
overhead measured here is CPU work, and on a shared machine wall time mostly measures the other
processes; `--clock wall` uses `time.perf_counter` (collectives' waiting included). The ratio is
veragged / torch from the same run (target: <= 1.5x). Absolute CPU times vary with the machine;
the ratios are the point. Default: one process with a 1-rank gloo group (`--world 2`: two gloo
ranks, times of rank 0, collectives included). Prints a table and one JSON line (`--json`: only
the JSON).

    python benchmarks/ops_overhead.py [--n 64] [--reps 20] [--rounds 15] [--world 1]
        [--clock cpu] [--only OP ...] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import veragged  # noqa: E402
from veragged import RaggedShard  # noqa: E402

TARGET = 1.5
# A transformer block's small tensors: norms and biases (1-D), small matrices.
BASE_SHAPES = [(64,), (64, 16), (32,), (16, 64), (128,), (32, 8)]


def _shapes(n: int):
    return [BASE_SHAPES[i % len(BASE_SHAPES)] for i in range(n)]


def _tensors(kind: str, mesh, n: int, seed: int, positive=False):
    world = mesh.size()
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in _shapes(n):
        full = torch.randn(shape, generator=g)
        if positive:
            full = full.abs() + 1
        if kind == "torch":
            out.append(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None))
        else:
            placement = RaggedShard((0,), (1,) * world)  # even rows, as Shard(0) here
            out.append(veragged.distribute_tensor(full, mesh, [placement], src_data_rank=None))
    return out


def _params(kind, mesh, n, seed):
    ps = [torch.nn.Parameter(t) for t in _tensors(kind, mesh, n, seed)]
    for p, g in zip(ps, _tensors(kind, mesh, n, seed + 1)):
        p.grad = g
    return ps


def _cases(kind: str, mesh, n: int):
    """name -> (per_tensor, callable running the op once per round unit)."""
    xs = _tensors(kind, mesh, n, 0)
    ys = _tensors(kind, mesh, n, 1)
    zs = _tensors(kind, mesh, n, 2, positive=True)
    pairs = list(zip(xs, ys, zs))
    params = _params(kind, mesh, n, 3)
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    fparams = _params(kind, mesh, n, 5)
    fopt = torch.optim.AdamW(fparams, lr=1e-6, fused=True)
    clip = _params(kind, mesh, n, 7)

    def each(fn):
        def run():
            for x, y, z in pairs:
                fn(x, y, z)

        return run

    return {
        "add_": (True, each(lambda x, y, z: x.add_(y, alpha=1e-6))),
        "mul_": (True, each(lambda x, y, z: x.mul_(1.0))),
        "addcdiv_": (True, each(lambda x, y, z: x.addcdiv_(y, z, value=1e-6))),
        "lerp_": (True, each(lambda x, y, z: x.lerp_(y, 1e-6))),
        "sqrt": (True, each(lambda x, y, z: torch.sqrt(z))),
        "_foreach_add_": (False, lambda: torch._foreach_add_(xs, ys, alpha=1e-6)),
        "_foreach_mul_": (False, lambda: torch._foreach_mul_(xs, 1.0)),
        "_foreach_addcdiv_": (False, lambda: torch._foreach_addcdiv_(xs, ys, zs, value=1e-6)),
        "_foreach_lerp_": (False, lambda: torch._foreach_lerp_(xs, ys, 1e-6)),
        "_foreach_sqrt": (False, lambda: torch._foreach_sqrt(zs)),
        "_foreach_norm": (False, lambda: torch._foreach_norm(xs)),
        "vector_norm": (True, each(lambda x, y, z: torch.linalg.vector_norm(x).full_tensor())),
        "get_total_norm": (False, lambda: torch.nn.utils.get_total_norm(xs).full_tensor()),
        "clip_grad_norm_": (
            False, lambda: torch.nn.utils.clip_grad_norm_(clip, 1e9).full_tensor()
        ),
        "adamw_step": (False, opt.step),
        "adamw_fused_step": (False, fopt.step),
    }


_CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = _CLOCKS["cpu"]


def _time(fn, reps: int) -> float:
    t0 = _clock()
    for _ in range(reps):
        fn()
    return (_clock() - t0) / reps


def measure(n: int, reps: int, rounds: int, only=None, clock="cpu"):
    """{op: {"torch_us", "veragged_us", "ratio"}} on the current process group."""
    global _clock
    _clock = _CLOCKS[clock]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = {kind: _cases(kind, mesh, n) for kind in ("torch", "veragged")}
    rows = {}
    with torch.no_grad():
        for name, (per_tensor, _) in cases["torch"].items():
            if only and name not in only:
                continue
            samples = {"torch": [], "veragged": []}
            for kind in samples:  # warm-up (caches, lazy state)
                _time(cases[kind][name][1], 2)
            gc.collect()
            gc.disable()
            try:
                for _ in range(rounds):
                    for kind in samples:
                        samples[kind].append(_time(cases[kind][name][1], reps))
            finally:
                gc.enable()
            per = n if per_tensor else 1
            t, v = (min(samples[k]) / per * 1e6 for k in ("torch", "veragged"))
            rows[name] = {"torch_us": round(t, 2), "veragged_us": round(v, 2),
                          "ratio": round(v / t, 3)}
    return rows


def _worker(n, reps, rounds, only, clock):
    return measure(n, reps, rounds, only, clock)


def _single(n, reps, rounds, only, clock):
    store = dist.FileStore(tempfile.mktemp(prefix="ops_overhead_"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return measure(n, reps, rounds, only, clock)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=64, help="number of tensors")
    parser.add_argument("--reps", type=int, default=20, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (best of)")
    parser.add_argument("--world", type=int, default=1, help="gloo ranks (1: in process)")
    parser.add_argument("--only", nargs="*", help="run only these ops")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="cpu",
                        help="cpu: this process's CPU time (default); wall: elapsed time")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.world == 1:
        rows = _single(args.n, args.reps, args.rounds, args.only, args.clock)
    else:
        from tests.harness import run_on_ranks

        job = (args.n, args.reps, args.rounds, args.only, args.clock)
        rows = run_on_ranks(_worker, args.world, args=job, timeout=3600)[0]
    if not args.json:
        print(f"ops_overhead: {args.n} tensors, {args.world} gloo rank(s), {args.clock} time, best "
              f"of {args.rounds} rounds x {args.reps} calls; us per call (per tensor for "
              f"per-tensor ops); ratio = veragged / torch Shard(0) DTensor, target <= {TARGET}")
        print(f"{'op':<20}{'torch us':>11}{'veragged us':>13}{'ratio':>8}")
        for name, r in rows.items():
            mark = "" if r["ratio"] <= TARGET else "  MISS"
            print(f"{name:<20}{r['torch_us']:>11.1f}{r['veragged_us']:>13.1f}"
                  f"{r['ratio']:>8.2f}{mark}")
    misses = sorted(k for k, r in rows.items() if r["ratio"] > TARGET)
    print(json.dumps({"benchmark": "ops_overhead", "n": args.n, "world_size": args.world,
                      "clock": args.clock,
                      "torch_version": torch.__version__, "target_ratio": TARGET,
                      "ops": rows, "misses": misses}))


if __name__ == "__main__":
    main()
