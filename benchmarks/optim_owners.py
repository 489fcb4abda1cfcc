"""Load balance of distributed Muon's owner plan on the Qwen3 family.

Distributed Muon runs Newton-Schulz on each whole 2-D matrix on one owner rank
(`veragged.optim.owners.plan_owners`, csrc/optim/owners.h).  The ranks wait for
the slowest one, so what matters is the load balance ratio max / mean of the
per-rank cost (Canzona, arXiv 2602.06079, appendix C.1).  For the Muon
matrices of Qwen3-1.7B, 4B, 8B, 14B and 32B (per layer q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj; embeddings, lm head and norms excluded)
at DP sizes 16, 32, 64 and 128, this prints the ratio of:

  naive  matrix i on rank i % m (Keller Jordan's Muon);
  lpt    global LPT with loads carried across capacity-bounded micro-groups
         (Canzona Algorithm 3 + 4 with carried loads; the default strategy);
  alpha  Canzona Algorithm 1 with alpha = 1, buckets = transformer layers
         (each rank a contiguous run of each layer);
  bound  a lower bound on any plan's ratio, the largest of: the mean; the
         costliest matrix; for every k >= 1, the sum of the smallest k + 1 of
         the k m + 1 costliest matrices (some rank gets k + 1 of them); and the
         optimal max load of the matrices of the two largest distinct costs
         alone (for Qwen3: the MLP matrices and q/o_proj), found exactly by a
         DP over how many of each a rank takes.  lpt at the bound is optimal.

Cost model: Newton-Schulz FLOPs, ns_steps * (4 s^2 l + 2 s^3) per matrix with
s = min(rows, cols), l = max(rows, cols) (`--cost numel` for element counts).
"lpt ms" / "alpha ms" is the best of `--repeats` wall times of one
`plan_owners` call (Python wrapper included).  Canzona reports 3.24 (naive) and
1.43 (its alpha-balanced plan); the target for lpt is <= 1.05, or the bound
where no plan can reach 1.05 (a miss "@bound" marks lpt exactly at the bound:
optimal, the shapes forbid 1.05).

Prints a table, a line of target misses, then one JSON line (`--json`: only
the JSON on stdout, the table on stderr).
"""

import argparse
import json
import math
import sys
import time

# https://huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json and the same path for the others.
QWEN3 = {
    "Qwen3-1.7B": {
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
    },
    # https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json
    "Qwen3-4B": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
    },
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
    "Qwen3-8B": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
    },
    # https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json
    "Qwen3-14B": {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
    },
    # https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json
    "Qwen3-32B": {
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 25600,
    },
}
DP_SIZES = (16, 32, 64, 128)
TARGET = 1.05
NS_STEPS = 5


def muon_shapes(config):
    """(rows, cols) of every Muon matrix, in module order, and each one's layer."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    shapes = layer * config["num_hidden_layers"]
    return shapes, [i // len(layer) for i in range(len(shapes))]


def matrix_cost(rows, cols, cost):
    if cost == "numel":
        return rows * cols
    short, long = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * short * short * long + 2 * short**3)


def fits(n_a, n_b, configs, m):
    """Whether n_a matrices of cost A and n_b of cost B fit in m ranks that each take one of
    `configs` ((a, b) counts under the load being tried): a DP of the fewest ranks."""
    ranks = [[0] * (n_b + 1) for _ in range(n_a + 1)]
    for x in range(n_a + 1):
        for y in range(n_b + 1):
            if x or y:  # only configurations that place one of what is left
                ranks[x][y] = 1 + min(
                    ranks[max(0, x - a)][max(0, y - b)]
                    for a, b in configs
                    if (a and x) or (b and y)
                )
    return ranks[n_a][n_b] <= m


def two_class_makespan(costs, m, upper):
    """Least max load when only the matrices of the two largest distinct costs A > B are placed
    (the others left out, so it bounds the whole problem from below), searched among the loads
    a * A + b * B below `upper` by bisection (fitting is monotone in the load). `upper` must be
    the max load of some plan, so the answer is at most `upper`; it is returned when nothing
    below it fits."""
    big = sorted(set(costs), reverse=True)[:2] + [0]
    a_cost, b_cost = big[0], big[1] or upper + 1  # one distinct cost: no B to place
    n_a, n_b = costs.count(big[0]), costs.count(big[1]) if big[1] else 0
    sums = {a * a_cost + b * b_cost for a in range(upper // a_cost + 1) for b in range(n_b + 1)}
    loads = sorted(t for t in sums if a_cost <= t < upper)
    lo, hi = 0, len(loads)  # loads[hi:] fit (hi == len: only upper is known to fit)
    while lo < hi:
        mid = (lo + hi) // 2
        configs = [(a, min(n_b, (loads[mid] - a * a_cost) // b_cost)) for a in range(n_a + 1)]
        if fits(n_a, n_b, [(a, b) for a, b in configs if b >= 0], m):
            hi = mid
        else:
            lo = mid + 1
    return loads[hi] if hi < len(loads) else upper


def bound_ratio(costs, m, upper):
    """Lower bound on max / mean over every owner assignment (module docstring); `upper` is a
    max load some plan reaches."""
    top = sorted(costs, reverse=True)
    best = max(sum(costs) / m, top[0])
    for k in range(1, (len(top) - 1) // m + 1):
        best = max(best, sum(top[k * m - k : k * m + 1]))
    best = max(best, two_class_makespan(costs, m, upper))
    return best * m / sum(costs)


def timed(plan_owners, repeats, *args, **kwargs):
    """(best wall time in ms, the plan)."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_owners(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best, plan


def bench_point(plan_owners, shapes, layers, m, cost, repeats):
    common = {"cost": cost, "ns_steps": NS_STEPS}
    naive = plan_owners(shapes, m, strategy="naive", **common)
    lpt_ms, lpt = timed(plan_owners, repeats, shapes, m, strategy="lpt", **common)
    alpha_ms, alpha = timed(
        plan_owners, repeats, shapes, m, strategy="alpha", alpha=1.0, buckets=layers, **common
    )
    costs = [matrix_cost(r, c, cost) for r, c in shapes]
    assert sum(lpt.loads) == sum(costs), "plan loads disagree with the cost model"
    bound = bound_ratio(costs, m, max(lpt.loads))
    assert bound <= lpt.ratio * (1 + 1e-12), "a lower bound above a real plan"
    row = {
        "dp": m,
        "ratio": {"naive": naive.ratio, "lpt": lpt.ratio, "alpha": alpha.ratio, "bound": bound},
        "lpt_groups": len(lpt.groups),
        "lpt_ms": lpt_ms,
        "alpha_ms": alpha_ms,
    }
    at_bound = math.isclose(lpt.ratio, bound, rel_tol=1e-12)
    row["misses"] = [] if lpt.ratio <= TARGET else ["lpt@bound" if at_bound else "lpt"]
    return row


def print_table(rows, out):
    head = ["model", "matrices", "dp", "naive", "lpt", "alpha", "bound", "groups"]
    head += ["lpt ms", "alpha ms", "misses"]
    lines = []
    for r in rows:
        ratio = r["ratio"]
        line = [r["model"], str(r["matrices"]), str(r["dp"])]
        line += [f"{ratio[key]:.4f}" for key in ("naive", "lpt", "alpha", "bound")]
        line += [str(r["lpt_groups"]), f"{r['lpt_ms']:.3f}", f"{r['alpha_ms']:.3f}"]
        line += [",".join(r["misses"]) or "-"]
        lines.append(line)
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    for line in [head, ["-" * w for w in widths]] + lines:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)), file=out)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(DP_SIZES),
        help="comma-separated DP sizes (default 16,32,64,128)",
    )
    parser.add_argument("--cost", choices=("flops", "numel"), default="flops")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats, best kept")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import veragged  # noqa: F401  (registers torch.ops.veragged.plan_owners)
    from veragged.optim.owners import plan_owners

    rows = []
    for name, config in QWEN3.items():
        shapes, layers = muon_shapes(config)
        for m in args.sizes:
            row = {"model": name, "matrices": len(shapes)}
            row.update(bench_point(plan_owners, shapes, layers, m, args.cost, args.repeats))
            rows.append(row)
    out = sys.stderr if args.json else sys.stdout
    print(f"Muon owner plan, max/mean {args.cost} load per rank (ns_steps={NS_STEPS})", file=out)
    print_table(rows, out)
    misses = [f"{r['model']} dp={r['dp']}: {'+'.join(r['misses'])}" for r in rows if r["misses"]]
    summary = f"target misses ({len(misses)}; lpt <= {TARGET}): " + ("; ".join(misses) or "none")
    print(summary, file=out)
    result = {
        "cost": args.cost,
        "ns_steps": NS_STEPS,
        "target_lpt_ratio": TARGET,
        "configs": QWEN3,
        "rows": rows,
        "misses": summary,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
