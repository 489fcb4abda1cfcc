"""Background roots and bases (Shampoo, SOAP) against synchronous refreshes, 4 gloo ranks.

[Note: asynchronous roots]: with `async_precondition=True, staleness=k` a refresh of step s
runs on a worker thread and is installed at step s + k exactly; the numbers are the synchronous
optimizer's with a k-step delay whatever the timing, and the refresh's cost leaves the step it
was due in.

Part 1, step times. The Llama of benchmarks/optim_matrix.py under veragged.fully_shard (each
block, then the root), synthetic gradients (tests.harness.grads.set_grads), on 4 gloo ranks
that share the machine's cores (there is no spare core for the workers: a job runs in the gaps
of the ranks' steps and competes with them otherwise). The width is the first of WIDTHS at which
a synchronous Shampoo refresh step (f = 10) costs >= 3x a plain step (measured first, printed,
and asserted). Configs: AdamW (torch.optim.AdamW); Shampoo sync f = 1 and f = 10; Shampoo async
f = 1 k = 1, f = 10 k = 1 and k = 4; SOAP sync f = 10 and async f = 10 k = 4. Each config runs
20 warmup + 200 measured steps, the whole sequence twice (forward, then reversed) and pooled;
a step's time is the slowest rank's (all_reduce MAX after a barrier). Columns: p50, p99, max,
mean and their ratios to the synchronous config with the same optimizer and f; p99 / p50.
Targets: f = 10, k = 4: async p99 <= 0.6x and max <= 0.7x sync's, async mean <= 1.05x sync's;
f = 1: async mean <= 1.05x sync's (no regression: with a refresh every step there is nothing
to hide it behind on 2 shared cores).

Part 2, loss. The seeded Markov-chain task of tests/optim/test_matrix_curve.py (one process,
each token two equally likely successors: floor ln 2 = 0.693), 300 steps: Shampoo f = 10 with
k = 0, 1, 4, and AdamW (lr 3e-3, its best on this task). Final loss: the mean of the last 10.
Target: k = 1 and 4 within 1% of k = 0, all below AdamW.

Part 3, the GIL. One process, one intra-op thread, so the main thread and one worker each
have a core: torch.optim.AdamW steps (foreach off: hundreds of small launches, the most
Python-bound step there is) on the loss model of part 2, timed alone, while a RootWorker thread
runs Shampoo roots of 256 x 256 factors back to back (one op each, a GIL hand-off per root),
and while the same roots run in another process (the same competition for cores, caches and
memory, no GIL shared), in turn over several rounds. thread / process is the GIL's share;
[Note: asynchronous roots] keeps Python threads if it is under 5%.

Prints the tables, whether each target is met, then one JSON line (`--json`: only the JSON).
`--quick`: a tiny model and a few steps (a smoke run for tests). The default run takes about
10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
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

WORLD = 4
WIDTHS = (128, 192, 256, 384)  # Llama dims tried, in order, for the 3x refresh step
LAYERS = 4
QUICK_WIDTHS, QUICK_LAYERS = (32,), 2
REFRESH_RATIO = 3.0
CONFIGS = {  # name -> (optimizer, f, k); k None: synchronous
    "AdamW": ("AdamW", None, None),
    "Shampoo f=1 sync": ("Shampoo", 1, None),
    "Shampoo f=1 k=1": ("Shampoo", 1, 1),
    "Shampoo f=10 sync": ("Shampoo", 10, None),
    "Shampoo f=10 k=1": ("Shampoo", 10, 1),
    "Shampoo f=10 k=4": ("Shampoo", 10, 4),
    "SOAP f=10 sync": ("SOAP", 10, None),
    "SOAP f=10 k=4": ("SOAP", 10, 4),
}
STEPS, QUICK_STEPS = (20, 200), (2, 12)
LOSS_STEPS, QUICK_LOSS_STEPS = 300, 20


def _optimizer(kind, f, k, params):
    import veragged

    if kind == "AdamW":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    kw = dict(async_precondition=k is not None, staleness=k or 0)
    if kind == "Shampoo":
        return veragged.optim.Shampoo(params, lr=3e-3, precondition_frequency=f, **kw)
    return veragged.optim.SOAP(params, lr=3e-3, weight_decay=0.0, precondition_frequency=f,
                               **kw)


def _optim_matrix():
    """benchmarks/optim_matrix.py as a module (its Llama and its table printer)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_matrix.py")
    spec = importlib.util.spec_from_file_location("_optim_matrix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(dim, layers):
    return _optim_matrix().fully_sharded_llama(dim, layers)


def _steps(opt, params, count, first=0):
    """The slowest rank's time of each of `count` steps."""
    from tests.harness.grads import set_grads

    times = []
    for step in range(first, first + count):
        set_grads(params, step)
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        t = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return times


def _calibrate(dim, layers):
    """Sync Shampoo f = 10 for 21 steps: its refresh steps (10, 20) over the median plain one."""
    model = _model(dim, layers)
    params = list(model.parameters())
    times = _steps(_optimizer("Shampoo", 10, None, params), params, 21)
    refresh = [times[9], times[19]]  # its step counter's 10 and 20
    plain = statistics.median(t for i, t in enumerate(times[1:], 1) if i not in (9, 19))
    return min(refresh) / plain


def _config(dim, layers, name, warmup, steps):
    kind, f, k = CONFIGS[name]
    model = _model(dim, layers)
    params = list(model.parameters())
    opt = _optimizer(kind, f, k, params)
    times = _steps(opt, params, warmup + steps)[warmup:]
    stats = getattr(opt, "async_stats", None)
    if hasattr(opt, "close"):
        opt.close()
    return times, stats


def step_times(widths, layers, warmup, steps):
    from tests.harness.pool import get_pool

    pool = get_pool(WORLD, device="cpu")
    calibration = {}
    for dim in widths:
        calibration[dim] = pool.run(_calibrate, dim, layers, timeout=1800)[0]
        if calibration[dim] >= REFRESH_RATIO:
            break
    samples = {name: [] for name in CONFIGS}
    stats = {}
    for order in (list(CONFIGS), list(reversed(CONFIGS))):
        for name in order:
            times, st = pool.run(_config, dim, layers, name, warmup, steps, timeout=3600)[0]
            samples[name] += times
            stats[name] = st
    rows = {}
    for name, times in samples.items():
        ordered = sorted(times)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        rows[name] = {"p50": statistics.median(times), "p99": p99, "max": ordered[-1],
                      "mean": statistics.fmean(times), "n": len(times), "stats": stats[name]}
    for name, r in rows.items():
        kind, f, k = CONFIGS[name]
        base = rows.get(f"{kind} f={f} sync") if k is not None else None
        r["vs_sync"] = {q: r[q] / base[q] for q in ("p50", "p99", "max", "mean")} if base \
            else None
    return dim, calibration, rows


def _batches(steps, vocab=64, batch=16, seq=33):
    """test_muon_curve's task: each token has two equally likely successors."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, 2), generator=g)
    x = torch.empty(steps, batch, seq, dtype=torch.long)
    x[:, :, 0] = torch.randint(0, vocab, (steps, batch), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, 2, (steps, batch), generator=g)
        x[:, :, t] = successors[x[:, :, t - 1], pick]
    return x


def final_losses(steps):
    from veragged.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab=64, dim=64, layers=2, heads=4, hidden=172, max_seq=33)
    out = {}
    for name, (kind, f, k) in {"Shampoo f=10 k=0": ("Shampoo", 10, None),
                               "Shampoo f=10 k=1": ("Shampoo", 10, 1),
                               "Shampoo f=10 k=4": ("Shampoo", 10, 4),
                               "AdamW": ("AdamW", None, None)}.items():
        torch.manual_seed(0)
        model = Llama(cfg)
        opt = _optimizer(kind, f, k, model.parameters())
        losses = []
        for batch in _batches(steps):
            loss = model.loss(batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = statistics.fmean(losses[-10:])
    return out


def _roots_until(stop, count):
    """Another process's root jobs, back to back (part 3's control: no GIL shared)."""
    from veragged.optim.kronecker import inverse_root_into

    torch.set_num_threads(1)
    small = torch.randn(256, 256)
    small = small @ small.T
    root = torch.empty_like(small)
    while not stop.is_set():
        inverse_root_into(root, small, 4, 1e-12)
        with count.get_lock():
            count.value += 1


def gil_cost(steps, rounds):
    """Part 3: AdamW step time alone, beside a RootWorker thread running root jobs back to
    back (one op per root, as the refresh jobs run them), and beside the same jobs in another
    process (the same competition for cores, caches and memory, no GIL shared); one intra-op
    thread each, the three in turn, `rounds` times."""
    import multiprocessing as mp

    from veragged.optim.async_roots import RootWorker
    from veragged.optim.kronecker import inverse_root_into
    from veragged.models.llama import Llama, LlamaConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    stop, count = ctx.Event(), ctx.Value("q", 0)
    process = ctx.Process(target=_roots_until, args=(stop, count), daemon=True)
    try:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab=64, dim=64, layers=2, heads=4, hidden=172, max_seq=33))
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        small = torch.randn(256, 256)
        small = small @ small.T
        root = torch.empty_like(small)

        def timed():
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        timed()  # warm
        medians = {"alone": [], "thread": [], "process": []}
        jobs = {"thread": 0, "process": 0}
        worker = RootWorker(1)
        for r in range(rounds):
            medians["alone"].append(timed())
            busy = [True]

            def job():  # until told to stop
                while busy[0]:
                    inverse_root_into(root, small, 4, 1e-12)
                    jobs["thread"] += 1

            worker.submit(("roots", 0, r), job, small.device)
            time.sleep(0.05)
            medians["thread"].append(timed())
            busy[0] = False
            worker.drain()
            for key in worker.in_flight():
                worker.forget(key)
            stop.clear()
            process = ctx.Process(target=_roots_until, args=(stop, count), daemon=True)
            process.start()
            while count.value == jobs["process"]:  # started (import, first root)
                if not process.is_alive():
                    raise RuntimeError(f"the control process exited ({process.exitcode})")
                time.sleep(0.01)
            medians["process"].append(timed())
            stop.set()
            process.join()
            jobs["process"] = count.value
        worker.close()
    finally:
        stop.set()
        torch.set_num_threads(threads)
    out = {k: statistics.median(v) for k, v in medians.items()}
    out.update(jobs=jobs, beside_thread=out["thread"] / out["alone"],
               beside_process=out["process"] / out["alone"],
               gil_share=out["thread"] / out["process"], rounds=medians)
    return out


def _print_lines(head, lines, out):
    _optim_matrix()._print_lines(head, lines, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    widths, layers = (QUICK_WIDTHS, QUICK_LAYERS) if args.quick else (WIDTHS, LAYERS)
    warmup, steps = QUICK_STEPS if args.quick else STEPS

    dim, calibration, rows = step_times(widths, layers, warmup, steps)
    ratio = calibration[dim]
    print(f"Llama dim {dim}, {layers} layers (hidden {int(8 * dim / 3)}): a synchronous Shampoo "
          f"refresh step (f=10) costs {ratio:.1f}x a plain step (needed >= {REFRESH_RATIO:g}; "
          f"tried {', '.join(f'{d}: {r:.1f}x' for d, r in calibration.items())})", file=out)
    if not args.quick:
        assert ratio >= REFRESH_RATIO, calibration
    print(f"Step times, {WORLD} gloo ranks sharing 2 CPU cores (slowest rank), "
          f"{warmup} warmup + {steps} measured steps, twice (forward, reversed)", file=out)
    head = ["config", "p50 ms", "p99 ms", "max ms", "mean ms", "p99/p50", "p50 vs", "p99 vs",
            "max vs", "mean vs", "stalls"]
    lines = []
    for name, r in rows.items():
        vs = r["vs_sync"]
        cells = ["-"] * 4 if vs is None else [f"{vs[q]:.2f}" for q in ("p50", "p99", "max",
                                                                      "mean")]
        stalls = "-" if not r["stats"] else str(r["stats"]["stalls"])
        lines.append([name, f"{r['p50'] * 1e3:.1f}", f"{r['p99'] * 1e3:.1f}",
                      f"{r['max'] * 1e3:.1f}", f"{r['mean'] * 1e3:.1f}",
                      f"{r['p99'] / r['p50']:.2f}", *cells, stalls])
    _print_lines(head, lines, out)
    k4 = rows["Shampoo f=10 k=4"]["vs_sync"]
    f1 = rows["Shampoo f=1 k=1"]["vs_sync"]
    soap = rows["SOAP f=10 k=4"]["vs_sync"]
    targets = {
        "Shampoo f=10 k=4 p99 <= 0.6x": k4["p99"] <= 0.6,
        "Shampoo f=10 k=4 max <= 0.7x": k4["max"] <= 0.7,
        "Shampoo f=10 k=4 mean <= 1.05x": k4["mean"] <= 1.05,
        "SOAP f=10 k=4 p99 <= 0.6x": soap["p99"] <= 0.6,
        "SOAP f=10 k=4 max <= 0.7x": soap["max"] <= 0.7,
        "SOAP f=10 k=4 mean <= 1.05x": soap["mean"] <= 1.05,
        "Shampoo f=1 k=1 mean <= 1.05x": f1["mean"] <= 1.05,
    }
    for t, ok in targets.items():
        print(f"target {t}: {'met' if ok else 'NOT met'}", file=out)
    print(file=out)

    losses = final_losses(QUICK_LOSS_STEPS if args.quick else LOSS_STEPS)
    base = losses["Shampoo f=10 k=0"]
    print(f"Loss after {QUICK_LOSS_STEPS if args.quick else LOSS_STEPS} steps (mean of the last "
          "10; floor ln 2 = 0.693), one process", file=out)
    _print_lines(["optimizer", "loss", "vs k=0"],
                 [[n, f"{v:.4f}", f"{v / base:.4f}"] for n, v in losses.items()], out)
    loss_met = all(abs(losses[f"Shampoo f=10 k={k}"] / base - 1) <= 0.01 for k in (1, 4)) and \
        all(losses[f"Shampoo f=10 k={k}"] < losses["AdamW"] for k in (0, 1, 4))
    print(f"target k=1, 4 within 1% of k=0 and below AdamW: {'met' if loss_met else 'NOT met'}",
          file=out)
    print(file=out)

    gil = gil_cost(*((50, 2) if args.quick else (2000, 8)))
    gil_met = gil["gil_share"] <= 1.05
    print(f"GIL: AdamW step (foreach off, 1 thread) {gil['alone'] * 1e3:.3f} ms alone, "
          f"{gil['thread'] * 1e3:.3f} ms beside a worker thread's root jobs, "
          f"{gil['process'] * 1e3:.3f} ms beside the same jobs in another process: "
          f"{gil['beside_thread']:.3f}x and {gil['beside_process']:.3f}x; the GIL's share "
          f"{gil['gil_share']:.3f}x (target <= 1.05x: {'met' if gil_met else 'NOT met'})",
          file=out)
    print(json.dumps({
        "benchmark": "async_precondition", "world_size": WORLD, "dim": dim, "layers": layers,
        "refresh_ratio": ratio, "calibration": calibration, "warmup": warmup, "steps": steps,
        "rows": rows, "targets": targets, "losses": losses, "loss_met": loss_met,
        "gil": gil, "gil_met": gil_met,
        "threads": int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
