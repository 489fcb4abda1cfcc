"""FSDP x TP and FSDP x EP: veragged.fully_shard vs torch's fully_shard, 4 gloo ranks on CPU.

Layouts (world 4, fp32, each block and the root sharded, the same batches for both sides):
  dp2xtp2  the example's Llama with q/k/v and gate/up apart (veragged.models.llama.parallelize:
           Megatron column/row split over tp 2), FSDP over dp 2;
  dp2xep2  veragged.models.moe (fused [E, ...] experts Shard(0) over ep 2, token all-to-all),
           the experts FSDP-sharded over the other 2 ranks, the dense part over all 4
           (torchtitan's dp_shard_in_ep layout).
Each step is forward, backward, `veragged.clip_grad_norm_` (torch's refuses parameters on two
meshes, with either fully_shard), `torch.optim.AdamW.step()` and `zero_grad()`.

Columns (ratios veragged / torch; below 1 is better):
  step ms    fastest of `--steps` timed steps (after 2 warm-up steps), each on its slowest rank;
             the sides' steps alternate in the same ranks, so both see the same machine load;
  pad B      bytes of padding each rank's shards hold beyond parameter data, mean over ranks:
             veragged: each DBuffer's P * S slots minus the TP blocks planned in them (alignment
             to 256 B, uneven TP blocks padded to torch.chunk's first); torch: each FSDPParam's
             padded shard times P minus its TP block (torch.chunk's padding);
  comm B     bytes of FSDP's collectives per rank per step (the larger of output and input of
             every all-gather, reduce-scatter and all-reduce, `WriteCounter.collective_bytes`),
             the TP/EP collectives of the model (all-to-all, the TP all-reduces and gathers)
             excluded as they are the same on both sides;
  FSDP B     bytes FSDP wrote per step outside collectives (parameter + gradient paths, see
             [Note: what WriteCounter counts]), mean over ranks.
On GPUs (`--device cuda`: 4 GPUs, NCCL) the step is timed to the end of its kernels and the
table adds what a step allocates and reserves and the NCCL time a profiler trace shows, with
the part of it hidden behind compute (as `benchmarks/fsdp_step.py --device cuda`).
Prints a table and one JSON line (`--json`: only the JSON). About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from veragged.tools.write_counter import WriteCounter
from veragged.models.llama import Llama, LlamaConfig, parallelize
from veragged.models.moe import MoE, MoEConfig, expert_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_step  # noqa: E402  (device mesh, ranks, step memory of GPU runs)
import trace_overlap  # noqa: E402

BATCH, SEQ, VOCAB = 2, 32, 256
FSDP_COLLECTIVES = ("allgather", "reduce_scatter", "allreduce")


def _build(kind: str, layout: str, dim: int, layers: int, device: str = "cpu"):
    """The model under `kind`'s fully_shard in `layout` on `device` ("cpu", or "cuda": this
    rank's GPU); returns it and this rank's data index."""
    shard = veragged.fully_shard if kind == "veragged" else torch_fully_shard
    world = dist.get_world_size()
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    on_device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else None
    if layout == "dp2xtp2":
        mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = Llama(LlamaConfig(vocab=VOCAB, dim=dim, layers=layers, heads=4,
                                  hidden=int(8 * dim / 3) // 2 * 2, max_seq=SEQ, fused=False))
        if on_device is not None:
            model.to(on_device)
        parallelize(model, mesh["tp"])
        for block in model.blocks:
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank()
    mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    dp = mesh._flatten("dp")
    model = MoE(MoEConfig(vocab=VOCAB, dim=dim, layers=layers, experts=8, hidden=dim))
    if on_device is not None:
        model.to(on_device)
    expert_parallel(model, mesh["ep"])
    for block in model.blocks:
        shard(block.moe.experts, mesh=mesh["dp_mod_ep"])
        block.moe.experts.set_gradient_divide_factor(world)
        block.moe.experts.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
        shard(block, mesh=dp)
    shard(model, mesh=dp)
    return model, dist.get_rank()


def _padding_bytes(kind: str, model) -> float:
    """Padding this rank's shards hold (see the module docstring), in bytes."""
    total = 0.0
    for m in model.modules():
        if kind == "veragged":
            state = getattr(m, "_veragged_state", None)
            if state is None or state.modules[0] is not m:
                continue
            for g in state.groups:
                b = g.buffer
                data = sum((e.used if e.used is not None else e.end - e.start) for e in b.entries)
                total += (b.world * b.shard_size - data) / b.world * b.dtype.itemsize
        else:
            get = getattr(m, "_get_fsdp_state", None)
            if get is None:
                continue
            for group in get()._fsdp_param_groups:
                world = group.mesh_info.shard_mesh_size
                for fp in group.fsdp_params:
                    padded = fp.padded_sharded_param_size.numel() * world
                    item = fp.sharded_param.dtype.itemsize
                    total += (padded - fp._orig_size.numel()) / world * item
    return total


def _step(model, opt, tokens) -> float:
    """One step's time; on a GPU to the end of its kernels."""
    fsdp_step._sync(tokens)
    t0 = time.perf_counter()
    model.loss(tokens).backward()
    veragged.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    fsdp_step._sync(tokens)
    return time.perf_counter() - t0


def _worker(layout: str, dim: int, layers: int, steps: int, device: str = "cpu") -> dict:
    sides = {}
    for kind in ("torch", "veragged"):
        model, data_rank = _build(kind, layout, dim, layers, device)
        sides[kind] = (model, torch.optim.AdamW(model.parameters()))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (steps + 3, 8, BATCH, SEQ + 1), generator=g)[:, data_rank]
    if device == "cuda":
        data = data.cuda()
    for i in range(2):
        for kind in sides:
            _step(*sides[kind], data[i])
    times = {k: [] for k in sides}
    for i in range(steps):
        for kind in (("torch", "veragged") if i % 2 == 0 else ("veragged", "torch")):
            dist.barrier()
            t = torch.tensor(_step(*sides[kind], data[2 + i]), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[kind].append(t.item())
    out = {}
    for kind, (model, opt) in sides.items():
        step_bytes, step_reserved = fsdp_step._step_memory(model, opt, data[-1])
        nccl = trace_overlap.profile_step(lambda: _step(model, opt, data[-1])) \
            if device == "cuda" else None
        with WriteCounter() as counter:
            _step(model, opt, data[-1])
        comm = sum(n for op, n in counter.collective_bytes.items()
                   if any(c in op for c in FSDP_COLLECTIVES))
        out[kind] = {
            "step_alloc_bytes": step_bytes,
            "step_reserved_bytes": step_reserved,
            "nccl_overlap": nccl,
            "step_s": min(times[kind]),
            "step_median_s": statistics.median(times[kind]),
            "pad_bytes": _padding_bytes(kind, model),
            "comm_bytes": comm,
            "fsdp_bytes": counter.bucket("param") + counter.bucket("grad"),
            "collectives": dict(counter.collective_bytes),
        }
    return out


def _mean(per_rank: list[dict], kind: str, key: str) -> float:
    return sum(r[kind][key] for r in per_rank) / len(per_rank)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layouts", default="dp2xtp2,dp2xep2")
    parser.add_argument("--json", action="store_true")
    fsdp_step.add_device_argument(parser, "; 4 ranks always")
    args = parser.parse_args(argv)
    args.world = 4
    run_job = fsdp_step.rank_runner(parser, args, timeout=1200)
    rows, record = [], {"world": 4, "steps": args.steps, "dim": args.dim, "layers": args.layers,
                        "device": args.device if args.device == "cpu"
                        else torch.cuda.get_device_name(0)}
    gpu = args.device == "cuda"
    for layout in args.layouts.split(","):
        per_rank = run_job(_worker, layout, args.dim, args.layers, args.steps, args.device)
        r = {k: {key: _mean(per_rank, k, key)
                 for key in ("pad_bytes", "comm_bytes", "fsdp_bytes")} for k in per_rank[0]}
        for k in r:
            for key in ("step_s", "step_median_s", "step_alloc_bytes", "step_reserved_bytes",
                        "nccl_overlap"):
                r[k][key] = per_rank[0][k][key]
        record[layout] = r
        rows.append((layout, r))
    if not args.json:
        head = f"{'layout':9} {'side':9} {'step ms':>8} {'pad B':>10} {'comm B':>12} {'FSDP B':>12}"
        print(head + (f" {'alloc MB':>9} {'reserved MB':>11} {'NCCL ms':>8} {'hidden':>6}"
                      if gpu else ""))
        for layout, r in rows:
            for k in ("torch", "veragged"):
                x = r[k]
                extra = ""
                if gpu:
                    ov = x["nccl_overlap"]
                    extra = (f" {x['step_alloc_bytes'] / 2**20:9.1f} "
                             f"{x['step_reserved_bytes'] / 2**20:11.1f} "
                             f"{ov['nccl_us'] / 1e3:8.2f} {ov['hidden']:6.0%}")
                print(f"{layout:9} {k:9} {x['step_s'] * 1e3:8.1f} {x['pad_bytes']:10.0f} "
                      f"{x['comm_bytes']:12.0f} {x['fsdp_bytes']:12.0f}{extra}")
            t, v = r["torch"], r["veragged"]
            ratio = [v[k] / t[k] if t[k] else float("nan")
                     for k in ("step_s", "pad_bytes", "comm_bytes", "fsdp_bytes")]
            print(f"{layout:9} {'ratio':9} {ratio[0]:8.2f} {ratio[1]:10.2f} {ratio[2]:12.2f} "
                  f"{ratio[3]:12.2f}")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
