"""Host work of a training step: veragged.fully_shard vs torch's fully_shard, gloo ranks on CPU.

On a GPU a step with many small tensors is bound by what the host issues: kernel launches and
Python. This counts both, per phase of a step (forward, backward, clipping with torch's
`clip_grad_norm_`, `optimizer.step()` + `zero_grad()`), for the MoE model of
`benchmarks/fsdp_step.py` (1053 tensors by default; `--model moe-small` for 60 small experts per
layer, 1007 tensors; `--model llama` for few large ones), both sides built in the same ranks with
`torch.optim.AdamW` (foreach, the default):
  launches   ops that would launch a kernel on a device: every dispatched aten/veragged op
             except views, metadata changes and bare allocations (collectives apart), counted by
             `veragged.tools.write_counter.LaunchCounter` below the DTensor layer (local tensors' ops);
  fsdp       of those, the ones FSDP's own code issued (`veragged.tools.write_counter.FSDPPaths`:
             a frame of torch's `_fully_shard` or veragged's `fsdp`/`dbuffer` on the stack);
  colls      collective calls;
  entries    calls into FSDP code from outside it (hooks torch's module and autograd machinery
             runs, and API calls), counted with `sys.setprofile`;
  host ms    wall time of the phase on the slowest rank, the fastest of `--steps` alternating
             steps (on the CPU it includes the kernels themselves: the small MoE keeps them
             cheap, so it is mostly host time).
Per step, on rank 0 (counts are the same on every rank here). Prints a table and one JSON line.
Both sides share one process, and with it torch's DTensor sharding cache: clipping's
`torch.stack` of the per-parameter norms finds the entry the side that ran first (torch, in the
warm-up) made, and the other side's norm specs are equal but not the same objects, so it pays a
Python spec comparison per tensor (about 1 ms for 1000 norms) that it does not pay in a process
of its own.
Default: 2 ranks, moe, 4 timed steps (about a minute on 2 idle cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_step  # noqa: E402  (the models and how both sides shard them)

from veragged.tools.write_counter import LaunchCounter  # noqa: E402

PHASES = ("forward", "backward", "clip", "optim")
# The models (fsdp_step.py builds them): `moe-small` is fsdp_step's MoE with 60 experts of
# width 8 per layer, the many-small-experts case of issue 42's clipping target.
SPECS = {
    "moe": {"dim": 64, "layers": 14, "experts": 16, "hidden": 32},
    "moe-small": {"dim": 32, "layers": 4, "experts": 60, "hidden": 8},
    "llama": {"dim": 128, "layers": 2},
}
SIDES = ("torch", "veragged")


class EntryCounter:
    """Counts calls into FSDP code (torch's `_fully_shard`, veragged's `fsdp`/`dbuffer`/
    `runtime`) whose caller is outside it."""

    def __init__(self):
        torch_fsdp = os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp",
                                  "_fully_shard") + os.sep
        import veragged
        root = os.path.dirname(veragged.__file__)
        self.dirs = (torch_fsdp, *(os.path.join(root, d) + os.sep
                                   for d in ("fsdp", "dbuffer", "runtime")))
        self.phase = "forward"
        self.counts: Counter = Counter()
        self._inside: dict = {}

    def _fsdp(self, code) -> bool:
        hit = self._inside.get(code)
        if hit is None:
            hit = self._inside[code] = os.path.abspath(code.co_filename).startswith(self.dirs)
        return hit

    def __call__(self, frame, event, arg):
        if event == "call" and self._fsdp(frame.f_code):
            caller = frame.f_back
            if caller is None or not self._fsdp(caller.f_code):
                self.counts[(self.phase, "entries")] += 1

    def __enter__(self):
        sys.setprofile(self)
        import threading
        threading.setprofile(self)
        return self

    def __exit__(self, *exc):
        import threading
        sys.setprofile(None)
        threading.setprofile(None)


def _phased_step(model, opt, tokens, tracker=None) -> list[float]:
    """One step, timing (and with `tracker`s, labelling) its phases."""
    times = []

    def phase(name):
        for t in tracker or ():
            t.phase = name
        times.append(time.perf_counter())

    phase("forward")
    loss = model.loss(tokens)
    phase("backward")
    loss.backward()
    phase("clip")
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    phase("optim")
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def _groups(model, kind: str) -> int:
    if kind == "torch":
        return sum(1 for m in model.modules()
                   if isinstance(m, torch.distributed.fsdp.FSDPModule))
    return sum(len(m._veragged_state.groups) for m in model.modules()
               if getattr(m, "_veragged_state", None) is not None
               and m._veragged_state.modules[0] is m)


def _worker(model_name: str, spec: dict, steps: int, device: str = "cpu"):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fsdp_step.device_mesh(device)
    sides = {k: fsdp_step._sharded(k, model_name, spec, "adamw", mesh, False) for k in SIDES}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, fsdp_step.VOCAB, (steps + 4, world * fsdp_step.BATCH,
                                              fsdp_step.SEQ + 1), generator=g)
    local = data[:, rank * fsdp_step.BATCH : (rank + 1) * fsdp_step.BATCH]
    if device == "cuda":
        local = local.cuda()
    for i in range(2):
        for k in SIDES:
            _phased_step(*sides[k], local[i])
    times = {k: [] for k in SIDES}
    for i in range(steps):
        for k in SIDES if i % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            t = torch.tensor(_phased_step(*sides[k], local[2 + i]), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[k].append(t.tolist())
    out = {}
    for k in SIDES:
        launches, entries = LaunchCounter(), EntryCounter()
        with launches:
            _phased_step(*sides[k], local[-2], (launches,))
        with entries:
            _phased_step(*sides[k], local[-1], (entries,))
        counts = launches.counts + entries.counts
        out[k] = {
            "groups": _groups(sides[k][0], k),
            "tensors": sum(1 for _ in sides[k][0].parameters()),
            "phases": {p: {"launches": counts[(p, "fsdp")] + counts[(p, "rest")],
                           "fsdp": counts[(p, "fsdp")], "colls": counts[(p, "colls")],
                           "entries": counts[(p, "entries")],
                           "host_ms": 1e3 * min(t[j] for t in times[k])}
                       for j, p in enumerate(PHASES)},
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--model", default="moe", choices=tuple(SPECS),
                        help="moe (1053 tensors), moe-small (many small experts, 1007 "
                             "tensors) or llama (17 large ones)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side (4)")
    fsdp_step.add_device_argument(
        parser, "; on a GPU the host ms are what the host takes to issue each phase")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    run_job = fsdp_step.rank_runner(parser, args, timeout=600)
    spec = SPECS[args.model]
    res = run_job(_worker, args.model, spec, args.steps, args.device)[0]
    rows = []
    for p in PHASES:
        t, v = res["torch"]["phases"][p], res["veragged"]["phases"][p]
        rows.append({"phase": p, "torch": t, "veragged": v})
    result = {"benchmark": "host_work", "date": datetime.date.today().isoformat(),
              "commit": fsdp_step.commit_id(), "torch": torch.__version__, "world": args.world,
              "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
              "model": args.model, "spec": spec,
              "groups": {k: res[k]["groups"] for k in SIDES},
              "tensors": res["torch"]["tensors"], "rows": rows}
    if not args.json:
        print(f"{args.model}: {result['tensors']} tensors; groups torch "
              f"{result['groups']['torch']} / veragged {result['groups']['veragged']}; "
              f"{args.world} ranks, per step")
        head = (f"{'phase':9} {'launches t/v':>15} {'fsdp t/v':>13} {'colls t/v':>10} "
                f"{'entries t/v':>13} {'host ms t/v':>15} {'ratio':>6}")
        print(head)
        total = {k: Counter() for k in SIDES}
        for r in rows:
            t, v = r["torch"], r["veragged"]
            for k in SIDES:
                total[k].update({f: r[k][f] for f in ("launches", "fsdp", "colls", "entries",
                                                      "host_ms")})
            print(f"{r['phase']:9} {t['launches']:>7}/{v['launches']:<7} "
                  f"{t['fsdp']:>6}/{v['fsdp']:<6} {t['colls']:>4}/{v['colls']:<5} "
                  f"{t['entries']:>6}/{v['entries']:<6} {t['host_ms']:>7.1f}/{v['host_ms']:<7.1f} "
                  f"{v['host_ms'] / t['host_ms']:>6.2f}")
        t, v = total["torch"], total["veragged"]
        print(f"{'step':9} {t['launches']:>7}/{v['launches']:<7} {t['fsdp']:>6}/{v['fsdp']:<6} "
              f"{t['colls']:>4}/{v['colls']:<5} {t['entries']:>6}/{v['entries']:<6} "
              f"{t['host_ms']:>7.1f}/{v['host_ms']:<7.1f} {v['host_ms'] / t['host_ms']:>6.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
