"""accelerate's FSDP2 plugin on CPU gloo ranks: the job of test_accelerate.py.

The user code: `Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
transformer-based wrap of LlamaDecoderLayer, cpu_ram_efficient_loading=True,
state_dict_type="FULL_STATE_DICT"))`, a tiny HF Llama whose weights only rank 0 holds (the
others build theirs from other seeds: with `cpu_ram_efficient_loading`, accelerate broadcasts
rank 0's through torch's `distribute_tensor`), `accelerator.prepare(model, optimizer)`, training
with `accelerator.backward` and `accelerator.clip_grad_norm_` (max_norm 1e9: computed, never
binding), `save_state` after step 2 (full
model and optimizer state dicts on rank 0), `get_state_dict` at the end, then `load_state` (torch's
`set_model_state_dict(..., broadcast_from_rank0=True)`) and step 3 replayed from it.

Launcher-only switches (never in the package):
- on CPU accelerate silently turns the FSDP plugin into DDP (`MULTI_CPU` is not among the
  distributed types that take the plugin); the distributed type is switched back to FSDP in the
  accelerator's state and in `PartialState._shared_state` (else `prepare` reverts it);
- `impl="veragged"`: accelerate imports `fully_shard` from `torch.distributed.fsdp` when it
  prepares the model, so that attribute is `veragged.fully_shard` for the run, and
  `veragged.route_torch_entry_points()` is held (accelerate's loaders call torch's
  `distribute_tensor` and `set_model_state_dict`);
- accelerate's singleton states are reset after the run (the pool reuses the process).
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch
import torch.distributed as dist

from tests.clients._hf import SEQ, VOCAB, _config


def _batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen)


def _step(accelerator, model, opt, step: int, norms: list | None = None) -> float:
    ids = _batch(step, dist.get_rank())
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    # Clipping that never binds (the coefficient clamps to exactly 1.0): the norm is computed
    # and returned, but a binding max_norm would scale by a coefficient whose last bits depend
    # on each rank's local shard, and the implementations' shard boundaries differ.
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    opt.zero_grad()
    if norms is not None:
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return loss.detach().item()


def run(impl: str, folder: str, steps: int = 4) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        if impl == "veragged":
            import torch.distributed.fsdp as torch_fsdp

            import veragged

            stack.enter_context(mock.patch.object(torch_fsdp, "fully_shard", veragged.fully_shard))
            stack.enter_context(veragged.route_torch_entry_points())
        elif impl != "torch":
            raise ValueError(f"impl must be 'torch' or 'veragged', got {impl!r}")
        stack.callback(PartialState._reset_state)
        stack.callback(AcceleratorState._reset_state, True)

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], cpu_ram_efficient_loading=True,
            state_dict_type="FULL_STATE_DICT", reshard_after_forward=True)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        assert accelerator.distributed_type == DistributedType.MULTI_CPU  # the DDP fallback
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP

        torch.manual_seed(0 if rank == 0 else 7 + rank)  # only rank 0's weights may count
        model = AutoModelForCausalLM.from_config(_config("llama_lora"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = accelerator.prepare(model, opt)
        kinds = sorted({type(p).__name__ + ":" + ",".join(type(pl).__name__ for pl in p.placements)
                        for p in model.parameters()})
        ckpt = os.path.join(folder, f"accelerate_{impl}")
        losses, norms = [], []
        for step in range(steps):
            losses.append(_step(accelerator, model, opt, step, norms))
            if step == 1:
                accelerator.save_state(ckpt)
        final = accelerator.get_state_dict(model)
        accelerator.load_state(ckpt)
        replayed = _step(accelerator, model, opt, 2)
    return {"loss": losses, "norm": norms, "replayed": replayed, "kinds": kinds,
            "state": {k: v.clone() for k, v in final.items()} if rank == 0 else None}
