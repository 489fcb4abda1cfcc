"""Training-step cost of veragged.fully_shard vs torch's fully_shard, gloo ranks on CPU.

Models (fp32 unless `--mp`; each block and the root sharded; the same batches for both, in one
run):
  llama   the example's Llama (veragged.models.llama) at `--dim`/`--layers`: few, large tensors;
  moe     a Llama-ish stack with many small tensors (1000+ parameters by default): per layer
          two RMSNorms, q/k/v/o projections with biases, a router and `--experts` small
          two-layer expert MLPs with biases. Routing is dense (softmax weights over all
          experts), so every parameter gets a gradient on every rank, as torch's FSDP2 needs.
Each step is forward, backward, `clip_grad_norm_(max_norm=1.0)`, `optimizer.step()` and
`zero_grad()`. Optimizers:
  adamw      `torch.optim.AdamW(model.parameters())`, default arguments, on both sides;
  muon       veragged.optim.Muon (2-D matrices; AdamW for vectors, the embedding and the head),
             veragged only: torch has no peer for it on sharded parameters here;
  adamw8bit  veragged.optim.AdamW8bit (sharded with `adamw8bit_granularity()`), veragged only.

Columns (ratios are veragged / torch; below 1 is better; `-` where there is no torch peer):
  step ms    the fastest of `--steps` steps (after 2 warm-up steps), each step timed on the
             slowest rank: on a machine shared with other jobs the fastest step is the one
             least disturbed by them (the median is in the JSON line). Both sides are built
             in the same ranks and their steps alternate, so both see the same load;
  param B    bytes FSDP wrote per step on its parameter path, mean over ranks;
  grad B     bytes FSDP wrote per step on its gradient path, mean over ranks;
  FSDP ratio (param + grad) of veragged over torch's.
Both byte columns come from one further step under `veragged.tools.write_counter.WriteCounter`
(every op's written bytes outside collectives, attributed by `FSDPPaths`; see
[Note: what WriteCounter counts] there for exactly what each path holds). The JSON line also
holds `rest` (the model's own kernels, the loss, clipping and the optimizer), the
per-rank bytes, the largest FSDP writes by op and site (`--top`) and the fastest step's time
split into forward+backward, clipping and optimizer step+zero_grad (`phase_s`, printed as a
second table; each phase on its slowest rank, so they may add up to more than the step). Memory is not measured here: the runs share one pool of ranks, whose peak RSS
spans them all.

On a GPU (`--device cuda`: one GPU per rank, NCCL; fresh processes) the step is timed to the end
of its kernels, the phases as the host issues them, and the JSON line adds `step_alloc_bytes`:
what a step allocates above what was allocated before it (`torch.cuda.max_memory_allocated`,
"step alloc MB"), `step_reserved_bytes`: what the caching allocator reserves for a step above
what it held before it, its cache emptied first (`torch.cuda.max_memory_reserved`, "reserved
MB"), and `nccl_overlap`: from a profiler trace of one step, the NCCL kernels' time ("NCCL ms")
and the part of it overlapped by compute kernels ("hidden"; see benchmarks/trace_overlap.py).

Targets (issue 11): step time <= 0.9x torch's, FSDP bytes <= 0.5x (gradient path <= torch's,
parameter path 0). Prints a table and one JSON line (`--json`: only the JSON).
Default run: 2 ranks, both models, all optimizers, 6 steps (about 3 minutes on 2 idle CPU
cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from veragged.tools.write_counter import BUCKETS, WriteCounter
from tests.harness.device import backend_for
from veragged.models.llama import Llama, LlamaConfig, RMSNorm, muon_param_groups
from tests.harness.multiprocess import run_on_ranks
from tests.harness.pool import get_pool
from benchmarks._meta import commit_id

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_overlap  # noqa: E402  (NCCL time hidden behind compute, GPU runs)

BATCH, SEQ, VOCAB = 2, 32, 256
OPTIMIZERS = ("adamw", "muon", "adamw8bit")
TORCH_PEER = {"adamw"}


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.mlp_norm = RMSNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))

    def forward(self, x):
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        weights = self.router(h).softmax(-1)
        return x + sum(weights[..., i : i + 1] * e(h) for i, e in enumerate(self.experts))


class MoE(nn.Module):
    def __init__(self, dim: int, layers: int, experts: int, hidden: int, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, heads, experts, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _build(model_name: str, spec: dict) -> nn.Module:
    torch.manual_seed(0)
    if model_name == "llama":
        d = spec["dim"]
        cfg = LlamaConfig(vocab=VOCAB, dim=d, layers=spec["layers"], heads=4,
                          hidden=int(8 * d / 3), max_seq=SEQ)
        return Llama(cfg)
    return MoE(spec["dim"], spec["layers"], spec["experts"], spec["hidden"])


def _optimizer(name: str, model: nn.Module):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters())
    if name == "muon":
        return veragged.optim.Muon(muon_param_groups(model), lr=0.02)
    return veragged.optim.AdamW8bit(model.parameters())


def _sharded(kind: str, model_name: str, spec: dict, opt_name: str, mesh, mp: bool):
    """The model sharded by `kind`'s fully_shard (on the mesh's device), and its optimizer."""
    model = _build(model_name, spec)
    if mesh.device_type != "cpu":
        model = model.to(torch.device(mesh.device_type, torch.cuda.current_device()))
    kwargs = {"mesh": mesh}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if kind == "veragged":
        shard = veragged.fully_shard
        if opt_name == "adamw8bit":
            kwargs["granularity_fn"] = veragged.optim.adamw8bit_granularity()
    else:
        shard = torch_fully_shard
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model, _optimizer(opt_name, model)


def _sync(tokens) -> None:
    if tokens.is_cuda:
        torch.cuda.synchronize()


def _step(model, opt, tokens) -> list[float]:
    """One training step; returns its time and that of forward+backward, clipping, optimizer.
    On a GPU the step is timed to the end of its kernels, the phases as the host issues them."""
    _sync(tokens)
    t0 = time.perf_counter()
    model.loss(tokens).backward()
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    _sync(tokens)
    return [time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2]


def _step_memory(model, opt, tokens) -> tuple[int, int]:
    """Bytes a step allocates above what was allocated before it, and bytes the caching
    allocator reserves above what it held before it (cached free blocks returned first, so
    that the other side's cache does not serve this one). GPU only; (0, 0) on the CPU."""
    if not tokens.is_cuda:
        return 0, 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    _step(model, opt, tokens)
    return (torch.cuda.max_memory_allocated() - base,
            torch.cuda.max_memory_reserved() - base_reserved)


def device_mesh(device: str):
    """In a rank: the 1-D mesh of every rank on `device` ("cpu", or "cuda": this rank's GPU)."""
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    return init_device_mesh(device, (dist.get_world_size(),))


def add_device_argument(parser: argparse.ArgumentParser, gpu_note: str = "") -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu (gloo ranks) or cuda (one GPU per rank, NCCL; `--world` at "
                             "most the GPUs)" + gpu_note)


def rank_runner(parser: argparse.ArgumentParser, args, timeout: float):
    """`run(worker, *job)` on `args.world` ranks of `args.device`: the reused gloo pool on the
    CPU, fresh processes with NCCL on GPUs (the pool's ranks are gloo)."""
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        parser.error(f"--device cuda --world {args.world}: {torch.cuda.device_count()} CUDA "
                     "device(s) visible, one per rank needed")
    if args.device == "cpu":
        pool = get_pool(args.world, device="cpu")
        return lambda worker, *job: pool.run(worker, *job, timeout=timeout)
    return lambda worker, *job: run_on_ranks(worker, args.world, args=job,
                                             backend=backend_for("cuda"), timeout=timeout)


def _worker(kinds: tuple, model_name: str, spec: dict, opt_name: str, steps: int, mp: bool,
            top: int, device: str = "cpu"):
    """Both sides in one job: their timed steps alternate (torch first on even steps), so that
    whatever else runs on the machine weighs on both alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = device_mesh(device)
    plain = _build(model_name, spec)
    n_tensors = sum(1 for _ in plain.parameters())
    numel = sum(p.numel() for p in plain.parameters())
    del plain
    sides = {k: _sharded(k, model_name, spec, opt_name, mesh, mp) for k in kinds}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (steps + 3, world * BATCH, SEQ + 1), generator=g)
    local = data[:, rank * BATCH : (rank + 1) * BATCH]
    if device == "cuda":
        local = local.cuda()
    for i in range(2):
        for k in kinds:
            _step(*sides[k], local[i])
    times: dict = {k: [] for k in kinds}
    for i in range(steps):
        for k in kinds if i % 2 == 0 else kinds[::-1]:
            dist.barrier()
            t = torch.tensor(_step(*sides[k], local[2 + i]), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank, per phase
            times[k].append(t.tolist())
    results = {}
    for k in kinds:
        step_bytes, step_reserved = _step_memory(*sides[k], local[-1])
        # NCCL time hidden behind compute, from a profiler trace of one step (GPU only)
        nccl = trace_overlap.profile_step(lambda: _step(*sides[k], local[-1])) \
            if device == "cuda" else None
        with WriteCounter() as counter:
            _step(*sides[k], local[-1])
        fsdp_ops = sorted(((n, b, op, site) for (b, op, site), n in counter.ops.items()
                           if b != "rest"), reverse=True)[:top]
        results[k] = {
            "step_s": min(t[0] for t in times[k]),
            "step_median_s": statistics.median(t[0] for t in times[k]),
            "phase_s": dict(zip(("fwd_bwd", "clip", "optim"), min(times[k])[1:])),
            "bytes": {b: counter.bucket(b) for b in BUCKETS},
            "collective_copies": counter.collective_copies,
            "top_fsdp_writes": [{"bytes": n, "bucket": b, "op": op, "site": site}
                                for n, b, op, site in fsdp_ops],
            "tensors": n_tensors,
            "params": numel,
            "step_alloc_bytes": step_bytes,
            "step_reserved_bytes": step_reserved,
            "nccl_overlap": nccl,
        }
    return results


def _merge(per_rank: list[dict]) -> dict:
    """Rank 0's result with the bytes averaged over ranks (per-rank values kept)."""
    r = dict(per_rank[0])
    r["bytes_per_rank"] = [x["bytes"] for x in per_rank]
    r["bytes"] = {b: sum(x["bytes"][b] for x in per_rank) / len(per_rank) for b in BUCKETS}
    r["fsdp_bytes"] = r["bytes"]["param"] + r["bytes"]["grad"]
    return r


def _ratio(a, b):
    return a / b if b else (float("nan") if a else 1.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side (6)")
    parser.add_argument("--models", default="llama,moe", help="comma list of llama, moe")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="comma list of " + ", ".join(OPTIMIZERS))
    parser.add_argument("--dim", type=int, default=128, help="llama width (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="llama layers (default 2)")
    parser.add_argument("--moe-dim", type=int, default=64, help="moe width (default 64)")
    parser.add_argument("--moe-layers", type=int, default=14, help="moe layers (default 14)")
    parser.add_argument("--experts", type=int, default=16, help="moe experts per layer (16)")
    parser.add_argument("--expert-hidden", type=int, default=32, help="moe expert width (32)")
    parser.add_argument("--mp", action="store_true",
                        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    parser.add_argument("--top", type=int, default=6, help="largest FSDP writes kept in JSON")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 steps, AdamW only")
    add_device_argument(parser)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args(argv)
    run_job = rank_runner(parser, args, timeout=1200)  # one set of ranks for every run
    specs = {
        "llama": {"dim": args.dim, "layers": args.layers},
        "moe": {"dim": args.moe_dim, "layers": args.moe_layers, "experts": args.experts,
                "hidden": args.expert_hidden},
    }
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    opts = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    steps = args.steps
    if args.quick:
        specs = {"llama": {"dim": 64, "layers": 2},
                 "moe": {"dim": 32, "layers": 2, "experts": 4, "hidden": 16}}
        opts, steps = ["adamw"], 2
    for name in models:
        if name not in specs:
            parser.error(f"unknown model {name!r}: choose from {sorted(specs)}")
    for name in opts:
        if name not in OPTIMIZERS:
            parser.error(f"unknown optimizer {name!r}: choose from {OPTIMIZERS}")
    out = sys.stderr if args.json else sys.stdout
    header = (f"{'model':6} {'tensors':>7} {'params':>8} {'optim':9} {'torch ms':>9} "
              f"{'ours ms':>8} {'ratio':>6} {'torch param B':>13} {'ours param B':>12} "
              f"{'torch grad B':>12} {'ours grad B':>11} {'grad ratio':>10} {'FSDP ratio':>10}")
    print(header, file=out)
    rows = []
    for name in models:
        for opt_name in opts:
            r = {"model": name, "spec": specs[name], "optimizer": opt_name}
            kinds = ("torch", "veragged") if opt_name in TORCH_PEER else ("veragged",)
            res = run_job(_worker, kinds, name, specs[name], opt_name, steps, args.mp,
                          args.top, args.device)
            for kind in kinds:
                r[kind] = _merge([per_rank[kind] for per_rank in res])
            v, t = r["veragged"], r.get("torch")
            if t is not None:
                r["time_ratio"] = v["step_s"] / t["step_s"]
                r["grad_ratio"] = _ratio(v["bytes"]["grad"], t["bytes"]["grad"])
                r["fsdp_ratio"] = _ratio(v["fsdp_bytes"], t["fsdp_bytes"])
            rows.append(r)

            def cell(x, fmt, width):
                return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"

            print(
                f"{name:6} {v['tensors']:7d} {v['params'] / 1e6:7.2f}M {opt_name:9} "
                f"{cell(t and t['step_s'] * 1e3, '.1f', 9)} {v['step_s'] * 1e3:8.1f} "
                f"{cell(r.get('time_ratio'), '.2f', 6)} "
                f"{cell(t and t['bytes']['param'], ',.0f', 13)} {v['bytes']['param']:12,.0f} "
                f"{cell(t and t['bytes']['grad'], ',.0f', 12)} {v['bytes']['grad']:11,.0f} "
                f"{cell(r.get('grad_ratio'), '.2f', 10)} {cell(r.get('fsdp_ratio'), '.2f', 10)}",
                file=out,
            )
    print(
        "(bytes: per rank per step, mean over ranks, outside collectives; "
        "muon/adamw8bit have no torch peer)",
        file=out,
    )
    gpu = args.device == "cuda"
    print(f"\n{'model':6} {'optim':9} {'side':8} {'fwd+bwd ms':>10} {'clip ms':>8} "
          f"{'optim ms':>8}" + (f" {'step alloc MB':>13} {'reserved MB':>11} {'NCCL ms':>8} "
                                f"{'hidden':>6}" if gpu else "")
          + "   (the fastest step's phases" + (", as the host issues them)" if gpu else ")"),
          file=out)
    for r in rows:
        for kind in ("torch", "veragged"):
            if kind in r:
                ph = r[kind]["phase_s"]
                mem = ""
                if gpu:
                    ov = r[kind]["nccl_overlap"]
                    mem = (f" {r[kind]['step_alloc_bytes'] / 2**20:13.1f} "
                           f"{r[kind]['step_reserved_bytes'] / 2**20:11.1f} "
                           f"{ov['nccl_us'] / 1e3:8.2f} {ov['hidden']:6.0%}")
                print(f"{r['model']:6} {r['optimizer']:9} {kind:8} {ph['fwd_bwd'] * 1e3:10.1f} "
                      f"{ph['clip'] * 1e3:8.1f} {ph['optim'] * 1e3:8.1f}{mem}", file=out)
    print(json.dumps({
        "benchmark": "fsdp_step",
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "torch": torch.__version__,
        "world_size": args.world,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
        "steps": steps,
        "mixed_precision": args.mp,
        "rows": rows,
    }))


if __name__ == "__main__":
    main()
