"""torchtune 0.6.1's distributed utilities on CPU gloo ranks: the launcher of test_torchtune.py.

torchtune 0.6.1 imports torchao 0.13 at import time, and an installed torchao makes torchtitan
0.3.0 build Triton kernels at import (which fails on CPU-only machines), so torchtune lives in its
own virtual environment (`build/venv-torchtune`, made by scripts/install_test.sh with the system site
packages visible, so torch and veragged are the same). The test runs
`build/venv-torchtune/bin/python -m tests.clients._tune OUT`, which runs the job below on a
2-rank pool with torch's fully_shard and then with veragged's and pickles both results (or the
error text of an implementation that failed) to OUT.

The job is the model set-up of torchtune's `recipes/lora_finetune_distributed.py` on a tiny
`lora_llama3` (LoRA on q/v, base frozen): meta init, `set_trainable_params`, `shard_model`,
`to_empty()` + `initialize_parameters()` on every LoRALinear (plain submodules of the sharded
layers), `rope_init`, `load_from_full_model_state_dict` of the base weights (in 0.6.1 torch's
`distribute_tensor(full, param.device_mesh, param.placements)` per parameter, then
`load_state_dict(assign=True)`), `validate_missing_and_unexpected_for_lora`,
`validate_no_params_on_meta_device`; then the adapters are loaded from a full state dict too
(the recipe's resume path), since each implementation's LoRA init draws its own random numbers
on sharded parameters. Then AdamW training, `gather_cpu_state_dict` (full and adapter-only),
`get_full_optimizer_state_dict` (torch's `get_optimizer_state_dict(full_state_dict=True)`) ->
`load_from_full_optimizer_state_dict` into a new optimizer (`distribute_tensor` per state), and
one more step with it.

`impl="veragged"`: `torchtune.training._distributed.fully_shard` (imported there from torch at
module level) is `veragged.fully_shard` for the run, and `veragged.route_torch_entry_points()` is
held (torchtune's loaders call torch's `distribute_tensor` / `set_*_state_dict`).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import traceback
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, SEQ = 512, 16
DIMS = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
            max_seq_len=64, intermediate_dim=128)
LORA = dict(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8.0)


def _reference() -> tuple[dict, dict]:
    """One process's base weights and nonzero adapters (same on every rank: seeded)."""
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_state_dict

    torch.manual_seed(0)
    ref = lora_llama3(**DIMS, **LORA)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.02)
    full = {k: v.clone() for k, v in ref.state_dict().items()}
    adapters = get_adapter_state_dict(full)
    base = {k: v for k, v in full.items() if k not in adapters}
    return base, adapters


def _loss(model, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def run(impl: str, steps: int = 3) -> dict:
    from torchtune import training
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import (
        LoRALinear,
        get_adapter_params,
        set_trainable_params,
        validate_missing_and_unexpected_for_lora,
    )

    rank = dist.get_rank()
    device = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        if impl == "veragged":
            import veragged
            from torchtune.training import _distributed

            stack.enter_context(mock.patch.object(_distributed, "fully_shard",
                                                  veragged.fully_shard))
            stack.enter_context(veragged.route_torch_entry_points())
        elif impl != "torch":
            raise ValueError(f"impl must be 'torch' or 'veragged', got {impl!r}")
        base_sd, adapter_sd = _reference()

        with torch.device("meta"):
            model = lora_llama3(**DIMS, **LORA)
        set_trainable_params(model, get_adapter_params(model))
        training.shard_model(model=model, shard_conditions=[training.get_shard_conditions],
                             cpu_offload=False, reshard_after_forward=True)
        torch.manual_seed(0)
        with device:
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    m.to_empty(device=device)
                    m.initialize_parameters()
                if hasattr(m, "rope_init"):
                    m.rope_init()
        base_missing, base_unexpected = training.load_from_full_model_state_dict(
            model, base_sd, device)
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=LORA["lora_attn_modules"], apply_lora_to_mlp=False,
            apply_lora_to_output=False, base_missing=base_missing,
            base_unexpected=base_unexpected, lora_missing=None, lora_unexpected=None)
        training.validate_no_params_on_meta_device(model)
        init = {}  # what initialize_parameters drew: lora_b zeros, lora_a kaiming-uniform
        for name, p in model.named_parameters():
            if "lora_" in name:
                full = p.detach().full_tensor()
                init[name] = (float(full.abs().max()), full.shape[-1])
        lora_missing, lora_unexpected = training.load_from_full_model_state_dict(
            model, adapter_sd, device)
        assert not lora_unexpected, lora_unexpected

        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(steps):
            loss = _loss(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().item())
        full_sd = training.gather_cpu_state_dict(model, rank == 0, device=device)
        adapters = training.gather_cpu_state_dict(model, rank == 0, device=device,
                                                  adapter_weights_only=True)
        osd = training.get_full_optimizer_state_dict(model, opt, rank == 0, device=device)
        held = [osd]  # the recipe saves it from rank 0 and every rank loads the file
        dist.broadcast_object_list(held, src=0)
        opt2 = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        training.load_from_full_optimizer_state_dict(model, opt2, held[0], device)
        loss = _loss(model, steps)
        loss.backward()
        opt2.step()
        losses.append(loss.detach().item())
        after = training.gather_cpu_state_dict(model, rank == 0, device=device,
                                               adapter_weights_only=True)
    return {"loss": losses, "init": init, "full": full_sd, "adapters": adapters,
            "optim": osd, "after": after}


def main(out: str) -> None:
    from tests.harness.pool import RankPool

    pool = RankPool(2, timeout_s=300)
    results = {}
    try:
        for impl in ("torch", "veragged"):
            try:
                results[impl] = pool.run(run, impl)
            except Exception:  # noqa: BLE001  (reported to the test, which fails on it)
                results[impl] = traceback.format_exc()
    finally:
        pool.shutdown()
    with open(out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
