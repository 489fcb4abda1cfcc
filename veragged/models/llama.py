"""A small Llama-style decoder (RMSNorm, RoPE, SwiGLU, fused QKV) for tests and examples."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Llama", "LlamaConfig", "muon_param_groups", "parallelize", "tp_plan"]


@dataclass
class LlamaConfig:
    vocab: int = 96
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 172  # SwiGLU width: not a multiple of the world size on purpose
    max_seq: int = 64
    tie_embeddings: bool = False
    # Separate q/k/v and gate/up projections (heads inferred from the local width), so that
    # tensor parallelism can split them by heads and columns: see `tp_plan`.
    fused: bool = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on [batch, heads, seq, head_dim] (pairs of halves)."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.fused = cfg.fused
        self.attn_norm = RMSNorm(cfg.dim)
        if cfg.fused:
            self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)  # fused QKV
        else:
            self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        if cfg.fused:  # fused SwiGLU gate and up
            self.gate_up = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)
        else:
            self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
            self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=True)

    def _qkv(self, h):
        b, s, _ = h.shape
        if self.fused:
            return (
                self.qkv(h).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            )
        # -1 heads: a tensor-parallel rank holds some of them
        return [m(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                for m in (self.q, self.k, self.v)]

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self._qkv(self.attn_norm(x))
        pos = torch.arange(s, device=x.device)
        q, k = rope(q, pos), rope(k, pos)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        if self.fused:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
        else:
            gate, up = self.gate(h), self.up(h)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # small, so tied output logits start small
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight as the constructor does, drawing the same random numbers in
        the same order, so a model built on the meta device (then `to_empty`) and initialised
        here under the same seed equals one built directly (also when sharded)."""
        for m in self.modules():
            if m is self.head and self.cfg.tie_embeddings:
                # the untied head drew its own weight before the constructor tied it
                nn.init.kaiming_uniform_(torch.empty(self.head.weight.shape), a=math.sqrt(5))
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                m.reset_parameters()
                if m is self.embed:
                    nn.init.normal_(self.embed.weight, std=0.02)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )


def tp_plan() -> dict:
    """`parallelize_module` plan for each block of a `fused=False` Llama (Megatron style): q, k,
    v, gate and up column-parallel (by heads and hidden columns), out and down row-parallel, the
    norms replicated; embedding and head stay data-parallel only."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {name: ColwiseParallel() for name in ("q", "k", "v", "gate", "up")}
    plan.update(out=RowwiseParallel(), down=RowwiseParallel())
    return plan


def parallelize(model: "Llama", tp_mesh) -> "Llama":
    """Apply `tp_plan` to every block of `model` (built with `fused=False`) on `tp_mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    if model.cfg.fused:
        raise ValueError("tensor parallelism needs LlamaConfig(fused=False): a fused QKV or "
                         "gate/up projection cut by columns would mix q, k and v heads")
    if model.cfg.heads % tp_mesh.size() or model.cfg.hidden % tp_mesh.size():
        raise ValueError(
            f"heads ({model.cfg.heads}) and hidden ({model.cfg.hidden}) must be divisible by the "
            f"tensor-parallel size {tp_mesh.size()}"
        )
    for block in model.blocks:
        parallelize_module(block, tp_mesh, tp_plan())
    return model


def muon_param_groups(model: nn.Module, adamw_lr: float | None = None) -> list[dict]:
    """Param groups for veragged.optim.Muon: the embedding and the output head on AdamW (with
    `adamw_lr` if given), every other parameter by shape (matrices Muon, vectors AdamW)."""
    named = dict(model.named_parameters())
    emb = [p for n, p in named.items() if "embed" in n or "head" in n]
    rest = [p for p in named.values() if all(p is not q for q in emb)]
    adamw = {"params": emb, "use_muon": False}
    if adamw_lr is not None:
        adamw["lr"] = adamw_lr
    return [adamw, {"params": rest}]
