"""RaggedShard redistribution vs torch's Shard(0) -> Replicate, on 4 gloo ranks (CPU).

For each tensor of a transformer-block-like group, from the same run:

  torch S0->R    torch's `distribute_tensor(t, mesh, [Shard(0)]).full_tensor()`: one all-gather,
                 padded to ceil(dim0 / P) rows per rank;
  even->R        `full_tensor()` of a RaggedShard with rows spread as evenly as they go
                 (`local_units` differ by at most one row): one all-gather;
  ragged->R      `full_tensor()` of a RaggedShard with skewed, zero-containing `local_units`
                 (whole rows): one all-gather of pieces padded to the largest (a broadcast when
                 one rank holds everything), so no send buffer grows with the world size
                 ([Note: ragged gathers without world-sized send buffers]);
  ragged->root   `redistribute` of the same RaggedShard to a root-only RaggedShard (Muon's
                 gather-to-owner, roots spread over the ranks): one all-to-all.

"time" is the median over `--iters` of the slowest rank's wall time (barrier before each),
"bytes" the bytes received over the wire, summed over ranks (a rank's own piece excluded,
padding included). Ratios are veragged / torch: below 1 is better. Ratios, not absolute CPU
times, are the point. Prints a table and one JSON line; `--json` prints only the JSON.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh, run_on_ranks

WORLD = 4
# name: shape (rows x hidden); dim 0 not a multiple of 4 in some, as in real vocabularies/MLPs.
SHAPES = {
    "qkv": (3 * 1024, 1024),
    "out_proj": (1024, 1024),
    "mlp_up": (2750, 1024),
    "mlp_down": (1024, 2750),
    "embed": (8003, 512),
    "norm": (1024,),
}
QUICK_SHAPES = {"qkv": (768, 256), "mlp_up": (690, 256), "norm": (256,)}


def _units(rows, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(WORLD, generator=g) + 0.5
    w[seed % WORLD] = 0  # one rank holds nothing
    counts = (w / w.sum() * rows).floor().long()
    counts[int(torch.argmax(w))] += rows - int(counts.sum())
    return tuple(int(c) for c in counts)


def _gather_bytes(sizes, itemsize):
    """Bytes veragged's ragged -> Replicate receives over the wire, summed over ranks."""
    P, total = len(sizes), sum(sizes)
    if sum(1 for s in sizes if s) == 1:  # a broadcast from the one holder
        return (P - 1) * total * itemsize
    return P * (P - 1) * max(sizes) * itemsize  # all-gather padded to the largest piece


def _timed(fn, iters):
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _worker(shapes, iters):
    mesh = get_mesh()
    rows_out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        full = torch.randn(shape)
        itemsize, numel, P = full.element_size(), full.numel(), WORLD
        row = numel // shape[0]
        placement = RaggedShard((0,), _units(shape[0], i))
        even = RaggedShard((0,), tuple(shape[0] // P + (r < shape[0] % P) for r in range(P)))
        ev = veragged.distribute_tensor(full, mesh, [even])
        root = RaggedShard((), tuple(int(r == i % P) for r in range(P)))
        s0 = distribute_tensor(full, mesh, [Shard(0)])
        rs = veragged.distribute_tensor(full, mesh, [placement])
        assert torch.equal(rs.full_tensor(), full) and torch.equal(s0.full_tensor(), full)
        sizes = [placement.local_numel_and_offset(shape, r)[0] for r in range(P)]
        chunk = -(-shape[0] // P) * row
        rows_out[name] = {
            "shape": list(shape),
            "units": list(placement.local_units),
            "torch_s": _timed(partial(s0.redistribute, mesh, [Replicate()]), iters),
            "even_s": _timed(partial(ev.redistribute, mesh, [Replicate()]), iters),
            "ragged_s": _timed(partial(rs.redistribute, mesh, [Replicate()]), iters),
            "root_s": _timed(partial(rs.redistribute, mesh, [root]), iters),
            "torch_bytes": P * (P - 1) * chunk * itemsize,
            "even_bytes": _gather_bytes(
                [even.local_numel_and_offset(shape, r)[0] for r in range(P)], itemsize
            ),
            "ragged_bytes": _gather_bytes(sizes, itemsize),
            "root_bytes": (numel - sizes[i % P]) * itemsize,
        }
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small tensors, few iterations")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    shapes, iters = (QUICK_SHAPES, 3) if args.quick else (SHAPES, args.iters)
    rows = run_on_ranks(_worker, WORLD, args=(shapes, iters), timeout=600)[0]
    out = sys.stderr if args.json else sys.stdout
    head = (
        f"{'tensor':10} {'shape':>12} {'torch S0->R ms':>15} {'even->R':>8} {'ratio':>6} "
        f"{'ragged->R':>10} {'ratio':>6} {'->root':>8} {'ratio':>6} "
        f"{'B even':>7} {'B ragged':>9} {'B root':>7}"
    )
    print(head, file=out)
    keys = ("torch", "even", "ragged", "root")
    total = {f"{k}_{u}": 0 for k in keys for u in ("s", "bytes")}
    for name, r in [*rows.items(), ("total", total)]:
        if name != "total":
            for k in total:
                total[k] += r[k]
        shape = "x".join(map(str, r["shape"])) if "shape" in r else ""
        t = r["torch_s"]
        print(
            f"{name:10} {shape:>12} {t * 1e3:15.2f} "
            f"{r['even_s'] * 1e3:8.2f} {r['even_s'] / t:6.2f} "
            f"{r['ragged_s'] * 1e3:10.2f} {r['ragged_s'] / t:6.2f} "
            f"{r['root_s'] * 1e3:8.2f} {r['root_s'] / t:6.2f} "
            + " ".join(
                f"{r[k + '_bytes'] / r['torch_bytes']:{w}.2f}"
                for k, w in (("even", 7), ("ragged", 9), ("root", 7))
            ),
            file=out,
        )
    ratios = {
        f"{k}_{u}": total[f"{k}_{u}"] / total[f"torch_{u}"]
        for k in keys[1:]
        for u in ("s", "bytes")
    }
    print(
        json.dumps(
            {
                "benchmark": "redistribute",
                "world_size": WORLD,
                "iters": iters,
                "ratios": ratios,
                "tensors": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
