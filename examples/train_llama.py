"""Train a small Llama-style decoder with veragged.fully_shard, save a DCP checkpoint and resume.

    torchrun --nproc-per-node 4 examples/train_llama.py            # CPU/gloo, or CUDA/NCCL on GPUs
    torchrun --nproc-per-node 4 examples/train_llama.py --steps 40  # resumes from ./llama_ckpt
    torchrun --nproc-per-node 4 examples/train_llama.py --ckpt-every 10 --keep 3
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2      # FSDP x tensor parallelism
    torchrun --nproc-per-node 4 examples/train_llama.py --ep 2      # MoE, FSDP x expert parallel

The text is the source of Python's own `argparse` module, as bytes (vocabulary 256). Each block is
sharded with `veragged.fully_shard`; the fused QKV projection gets 8-row blocks (granularity_fn),
norms stay whole on one rank. `--optim` picks veragged's distributed Muon (default; AdamW for the
embedding, head and norms), its block-wise 8-bit AdamW, or torch's AdamW. Every `--log-every`
steps rank 0 prints loss, tokens/s and peak memory (`--log-exact` adds the loss's exact bits).

Checkpoints: the model and optimizer state (and the step) are saved with
torch.distributed.checkpoint every `--ckpt-every` steps and at the end, each into its own
directory `<--ckpt>/step-<N>`, keeping the newest `--keep`; a later run with more `--steps`
resumes from the newest complete one and goes on. A save is written into `step-<N>.tmp`; only
when `dcp.save` has returned on every rank (a barrier) does rank 0 rename it to `step-<N>`
(atomic), so a `step-<N>` directory is always a whole checkpoint, and a save that did not finish
(a rank killed during it) is left as `.tmp`, never loaded, and removed by the next run. Older
checkpoints are renamed to `step-<M>.del` before they are deleted. Batches are a function of the
step and the rank alone (`batches`), so a resumed run trains on what an uninterrupted one would:
on the same ranks and split its losses are bitwise those of the uninterrupted run. (An older
`--ckpt` holding a single checkpoint directly, `<--ckpt>/.metadata`, is refused with the command
that moves it into the new layout.)

`--pg-timeout S` sets the process group's timeout: a collective that a dead rank never joins
fails within it on the other ranks (gloo: sooner, when the dead rank's connections close), with
an error that names the collective and its group, and no checkpoint is completed by a step that
did not finish on every rank.

`--tp N` splits q, k, v, gate and up by columns and out and down by rows over N ranks
(`parallelize_module`), FSDP over the other world / N; `--ep N` trains the mixture-of-experts
variant (veragged.models.moe), its fused experts split over N ranks with tokens routed by
all-to-all, FSDP over the rest (torchtitan's dp_shard_in_ep layout). A checkpoint resumes under
another split of the same model (`--tp 2` into `--tp 4`, `--ep 2` into `--ep 4`, any world size);
`--tp` models keep q, k, v (and gate, up) apart, so they and the fused `--tp 1` model differ.

`--fp8 block128` all-gathers the weight of every Linear inside the transformer blocks (fused
QKV, out, fused gate/up, down) as FP8 E4M3 in 128x128 tiles with fp32 scales (DeepSeek-V3's
format, `veragged.BlockFP8()`), `--fp8 mxfp8` as MXFP8 (1x32 tiles, E8M0 scales,
`veragged.MXFP8()`): about 1 byte per element instead of the param dtype's 2 (`--bf16`) or 4,
dequantised into the param-dtype weight before the forward; masters, gradients, the optimizer
and checkpoints are unchanged. The embedding, the output head and the norms are gathered
unquantised, as DeepSeek-V3 keeps them in high precision. Rank 0 prints the gathered bytes per
element and the all-gathers of the first step. Not with `--tp` or `--ep` (refused up front).
"""

import argparse
import datetime
import gc
import math
import os
import re
import resource
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import veragged
from veragged.models.llama import Llama, LlamaConfig, parallelize
from veragged.models.moe import MoE, MoEConfig, expert_parallel


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="train until this global step")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--optim", choices=("muon", "adamw8bit", "adamw"), default="muon")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (Muon's is --muon-lr)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument(
        "--bf16", action="store_true", help="bf16 compute, fp32 reduce and master weights"
    )
    p.add_argument("--tie", action="store_true", help="tie the embedding and output weights")
    p.add_argument("--ckpt", default="llama_ckpt",
                   help="checkpoint root: one DCP checkpoint per saved step in step-<N> ('' to "
                        "skip); resumes from the newest complete one")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="save every N steps (0: only at the end; the end is always saved)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (>= 1)")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="process group timeout in seconds (default: torch's)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--log-exact", action="store_true",
                   help="add the logged loss's exact value (float.hex) to each log line")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Llama)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (trains the MoE)")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (with --ep)")
    p.add_argument("--block-size", type=int, default=None,
                   help="8-bit AdamW block (default: the largest divisor of 256 inside every "
                        "tensor-parallel part of a row)")
    p.add_argument("--fp8", choices=tuple(FP8_FORMATS), default="none",
                   help="all-gather the Linear weights of the transformer blocks (qkv, out, "
                        "gate_up, down) in 8 bits: block128 = BlockFP8() (FP8 E4M3, 128x128 "
                        "tiles, fp32 scales), mxfp8 = MXFP8() (1x32 tiles, E8M0 scales); the "
                        "embedding, output head and norms are gathered unquantised. Needs "
                        "--tp 1 and --ep 1")
    args = p.parse_args()
    if args.keep < 1:
        p.error("--keep must be at least 1")
    if args.ckpt and os.path.isfile(os.path.join(args.ckpt, ".metadata")):
        p.error(f"--ckpt {args.ckpt} holds one checkpoint in the old layout; checkpoints now "
                f"live in {args.ckpt}/step-<N>: move it with `mkdir {args.ckpt}.new && mv "
                f"{args.ckpt} {args.ckpt}.new/step-<its step> && mv {args.ckpt}.new {args.ckpt}`")
    if args.fp8 != "none" and (args.tp > 1 or args.ep > 1):
        # veragged's fully_shard raises NotImplementedError for block-scaled formats on
        # tensor-parallel DTensors (a TP part's tiles are not the full weight's), which the
        # --tp Linears and the --ep experts are.
        p.error(f"--fp8 {args.fp8} needs --tp 1 and --ep 1: veragged does not quantise "
                "tensor-parallel weights (--tp's split Linears) or expert-parallel ones "
                "(--ep's experts)")
    return args


def text_tokens(device):
    with open(argparse.__file__, "rb") as f:
        data = f.read()
    return torch.tensor(list(data), dtype=torch.long, device=device)


def batches(tokens, batch, seq, rank, world, step):
    """Batch `step` for this rank: random windows, the same draw on every rank, split by rank."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, tokens.numel() - seq - 1, (world * batch,), generator=g)
    mine = starts[rank * batch : (rank + 1) * batch].tolist()
    return torch.stack([tokens[s : s + seq + 1] for s in mine])


# `--fp8`: the block-scaled format of the transformer blocks' Linear weights.
FP8_FORMATS = {"none": None, "block128": veragged.BlockFP8(), "mxfp8": veragged.MXFP8()}


def fp8_quant_fn(model, fmt):
    """`quant_fn(fqn, param)` for fully_shard: `fmt` for the weight of every nn.Linear inside
    a transformer block, None for the rest (embedding, output head, norms, biases) and for
    everything when `fmt` is None. Parameters are told apart by identity, since each
    fully_shard call names them relative to its own module."""
    if fmt is None:
        return None
    weights = {id(m.weight) for block in model.blocks for m in block.modules()
               if isinstance(m, nn.Linear)}
    return lambda fqn, param: fmt if id(param) in weights else None


def unless_quantized(granularity_fn, quant_fn):
    """`granularity_fn`, except None (no block of its own) for a parameter `quant_fn` gives a
    format: the planner keeps a format's whole tile-rows on one rank, and a granularity must
    divide them (MXFP8's tile-row is one row, finer than the fused QKV's 8-row blocks). The
    8-bit AdamW blocks (--block-size divides every row) stay inside one row either way."""
    if quant_fn is None:
        return granularity_fn
    return lambda fqn, param: None if quant_fn(fqn, param) else granularity_fn(fqn, param)


def print_quant_stats(model, fmt_name):
    """Rank 0's line on the 8-bit gathers of the first step: formats, bytes per gathered
    element (scales, padding and the unquantised tensors of the same groups included; a bf16
    gather is 2.0) and all-gathers."""
    stats = model.quant_stats()
    elements = sum(s.elements for s in stats)
    gathered = sum(s.gather_bytes for s in stats)
    names = sorted({f for s in stats for f in s.formats.values() if f != "raw"})
    quantized = sum(f != "raw" for s in stats for f in s.formats.values())
    print(
        f"fp8 {fmt_name}: {', '.join(names)} on {quantized} weights in {len(stats)} groups, "
        f"{gathered / elements:.4f} bytes/element gathered ({gathered / 2**20:.2f} MiB per "
        f"unshard of all groups), {sum(s.all_gathers for s in stats)} all-gathers and "
        f"{sum(s.quantizations for s in stats)} quantisations in the first step",
        flush=True,
    )


def granularity(fqn, param):
    if fqn.endswith("qkv.weight") and param.ndim == 2:
        return 8 * param.shape[1]  # whole 8-row blocks of the fused QKV projection
    if fqn.endswith("norm.weight"):
        return param.numel()  # a norm's weight stays whole on one rank
    return None  # element-wise


def make_optimizer(args, model):
    if args.optim == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if args.optim == "adamw8bit":
        return veragged.optim.AdamW8bit(model.parameters(), lr=args.lr, weight_decay=0.1,
                                        block_size=args.block_size)
    named = dict(model.named_parameters())
    # Experts ([E, dim, hidden]) and vectors on AdamW, matrices (TP-split ones too) on Muon.
    adamw = [p for n, p in named.items() if "embed" in n or "head" in n or p.ndim != 2]
    qkv = [p for n, p in named.items() if n.endswith("qkv.weight")]
    rest = [p for p in named.values() if all(p is not q for q in adamw + qkv)]
    groups = [{"params": adamw, "use_muon": False, "lr": args.lr}, {"params": rest}]
    if qkv:
        groups.append({"params": qkv, "split_sizes": (args.dim,) * 3})  # q, k and v apart
    return veragged.optim.Muon(
        groups,
        lr=args.muon_lr,
        weight_decay=0.1,
    )


def build_llama(args, device, world, mp, blocks):
    """The Llama, sharded over all ranks or (--tp) over (dp, tp), with --fp8's quant_fn; returns
    it with this rank's data-parallel index and the data-parallel size (TP ranks share a
    batch)."""
    tp = args.tp
    cfg = LlamaConfig(
        vocab=256,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        hidden=args.hidden,
        max_seq=args.seq,
        tie_embeddings=args.tie,
        fused=tp == 1,
    )
    with torch.device("meta"):
        model = Llama(cfg)
    if tp > 1:
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        dp = mesh["dp"]
    else:
        dp = init_device_mesh(device.type, (world,))
    quant = fp8_quant_fn(model, FP8_FORMATS[args.fp8])
    blocks = unless_quantized(blocks, quant)
    for block in model.blocks:
        veragged.fully_shard(block, mesh=dp, mp_policy=mp, granularity_fn=blocks, quant_fn=quant)
    veragged.fully_shard(model, mesh=dp, mp_policy=mp, granularity_fn=blocks, quant_fn=quant)
    return model, dp.get_local_rank(), dp.size()


def build_moe(args, device, world, mp, blocks):
    """The MoE variant: experts split over --ep ranks, FSDP over the rest for them and over
    every rank for the dense parameters (every rank is data-parallel)."""
    ep = args.ep
    cfg = MoEConfig(vocab=256, dim=args.dim, layers=args.layers, heads=args.heads,
                    experts=args.experts, hidden=args.dim)
    with torch.device("meta"):
        model = MoE(cfg)
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    dp = mesh._flatten("dp")
    expert_parallel(model, mesh["ep"])
    for block in model.blocks:
        experts = block.moe.experts
        veragged.fully_shard(experts, mesh=mesh["dp_mod_ep"], mp_policy=mp, granularity_fn=blocks)
        # The token all-to-all's backward already summed the ep ranks' gradients.
        experts.set_gradient_divide_factor(world)
        veragged.fully_shard(block, mesh=dp, mp_policy=mp, granularity_fn=blocks)
    veragged.fully_shard(model, mesh=dp, mp_policy=mp, granularity_fn=blocks)
    return model, dist.get_rank(), world


# Test-only: VERAGGED_EXAMPLE_KILL=<where>:<step>[:<rank>] makes rank <rank> (default 1) SIGKILL
# itself, as a crashed or preempted rank would die, at global step <step> (1-based, as logged):
# `save` after writing its part of checkpoint step-<step> but before the save completes,
# `forward` at the last transformer block's forward, `backward` when the gradient of the first
# block's output is computed (the last block's backward done). tests/examples use it.
KILL_WHERE = ("save", "forward", "backward")


def kill_hook():
    spec = os.environ.get("VERAGGED_EXAMPLE_KILL")
    if not spec:
        return None
    where, step, *rank = spec.split(":")
    if where not in KILL_WHERE:
        raise SystemExit(f"VERAGGED_EXAMPLE_KILL={spec}: <where> is one of {KILL_WHERE}")
    if dist.get_rank() != int(rank[0] if rank else 1):
        return None
    return where, int(step)


def die():
    print(f"rank {dist.get_rank()}: VERAGGED_EXAMPLE_KILL, SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(model, kill, current):
    """Install the forward and backward kills on this rank; `current()` is the step in
    progress (1-based)."""
    where, at = kill
    if where == "forward":
        model.blocks[-1].register_forward_pre_hook(
            lambda module, args: die() if current() == at else None)
    elif where == "backward":
        def arm(module, args, out):
            if current() == at and torch.is_grad_enabled():
                out.register_hook(lambda grad: die())
        model.blocks[0].register_forward_hook(arm)


class KillingWriter(FileSystemWriter):
    """Test-only (`save:<step>`): writes this rank's part, then dies before the save completes."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        die()


STEP_DIR = re.compile(r"step-(\d+)")


def complete_steps(root):
    """The steps of the complete checkpoints under `root`, ascending: `step-<N>` directories
    (renamed from `.tmp` only once every rank's save returned) with DCP's metadata."""
    if not os.path.isdir(root):
        return []
    return sorted(
        int(m[1]) for m in map(STEP_DIR.fullmatch, os.listdir(root))
        if m and os.path.isfile(os.path.join(root, m[0], ".metadata"))
    )


def latest_checkpoint(root, rank):
    """The newest complete checkpoint's step (None if none), decided by rank 0 for every rank;
    rank 0 also removes what unfinished saves and deletions left."""
    found = [None]
    if rank == 0:
        steps = complete_steps(root)
        found = [steps[-1] if steps else None]
        if os.path.isdir(root):
            for name in os.listdir(root):
                if re.fullmatch(r"step-\d+\.(tmp|del)", name):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.broadcast_object_list(found, src=0)
    return found[0]


def save_checkpoint(root, step, model, opt, rank, keep, kill):
    """Save `step` into `root/step-<step>` (through `.tmp`), then keep the newest `keep`."""
    tmp, final = os.path.join(root, f"step-{step}.tmp"), os.path.join(root, f"step-{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, opt)
    writer = (KillingWriter if kill == ("save", step) else FileSystemWriter)(tmp)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
             storage_writer=writer)
    dist.barrier()  # every rank's save returned: the checkpoint is whole
    if rank == 0:
        if os.path.isdir(final):  # a save of this step already completed (not by this run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename is durable
        finally:
            os.close(fd)
        for old in complete_steps(root)[:-keep]:
            gone = os.path.join(root, f"step-{old}.del")
            os.replace(os.path.join(root, f"step-{old}"), gone)
            shutil.rmtree(gone)
        print(f"saved {final} at step {step}", flush=True)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", 1)
    )
    timeout = {} if args.pg_timeout is None else {
        "timeout": datetime.timedelta(seconds=args.pg_timeout)}
    dist.init_process_group("nccl" if use_cuda else "gloo", **timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if use_cuda
        else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)
    if args.tp > 1 and args.ep > 1:
        raise SystemExit("--tp and --ep: pick one")
    par = max(args.tp, args.ep)
    if world % par:
        raise SystemExit(f"--tp/--ep {par} must divide the world size {world}")
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.bf16
        else MixedPrecisionPolicy()
    )
    # With --tp the SwiGLU width is a multiple of 128 (so the model, and its checkpoints, are
    # the same for every TP size up to 128); 8-bit AdamW's quantisation blocks must lie inside
    # one TP part of a row, and a checkpoint resumes only with the block size it was saved with.
    args.hidden = int(8 * args.dim / 3)
    if args.tp > 1:
        args.hidden = -(-args.hidden // 128) * 128
    if args.block_size is None:
        args.block_size = math.gcd(256, args.dim // args.tp, args.hidden // args.tp)
    blocks = (veragged.optim.adamw8bit_granularity(args.block_size)
              if args.optim == "adamw8bit" else granularity)
    # Built on the meta device (no memory), sharded, then materialised shard by shard: how large
    # models are built. init_weights draws what the constructor would, so the result equals a
    # model built directly under the same seed.
    if args.ep > 1:
        model, dp_rank, dp_world = build_moe(args, device, world, mp, blocks)
    else:
        model, dp_rank, dp_world = build_llama(args, device, world, mp, blocks)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    opt = make_optimizer(args, model)

    start = 0
    latest = latest_checkpoint(args.ckpt, rank) if args.ckpt else None
    if latest is not None:
        path = os.path.join(args.ckpt, f"step-{latest}")
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)

    kill = kill_hook()
    step = start
    if kill:
        arm_kill(model, kill, lambda: step + 1)

    tokens = text_tokens(device)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"{world} ranks on {device.type}, {n_params / 1e6:.2f}M parameters, steps {start}..{args.steps}",
            flush=True,
        )
    t0, seen = time.perf_counter(), 0
    loss = None
    for step in range(start, args.steps):
        loss = model.loss(batches(tokens, args.batch, args.seq, dp_rank, dp_world, step))
        loss.backward()
        veragged.clip_grad_norm_(model.parameters(), 1.0)  # TP/EP: parameters on two meshes
        opt.step()
        opt.zero_grad()
        seen += args.batch * args.seq * dp_world
        if rank == 0 and step == start and args.fp8 != "none":
            print_quant_stats(model, args.fp8)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            rate = seen / (time.perf_counter() - t0)
            exact = f"  exact {loss.item().hex()}" if args.log_exact else ""
            print(
                f"step {step + 1:5d}  loss {loss.item():.4f}  {rate:9.0f} tokens/s  peak {peak_memory_mb(device):7.1f} MiB{exact}",
                flush=True,
            )
        done = step + 1
        if args.ckpt and (done == args.steps or args.ckpt_every and done % args.ckpt_every == 0):
            save_checkpoint(args.ckpt, done, model, opt, rank, args.keep, kill)
    # Nothing may hold a process group when they are torn down: destroy_process_group then
    # joins gloo's threads here, not at interpreter exit, where a gloo thread still releasing
    # a collective's tensor dies taking the GIL and aborts the process (pytorch#117762; ~1 in
    # 12 runs before). No rank tears its group down while a peer is still inside a collective
    # (gloo aborts the process when that happens).
    del model, opt, loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
