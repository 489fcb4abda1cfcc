"""Parameter shapes of DeepSeek-V3-671B and GPT-OSS-120B, grouped as FSDP wraps them.

The shapes are derived from the public Hugging Face configs (the fields are
written out below under their config names) following the parameter
definitions of the Hugging Face `transformers` modules `modeling_deepseek_v3.py`
and `modeling_gpt_oss.py`; names are the checkpoint (state-dict) names.

Grouping follows the torchtitan style: every transformer block is wrapped by
its own `fully_shard`, and the root module keeps what is left (token
embedding, final norm and output head) as one more group.

Model notes:
  * DeepSeek-V3 keeps one module per expert, so every routed expert
    contributes three 2-D tensors.  The router's `e_score_correction_bias` is a
    parameter in DeepSeek's reference `inference/model.py` (a buffer in
    `transformers`); it is included.  The multi-token-prediction layer
    (`num_nextn_predict_layers` = 1) is not part of the main model and is left
    out, as `transformers` does.
  * GPT-OSS fuses the experts of a layer into single 3-D tensors
    ([experts, in, out]); attention projections carry biases
    (`attention_bias` = true) and every attention layer has a `sinks` vector.
"""

from dataclasses import dataclass
from math import prod

# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
DEEPSEEK_V3_671B = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

# https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json
GPT_OSS_120B = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "num_hidden_layers": 36,
    "intermediate_size": 2880,
    "num_local_experts": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Param:
    """One parameter tensor.

    `mlp` tags the weight matrices of feed-forward networks: "expert" for
    MoE experts (routed and shared), "dense" for the MLP of a dense layer, ""
    for everything else.  The benchmark gives these matrices row-block
    granularity; a row is `shape[-1]` elements, so for a fused [E, in, out]
    expert tensor a row is one row of one expert's matrix.
    """

    name: str
    shape: tuple
    mlp: str = ""

    @property
    def numel(self):
        return prod(self.shape)

    @property
    def row_numel(self):
        return self.shape[-1]


@dataclass(frozen=True)
class Group:
    """The parameters one `fully_shard` call flattens into one buffer."""

    name: str
    params: tuple

    @property
    def numel(self):
        return sum(p.numel for p in self.params)


def _linear(name, out_features, in_features, bias=False, mlp=""):
    params = [Param(f"{name}.weight", (out_features, in_features), mlp)]
    if bias:
        params.append(Param(f"{name}.bias", (out_features,)))
    return params


def _norm(name, size):
    return [Param(f"{name}.weight", (size,))]


def _swiglu_mlp(prefix, hidden, intermediate, mlp):
    return (
        _linear(f"{prefix}.gate_proj", intermediate, hidden, mlp=mlp)
        + _linear(f"{prefix}.up_proj", intermediate, hidden, mlp=mlp)
        + _linear(f"{prefix}.down_proj", hidden, intermediate, mlp=mlp)
    )


def _deepseek_attention(prefix, cfg):
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return (
        _linear(f"{prefix}.q_a_proj", cfg["q_lora_rank"], hidden)
        + _norm(f"{prefix}.q_a_layernorm", cfg["q_lora_rank"])
        + _linear(f"{prefix}.q_b_proj", heads * qk_head_dim, cfg["q_lora_rank"])
        + _linear(
            f"{prefix}.kv_a_proj_with_mqa", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], hidden
        )
        + _norm(f"{prefix}.kv_a_layernorm", cfg["kv_lora_rank"])
        + _linear(
            f"{prefix}.kv_b_proj",
            heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
            cfg["kv_lora_rank"],
        )
        + _linear(f"{prefix}.o_proj", hidden, heads * cfg["v_head_dim"])
    )


def _deepseek_moe(prefix, cfg):
    hidden, experts = cfg["hidden_size"], cfg["n_routed_experts"]
    params = []
    for e in range(experts):
        params += _swiglu_mlp(
            f"{prefix}.experts.{e}", hidden, cfg["moe_intermediate_size"], "expert"
        )
    params += [
        Param(f"{prefix}.gate.weight", (experts, hidden)),
        Param(f"{prefix}.gate.e_score_correction_bias", (experts,)),
    ]
    shared = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    return params + _swiglu_mlp(f"{prefix}.shared_experts", hidden, shared, "expert")


def _root_group(cfg):
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    assert not cfg["tie_word_embeddings"]
    params = (
        [Param("model.embed_tokens.weight", (vocab, hidden))]
        + _norm("model.norm", hidden)
        + _linear("lm_head", vocab, hidden)
    )
    return Group("root (embed, norm, lm_head)", tuple(params))


def deepseek_v3_groups(cfg=DEEPSEEK_V3_671B):
    """One group per decoder layer, then the root group."""
    assert not cfg["attention_bias"]
    groups = []
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        if i < cfg["first_k_dense_replace"]:
            mlp = _swiglu_mlp(
                f"{prefix}.mlp", cfg["hidden_size"], cfg["intermediate_size"], "dense"
            )
        else:
            mlp = _deepseek_moe(f"{prefix}.mlp", cfg)
        params = (
            _norm(f"{prefix}.input_layernorm", cfg["hidden_size"])
            + _deepseek_attention(f"{prefix}.self_attn", cfg)
            + _norm(f"{prefix}.post_attention_layernorm", cfg["hidden_size"])
            + mlp
        )
        groups.append(Group(prefix, tuple(params)))
    return groups + [_root_group(cfg)]


def _gpt_oss_layer(prefix, cfg):
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim
    bias = cfg["attention_bias"]
    experts, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    attn = f"{prefix}.self_attn"
    return (
        _norm(f"{prefix}.input_layernorm", hidden)
        + _linear(f"{attn}.q_proj", q_dim, hidden, bias)
        + _linear(f"{attn}.k_proj", kv_dim, hidden, bias)
        + _linear(f"{attn}.v_proj", kv_dim, hidden, bias)
        + _linear(f"{attn}.o_proj", hidden, q_dim, bias)
        + [Param(f"{attn}.sinks", (cfg["num_attention_heads"],))]
        + _norm(f"{prefix}.post_attention_layernorm", hidden)
        + _linear(f"{prefix}.mlp.router", experts, hidden, bias=True)
        + [
            Param(f"{prefix}.mlp.experts.gate_up_proj", (experts, hidden, 2 * inter), "expert"),
            Param(f"{prefix}.mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
            Param(f"{prefix}.mlp.experts.down_proj", (experts, inter, hidden), "expert"),
            Param(f"{prefix}.mlp.experts.down_proj_bias", (experts, hidden)),
        ]
    )


def gpt_oss_groups(cfg=GPT_OSS_120B):
    """One group per decoder layer, then the root group."""
    groups = [
        Group(f"model.layers.{i}", tuple(_gpt_oss_layer(f"model.layers.{i}", cfg)))
        for i in range(cfg["num_hidden_layers"])
    ]
    return groups + [_root_group(cfg)]


MODELS = {
    "DeepSeek-V3-671B": deepseek_v3_groups,
    "GPT-OSS-120B": gpt_oss_groups,
}
