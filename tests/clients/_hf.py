"""HF transformers (+ PEFT) under FSDP2 on CPU gloo ranks: the jobs of test_transformers.py.

What a user of transformers writes to shard a model, with `fully_shard` either torch's or
veragged's and nothing else changed:

1. build the model on the meta device from its config (`from_config`), optionally wrap it in
   PEFT LoRA (`get_peft_model`, base weights frozen);
2. `fully_shard` every decoder layer, then the root;
3. `model.to_empty(device="cpu")` and `model.init_weights()` (transformers' own initialisers
   on the sharded parameters);
4. load a full (unsharded) state dict with torch's
   `set_model_state_dict(model, sd, StateDictOptions(full_state_dict=True))`;
5. train a few AdamW steps (each rank its own batch), then read the full state dict back with
   `get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`.

The full state dict of step 4 is one process's model built from the same seed, so both
implementations start from the same weights whatever their own initialisation drew.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness.device import rank_device_type

CASES = ("llama_lora", "qwen3_moe")
VOCAB, SEQ, BATCH = 512, 16, 2


def _config(case: str):
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    if case == "llama_lora":
        return LlamaConfig(**common)
    if case == "qwen3_moe":  # experts as 3-D gate_up_proj/down_proj parameters, top-2 of 4
        return Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=4,
                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    if case == "mixtral":  # experts as 3-D gate_up_proj/down_proj parameters, top-2 of 4
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"case must be one of {CASES} or mixtral, got {case!r}")


def _build(case: str, device: str):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(case))
    if case == "llama_lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
    return model


def _layers(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def run(impl: str, case: str, steps: int = 4) -> dict:
    """One case under `impl`'s fully_shard; per-rank losses and the final full state dict.

    veragged's run holds `veragged.route_torch_entry_points()`, the one line its users add.
    """
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    elif impl == "veragged":
        import veragged

        with veragged.route_torch_entry_points():  # torch's set_model_state_dict on RaggedShard
            return _run(veragged.fully_shard, case, steps)
    else:
        raise ValueError(f"impl must be 'torch' or 'veragged', got {impl!r}")
    return _run(fully_shard, case, steps)


def _run(fully_shard, case: str, steps: int) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _build(case, "cpu")  # one process's model: the weights both runs load
    with torch.no_grad():  # LoRA B starts at zero; nonzero makes the adapters matter at once
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    full_sd = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference

    mesh = init_device_mesh(rank_device_type(), (world,))
    torch.manual_seed(1 + rank)  # whatever init_weights draws is overwritten below
    model = _build(case, "meta")
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
    out = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    return {"loss": losses, "state": out if rank == 0 else None}


def run_muon(case: str = "qwen3_moe", steps: int = 3) -> dict:
    """veragged.fully_shard + veragged.optim.Muon on the model's own parameters, experts kept
    whole on a rank (3-D `gate_up_proj` [E, 2 inter, hidden] and `down_proj` stacks: each expert
    a matrix, gate and up orthogonalised apart) with the locality-aware plan; after every step
    the parameters equal one process's Muon stepping on the gradients the sharded run made."""
    import veragged
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(case)
    inter = getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
    torch.manual_seed(0)
    reference = _build(case, "cpu")
    full_sd = {k: v.clone() for k, v in reference.state_dict().items()}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(rank_device_type(), (world,))
    model = _build(case, "cpu")
    model.load_state_dict(full_sd)

    def whole_experts(fqn, p):
        return p[0].numel() if p.ndim == 3 else None

    for layer in _layers(model):
        veragged.fully_shard(layer, mesh=mesh, granularity_fn=whole_experts)
    veragged.fully_shard(model, mesh=mesh, granularity_fn=whole_experts)

    def groups(m, **kw):
        named = dict(m.named_parameters())
        flat = [p for n, p in named.items() if "embed" in n or "lm_head" in n]
        gate_up = [p for n, p in named.items() if n.endswith("gate_up_proj")]
        rest = [p for p in named.values()
                if not any(p is q for q in flat) and not any(p is q for q in gate_up)]
        return veragged.optim.Muon([{"params": flat, "use_muon": False},
                                    {"params": gate_up, "split_sizes": (inter, inter)},
                                    {"params": rest}], lr=0.02, **kw)

    opt, ref = groups(model, owners="local"), groups(reference)
    gen = torch.Generator().manual_seed(100 + rank)
    equal = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = None if p.grad is None else (
                p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())
        opt.step()
        ref.step()
        opt.zero_grad()
        equal.append(all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, q)
                         for p, q in zip(model.parameters(), reference.parameters())))
    experts = [m for m in opt.matrices() if m.index is not None]
    at_home = sum(m.layout.size(m.owner) == m.layout.numel for m in experts)
    return {"equal": equal, "experts": len(experts), "at_home": at_home}
