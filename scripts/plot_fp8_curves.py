"""Plot the loss curves of `examples/train_llama.py --fp8 ...` runs against the unquantised one.

    python scripts/plot_fp8_curves.py docs/fp8_logs/none.log docs/fp8_logs/block128.log \
        docs/fp8_logs/mxfp8.log --out docs/fp8_loss_curves.png --steps 1,10,25,50,100,150,200

Each argument is the saved stdout of one run (its `step N  loss X` lines, as rank 0 prints
them; the label is `--fp8`'s value from the `fp8 <name>:` line, `none` where there is none).
The first log is the reference. Writes the figure (top: the losses; bottom: each run's loss
minus the reference's, step by step) and prints a markdown table of the losses at `--steps`,
each run's mean loss over its last `--tail` logged steps (a single batch's loss scatters by
~0.1-0.5 nats step to step, the mean much less), and each run's largest absolute and relative
and mean absolute difference from the reference over all logged steps. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import pathlib
import re

STEP = re.compile(r"^step +(\d+) +loss +([\d.]+)", re.MULTILINE)
LABEL = re.compile(r"^fp8 (\S+):", re.MULTILINE)


def read_log(path: str) -> tuple[str, dict[int, float]]:
    """(label, {step: loss}) of one run's stdout."""
    text = pathlib.Path(path).read_text()
    losses = {int(s): float(v) for s, v in STEP.findall(text)}
    if not losses:
        raise SystemExit(f"{path}: no 'step N  loss X' lines")
    label = LABEL.search(text)
    return (label[1] if label else "none"), losses


def differences(ref: dict[int, float], run: dict[int, float]) -> dict[str, float]:
    """Over the steps both logged: max |run - ref| ("max_abs", at step "worst"), max
    |run - ref| / ref ("max_rel") and mean |run - ref| ("mean_abs")."""
    steps = sorted(ref.keys() & run.keys())
    if not steps:
        raise SystemExit("the runs share no logged step")
    worst = max(steps, key=lambda s: abs(run[s] - ref[s]))
    return {"max_abs": abs(run[worst] - ref[worst]), "worst": worst,
            "max_rel": max(abs(run[s] - ref[s]) / ref[s] for s in steps),
            "mean_abs": sum(abs(run[s] - ref[s]) for s in steps) / len(steps)}


def tail_mean(losses: dict[int, float], tail: int) -> tuple[float, int, int]:
    """(mean loss, first step, last step) of the last `tail` logged steps."""
    steps = sorted(losses)[-tail:]
    return sum(losses[s] for s in steps) / len(steps), steps[0], steps[-1]


def table(runs: list[tuple[str, dict[int, float]]], steps: list[int], tail: int) -> str:
    """Markdown: the loss of every run at `steps`, its mean over the last `tail` steps, then
    each run's differences from the first run."""
    lines = ["| step | " + " | ".join(name for name, _ in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    for s in steps:
        cells = [f"{losses[s]:.4f}" if s in losses else "-" for _, losses in runs]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    means = [tail_mean(losses, tail) for _, losses in runs]
    first, last = means[0][1], means[0][2]
    lines.append(f"| mean, steps {first}-{last} | "
                 + " | ".join(f"{m:.4f}" for m, _, _ in means) + " |")
    ref_name, ref = runs[0]
    diffs = [differences(ref, losses) for _, losses in runs]
    for key, label, fmt in (("max_abs", "max abs diff", "{:.4f}"),
                            ("max_rel", "max rel diff", "{:.2%}"),
                            ("mean_abs", "mean abs diff", "{:.4f}")):
        lines.append(f"| {label} vs {ref_name} | "
                     + " | ".join(fmt.format(d[key]) for d in diffs) + " |")
    return "\n".join(lines)


def plot(runs: list[tuple[str, dict[int, float]]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    ref_name, ref = runs[0]
    for name, losses in runs:
        steps = sorted(losses)
        top.plot(steps, [losses[s] for s in steps], label=name, linewidth=1.2)
    for name, losses in runs[1:]:
        steps = sorted(ref.keys() & losses.keys())
        bottom.plot(steps, [losses[s] - ref[s] for s in steps], label=name, linewidth=1.0)
    bottom.axhline(0.0, color="grey", linewidth=0.8)
    top.set_ylabel("loss (rank 0's batch)")
    top.set_title(title)
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_ylabel(f"loss - {ref_name}")
    bottom.set_xlabel("step")
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", help="saved stdout of each run, the reference first")
    p.add_argument("--out", default="docs/fp8_loss_curves.png")
    p.add_argument("--steps", default="1,10,25,50,100,150,200",
                   help="comma-separated steps for the table")
    p.add_argument("--tail", type=int, default=50,
                   help="the table's mean loss is over this many last logged steps")
    p.add_argument("--title", default="examples/train_llama.py: 8-bit weight gathers")
    args = p.parse_args()
    runs = [read_log(path) for path in args.logs]
    plot(runs, args.out, args.title)
    print(table(runs, [int(s) for s in args.steps.split(",")], args.tail))
    for name, losses in runs[1:]:
        d = differences(runs[0][1], losses)
        print(f"{name}: max |diff| {d['max_abs']:.4f} (step {d['worst']}), max rel "
              f"{d['max_rel']:.2%}, mean |diff| {d['mean_abs']:.4f} over "
              f"{len(runs[0][1].keys() & losses.keys())} steps")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
