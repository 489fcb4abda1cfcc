"""Where the host time of RaggedShard ops and of a fully_shard step goes, by layer.

This bounds what a C++ RaggedShard placement or DBuffer core could save: at most the time of
our own Python (our frames and the interpreter builtins they call). The kernels, torch's C++
dispatch and torch's own Python would remain.

Both parts time and profile with the main thread's CPU time (`time.thread_time`), which other
jobs on the machine and waits for other ranks do not inflate.

Part 1, per op (one process, a 1-rank gloo group, best of `--rounds` rounds, gc off): the same
  ops on `--n` small tensors as plain tensors, as torch `Shard(0)` DTensors and as
  `RaggedShard((0,), even units)` DTensors (the shapes of benchmarks/ops_overhead.py). Then one
  cProfile of the RaggedShard op in a loop: the share of the profile that is Python in
  veragged/placement/ ("placement py") and in torch ("torch py"). "bound us" is the smaller of
  ragged x placement share and ragged - plain.
Part 2, per step (the `moe` model of benchmarks/fsdp_step.py, 1053 tensors, `--world` gloo
  ranks, each block and the root sharded by veragged's and by torch's fully_shard,
  torch.optim.AdamW, steps alternating between the two; phases as benchmarks/host_work.py has
  them: forward, backward, torch's clip_grad_norm_, step + zero_grad): rank 0's least CPU time
  per phase over `--steps` unprofiled steps, then its cProfile of `--steps` more, split by where
  each function lives:
    py        Python of each layer (veragged/placement, dbuffer, fsdp, runtime, the rest of
              veragged, the model, torch's fsdp, torch's DTensor, the rest of torch's Python):
              its frames' self time and the builtins they call;
    C from    torch's C functions (ops through the C++ dispatcher, kernels, autograd's engine)
              charged to the layer of the Python frame that called them;
    colls     collectives and waits on them, kept apart.
  "ours py / host" is placement + dbuffer + fsdp + runtime Python over the profile less the
  collectives; "bound ms" applies it to the unprofiled phase. For the torch side the share of
  torch's own FSDP2 and DTensor Python ("fsdp+dtensor py / host"). cProfile charges its
  per-call cost to frames that make many calls, so the Python shares are upper estimates.
  `--top` lists our Python files and functions with the most self time.

    python benchmarks/host_profile.py [--part ops|step|both] [--n 64] [--reps 10] [--rounds 7]
        [--world 2] [--steps 3] [--top 12] [--json]

Prints tables and one JSON line (`--json`: only the JSON). Part 2 is about a minute on 2 CPU
cores.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import os
import pstats
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_step  # noqa: E402  (the MoE model and how it is sharded)
import host_work  # noqa: E402  (the phased step)

import veragged  # noqa: E402
from veragged import RaggedShard  # noqa: E402

_ROOT = os.path.dirname(os.path.abspath(veragged.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OURS = ("placement", "dbuffer", "fsdp", "runtime")
LAYERS = (*_OURS, "veragged other", "model", "torch fsdp", "torch dtensor", "torch python",
          "other python")
_TORCH_LAYERS = {os.path.join("distributed", "fsdp"): "torch fsdp",
                 os.path.join("distributed", "tensor"): "torch dtensor"}
_COLL = ("wait", "all_gather", "reduce_scatter", "all_reduce", "barrier", "broadcast",
         "all_to_all", "_allgather", "_reduce_scatter")


def _layer(path: str) -> str:
    path = os.path.abspath(path)
    if path.startswith(_ROOT):
        head = path[len(_ROOT):].split(os.sep, 1)[0]
        if head in _OURS:
            return head
        return "model" if head == "models" else "veragged other"
    if path.startswith(_TORCH):
        rest = path[len(_TORCH):]
        return next((v for k, v in _TORCH_LAYERS.items() if rest.startswith(k)), "torch python")
    if path.endswith("fsdp_step.py"):
        return "model"
    return "other python"


def _is_torch_c(name: str) -> bool:
    return "torch" in name or "_C." in name


def split(stats: pstats.Stats) -> Counter:
    """Seconds by (layer, "py" | "C") plus ("colls", "C") and ("total", "").

    "py" is a layer's Python: its frames' self time and the interpreter's builtins they call
    (isinstance, dict and list methods, ...), which a C++ core would replace. "C" is the torch C
    functions it calls (ops, kernels, autograd's engine), which would remain."""
    out: Counter = Counter()
    for (path, _, name), (_, _, tt, _, callers) in stats.stats.items():
        out[("total", "")] += tt
        if path != "~":  # a Python function: its self time
            out[(_layer(path), "py")] += tt
            continue
        if any(c in name for c in _COLL):
            out[("colls", "C")] += tt
            continue
        kind = "C" if _is_torch_c(name) else "py"
        # A C function: charge its time to its callers' layers, by their share of its time.
        shares = {c: v[2] for c, v in callers.items()}
        whole = sum(shares.values()) or 1.0
        for (cpath, _, _), t in shares.items():
            layer = _layer(cpath) if cpath != "~" else "other python"
            out[(layer, kind)] += tt * t / whole
    return out


# ---- part 1: per op ---------------------------------------------------------------------------

def _op_cases(kind: str, mesh, n: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    import ops_overhead

    g = torch.Generator().manual_seed(0)

    def make(positive=False):
        out = []
        for shape in ops_overhead._shapes(n):
            full = torch.randn(shape, generator=g)
            full = full.abs() + 1 if positive else full
            if kind == "plain":
                out.append(full)
            elif kind == "torch":
                out.append(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None))
            else:
                out.append(veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (1,))],
                                                      src_data_rank=None))
        return out

    xs, ys, zs = make(), make(), make(positive=True)
    params = [torch.nn.Parameter(t) for t in make()]
    for p, t in zip(params, make()):
        p.grad = t
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)

    def each(fn):
        return lambda: [fn(x, y, z) for x, y, z in zip(xs, ys, zs)]

    return {
        "add_": (True, each(lambda x, y, z: x.add_(y, alpha=1e-6))),
        "mul_": (True, each(lambda x, y, z: x.mul_(1.0))),
        "lerp_": (True, each(lambda x, y, z: x.lerp_(y, 1e-6))),
        "sqrt": (True, each(lambda x, y, z: torch.sqrt(z))),
        "_foreach_add_": (False, lambda: torch._foreach_add_(xs, ys, alpha=1e-6)),
        "_foreach_norm": (False, lambda: torch._foreach_norm(xs)),
        "adamw_step": (False, opt.step),
    }


def _cpu_time(fn, reps: int) -> float:
    t0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t0) / reps


def per_op(n: int, reps: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(tempfile.mktemp(prefix="host_profile_"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        kinds = ("plain", "torch", "ragged")
        cases = {k: _op_cases(k, mesh, n) for k in kinds}
        rows = {}
        with torch.no_grad():
            for name, (per_tensor, _) in cases["ragged"].items():
                for k in kinds:
                    _cpu_time(cases[k][name][1], 2)  # warm-up: caches, lazy state
                best = dict.fromkeys(kinds, float("inf"))
                gc.collect()
                gc.disable()
                try:
                    for _ in range(rounds):
                        for k in kinds:
                            best[k] = min(best[k], _cpu_time(cases[k][name][1], reps))
                finally:
                    gc.enable()
                per = n if per_tensor else 1
                us = {k: best[k] / per * 1e6 for k in kinds}
                prof = _profiler()
                prof.enable()
                for _ in range(reps):
                    cases["ragged"][name][1]()
                prof.disable()
                parts = split(pstats.Stats(prof))
                total = parts[("total", "")] or 1.0
                share = parts[("placement", "py")] / total
                torch_share = parts[("torch python", "py")] / total
                rows[name] = {"plain_us": round(us["plain"], 2), "torch_us": round(us["torch"], 2),
                              "ragged_us": round(us["ragged"], 2),
                              "placement_python_share": round(share, 3),
                              "torch_python_share": round(torch_share, 3),
                              "bound_us": round(min(us["ragged"] * share,
                                                    us["ragged"] - us["plain"]), 2)}
    finally:
        dist.destroy_process_group()
    return rows


# ---- part 2: per step -------------------------------------------------------------------------

SPEC = {"dim": 64, "layers": 14, "experts": 16, "hidden": 32}
SIDES = ("veragged", "torch")


class _Phases:
    """host_work's phase tracker: the main thread's CPU time at each phase change, and with
    `profs` the phase's profiler on and the previous one off."""

    def __init__(self, profs: dict | None = None):
        self.profs, self._phase, self.marks = profs, None, []

    @property
    def phase(self):
        return self._phase

    @phase.setter
    def phase(self, name):
        self.marks.append(time.thread_time())
        if self.profs and self._phase is not None:
            self.profs[self._phase].disable()
        self._phase = name
        if self.profs:
            self.profs[name].enable()

    def finish(self) -> list[float]:
        if self.profs:
            self.profs[self._phase].disable()
        self.marks.append(time.thread_time())
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _profiler() -> cProfile.Profile:
    return cProfile.Profile(time.thread_time)  # CPU time: deaf to other jobs and to waits


def _step_worker(steps: int, top: int) -> dict:
    """Both sides in the same ranks, their steps alternating (as host_work's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fsdp_step.device_mesh("cpu")
    sides = {k: fsdp_step._sharded(k, "moe", SPEC, "adamw", mesh, False) for k in SIDES}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, fsdp_step.VOCAB, (2 * steps + 2, world * fsdp_step.BATCH,
                                              fsdp_step.SEQ + 1), generator=g)
    local = data[:, rank * fsdp_step.BATCH:(rank + 1) * fsdp_step.BATCH]
    for i in range(2):
        for k in SIDES:
            host_work._phased_step(*sides[k], local[i])
    times = {k: [] for k in SIDES}
    for i in range(steps):
        for k in SIDES if i % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            phases = _Phases()
            host_work._phased_step(*sides[k], local[2 + i], (phases,))
            times[k].append(phases.finish())
    profs = {k: {p: _profiler() for p in host_work.PHASES} for k in SIDES}
    for i in range(steps):
        for k in SIDES if i % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            phases = _Phases(profs[k])
            host_work._phased_step(*sides[k], local[2 + steps + i], (phases,))
            phases.finish()
    out = {"tensors": sum(1 for _ in sides["torch"][0].parameters())}
    merged = pstats.Stats(*profs["veragged"].values())
    ours = [(tt, path, line, name) for (path, line, name), (_, _, tt, _, _) in
            merged.stats.items() if path != "~" and _layer(path) in _OURS]
    out["top"] = [{"function": f"{os.path.relpath(path, _ROOT)}:{line}({name})",
                   "self_ms": round(1e3 * tt / steps, 1)}
                  for tt, path, line, name in sorted(ours, reverse=True)[:top]]
    files = Counter()
    for tt, path, _, _ in ours:
        files[os.path.relpath(path, _ROOT)] += 1e3 * tt / steps
    out["files"] = {f: round(v, 1) for f, v in files.most_common()}
    for k in SIDES:
        out[k] = {"unprofiled_ms": {p: 1e3 * min(t[j] for t in times[k])
                                    for j, p in enumerate(host_work.PHASES)},
                  "phases": {p: {f"{a}|{b}": 1e3 * v / steps
                                 for (a, b), v in split(pstats.Stats(prof)).items()}
                             for p, prof in profs[k].items()}}
    return out


def _rows(res: dict) -> dict:
    """Per phase and for the step: the split, our Python's share and its bound."""
    step = Counter()
    for p in host_work.PHASES:
        step.update(res["phases"][p])
    res["phases"]["step"] = dict(step)
    res["unprofiled_ms"]["step"] = sum(res["unprofiled_ms"][p] for p in host_work.PHASES)
    rows = {}
    for p, parts in res["phases"].items():
        host = (parts.get("total|", 0.0) - parts.get("colls|C", 0.0)) or 1.0
        ours = sum(parts.get(f"{layer}|py", 0.0) for layer in _OURS)
        fsdp2 = sum(parts.get(f"{layer}|py", 0.0) for layer in ("torch fsdp", "torch dtensor"))
        rows[p] = {"unprofiled_ms": round(res["unprofiled_ms"][p], 1),
                   "profiled_ms": round(parts.get("total|", 0.0), 1),
                   "py_ms": {layer: round(parts.get(f"{layer}|py", 0.0), 1) for layer in LAYERS},
                   "c_ms": {layer: round(parts.get(f"{layer}|C", 0.0), 1)
                            for layer in (*LAYERS, "colls")},
                   "ours_py_share": round(ours / host, 3),
                   "torch_fsdp_dtensor_py_share": round(fsdp2 / host, 3),
                   "bound_ms": round(ours / host * res["unprofiled_ms"][p], 1)}
    return rows


def per_step(world: int, steps: int, top: int) -> dict:
    from tests.harness.pool import get_pool

    res = get_pool(world, device="cpu").run(_step_worker, steps, top, timeout=900)[0]
    return {"tensors": res["tensors"], "world": world, "steps": steps, "top": res["top"],
            "files": res["files"],
            "sides": {k: _rows(res[k]) for k in SIDES}}


def _print_ops(rows: dict) -> None:
    print("per op (us per call, per tensor for per-tensor ops; 1 rank, CPU time):")
    print(f"{'op':15}{'plain':>8}{'torch DT':>10}{'ragged':>9}{'ragged-plain':>14}"
          f"{'placement py':>14}{'torch py':>10}{'bound us':>10}")
    for name, r in rows.items():
        print(f"{name:15}{r['plain_us']:>8.1f}{r['torch_us']:>10.1f}{r['ragged_us']:>9.1f}"
              f"{r['ragged_us'] - r['plain_us']:>14.1f}{r['placement_python_share']:>14.0%}"
              f"{r['torch_python_share']:>10.0%}{r['bound_us']:>10.1f}")


def _print_step(res: dict) -> None:
    print(f"\nper step (moe, {res['tensors']} tensors, {res['world']} gloo ranks; rank 0's "
          f"cProfile of {res['steps']} steps per side; ms per step)")
    for side, rows in res["sides"].items():
        phases = list(rows)
        print(f"{side:22}" + "".join(f"{p:>10}" for p in phases))

        def line(label, f):
            vals = [f(rows[p]) for p in phases]
            if any(vals):
                print(f"{label:22}" + "".join(f"{v:>10.1f}" for v in vals))

        line("unprofiled", lambda r: r["unprofiled_ms"])
        line("profiled", lambda r: r["profiled_ms"])
        for layer in LAYERS:
            line(f"py {layer}", lambda r, layer=layer: r["py_ms"][layer])
        for layer in (*LAYERS, "colls"):
            line(f"C from {layer}", lambda r, layer=layer: r["c_ms"][layer])
        key, label = (("ours_py_share", "ours py / host") if side == "veragged" else
                      ("torch_fsdp_dtensor_py_share", "fsdp+dtensor py / host"))
        print(f"{label:22}" + "".join(f"{rows[p][key]:>10.0%}" for p in phases))
        if side == "veragged":
            line("bound ms", lambda r: r["bound_ms"])
        print()
    print("veragged's Python files and functions with the most self time (ms per step, "
          "profiled):")
    for f, ms in list(res["files"].items())[:len(res["top"])]:
        print(f"  {ms:8.1f}  {f}")
    print()
    for t in res["top"]:
        print(f"  {t['self_ms']:8.1f}  {t['function']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("ops", "step", "both"), default="both")
    parser.add_argument("--n", type=int, default=64, help="tensors per op (64)")
    parser.add_argument("--reps", type=int, default=10, help="calls per round (10)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, best of (7)")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks of part 2 (2)")
    parser.add_argument("--steps", type=int, default=3, help="timed and profiled steps (3)")
    parser.add_argument("--top", type=int, default=12, help="our top functions listed (12)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"benchmark": "host_profile", "date": datetime.date.today().isoformat(),
              "commit": fsdp_step.commit_id(), "torch": torch.__version__}
    if args.part in ("ops", "both"):
        result["ops"] = per_op(args.n, args.reps, args.rounds)
        if not args.json:
            _print_ops(result["ops"])
    if args.part in ("step", "both"):
        result["step"] = per_step(args.world, args.steps, args.top)
        if not args.json:
            _print_step(result["step"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
