"""Optimizer state memory and step time of AdamW8bit vs torch.optim.AdamW, one CPU process.

The example's Llama model at a few sizes, fp32 parameters, random gradients. Columns:

  bytes/param   optimizer state bytes (all state tensors but `step`) per parameter element:
                `8bit` over the parameters with 8-bit state only (target <= 2.05: 2 bytes of
                codes + 8/256 of absmax), `all` over the whole model (small parameters keep
                8 bytes of fp32 state); torch AdamW holds 8.
  step ms       median over `--steps` (after 2 warm-up steps) of one optimizer.step(), for
                torch AdamW(foreach=True), AdamW(fused=True) and AdamW8bit; ratios are
                AdamW8bit / torch (below 1 is faster).

Prints a table and one JSON line (`--json`: only the JSON).
"""

import argparse
import json
import statistics
import sys
import time

import torch

import veragged  # noqa: F401  (loads the kernels)
from veragged.optim.adamw8bit import AdamW8bit
from veragged.models.llama import Llama, LlamaConfig

SIZES = {"tiny": (128, 2), "small": (256, 4), "medium": (512, 4)}
QUICK_SIZES = {"tiny": (64, 2)}


def _model(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab=256, dim=dim, layers=layers, heads=4, hidden=int(8 * dim / 3))
    return Llama(cfg)


def _state_bytes(opt, params, only_8bit: bool) -> tuple[int, int]:
    nbytes = numel = 0
    for p in params:
        state = opt.state[p]
        if only_8bit and "exp_avg_codes" not in state:
            continue
        numel += p.numel()
        nbytes += sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
    return nbytes, numel


def _time_steps(make_opt, dim, layers, steps) -> tuple[float, object, list]:
    model = _model(dim, layers)
    params = list(model.parameters())
    opt = make_opt(params)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), opt, params


OPTIMIZERS = {
    "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="one tiny model, 3 steps")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes, steps = (QUICK_SIZES, 3) if args.quick else (SIZES, args.steps)
    out = sys.stderr if args.json else sys.stdout
    print(
        f"{'model':8} {'params':>8} {'B/p 8bit':>9} {'B/p all':>8} {'B/p torch':>9} "
        f"{'foreach ms':>11} {'fused ms':>9} {'8bit ms':>8} {'/foreach':>9} {'/fused':>7}",
        file=out,
    )
    rows = {}
    for name, (dim, layers) in sizes.items():
        ms, opts = {}, {}
        for kind, make in OPTIMIZERS.items():
            ms[kind], opts[kind], params = _time_steps(make, dim, layers, steps)
            if kind == "foreach":
                torch_bytes = _state_bytes(opts[kind], params, False)
            if kind == "8bit":
                b8, n8 = _state_bytes(opts[kind], params, True)
                ball, nall = _state_bytes(opts[kind], params, False)
        row = {
            "dim": dim,
            "layers": layers,
            "params": nall,
            "params_8bit": n8,
            "bytes_per_param_8bit": b8 / n8,
            "bytes_per_param_all": ball / nall,
            "bytes_per_param_torch": torch_bytes[0] / torch_bytes[1],
            "step_s": ms,
            "ratio_foreach": ms["8bit"] / ms["foreach"],
            "ratio_fused": ms["8bit"] / ms["fused"],
        }
        rows[name] = row
        print(
            f"{name:8} {nall / 1e6:7.2f}M {row['bytes_per_param_8bit']:9.3f} "
            f"{row['bytes_per_param_all']:8.3f} {row['bytes_per_param_torch']:9.3f} "
            f"{ms['foreach'] * 1e3:11.2f} {ms['fused'] * 1e3:9.2f} {ms['8bit'] * 1e3:8.2f} "
            f"{row['ratio_foreach']:9.2f} {row['ratio_fused']:7.2f}",
            file=out,
        )
    print(json.dumps({"benchmark": "optim_adamw8bit", "threads": args.threads, "steps": steps,
                      "models": rows}))


if __name__ == "__main__":
    main()
