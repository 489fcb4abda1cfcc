"""A small mixture-of-experts decoder with expert parallelism, for tests and the example.

Each block: RMSNorm, causal attention (q, k, v, o), RMSNorm, and a top-k routed MoE whose
experts are fused tensors `w1, w3: [E, dim, hidden]`, `w2: [E, hidden, dim]` (SwiGLU), as
torchtitan's GroupedExperts. `expert_parallel(model, ep_mesh)` shards them `Shard(0)` over
`ep_mesh` (E / ep experts per rank) and routes tokens to the rank holding their expert by an
all-to-all and back (`all_to_all_single_autograd`, so gradients flow back the same way). FSDP
then shards each expert rank's local experts over the remaining data-parallel ranks
(torchtitan's `dp_shard_in_ep` layout):

    mesh = init_device_mesh("cpu", (dp_mod_ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    expert_parallel(model, mesh["ep"])
    for block in model.blocks:
        fully_shard(block.moe.experts, mesh=mesh["dp_mod_ep"])
        block.moe.experts.set_gradient_divide_factor(world)  # the all-to-all summed ep ranks
        fully_shard(block, mesh=mesh._flatten("dp"))
    fully_shard(model, mesh=mesh._flatten("dp"))

An expert that no token reached on a rank still takes part in the computation with zero rows,
so its gradient is zeros there, the same kind of value on every rank. With one module per expert
(`MoEConfig(fused_experts=False)`) each expert-parallel rank holds its own experts' modules and
skips an expert without tokens, so its gradient is None on that rank; with
`set_reduce_scatter_unused_params(True)` on the experts' module (as torch's FSDP2 needs when
ranks reach different parameters) every rank then gets the expert's gradient, zeros where no
rank reached it ([Note: unreached parameters]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from veragged.models.llama import RMSNorm, rope

__all__ = ["MoE", "MoEConfig", "expert_parallel"]


@dataclass
class MoEConfig:
    vocab: int = 96
    dim: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 4
    top_k: int = 2
    hidden: int = 48  # per expert
    # False: one module per expert (an `ExpertList`); under EP each rank keeps its own experts,
    # and an expert no token reached is left out of the computation (its gradient is None).
    fused_experts: bool = True


class Experts(nn.Module):
    """E SwiGLU experts as fused `[E, ...]` weights; `forward(x, counts)` runs expert e on the
    `counts[e]` rows of `x` that follow those of experts < e (the local experts, under EP)."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.uniform_(w, -1 / math.sqrt(w.shape[1]), 1 / math.sqrt(w.shape[1]))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        outs = [
            (F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]  # zero rows still reach every weight
            for e, xe in enumerate(x.split(counts))
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ExpertList(nn.Module):
    """One module per expert, as `Experts` runs them, except that an expert without rows is not
    run at all: its parameters get no gradient from this rank."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.dim = dim

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # An expert without rows contributes an empty output that still hangs off `x`, so the
        # backward reaches this module (and the token all-to-all) on every rank, whatever the
        # routing: collectives stay in the same order everywhere.
        outs = [e(xe) if xe.shape[0] else (xe[:, :1] * 0).expand(-1, self.dim)
                for e, xe in zip(self.experts, x.split(counts))]
        return torch.cat(outs)


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.num_experts = cfg.experts
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        kind = Experts if cfg.fused_experts else ExpertList
        self.experts = kind(cfg.experts, cfg.dim, cfg.hidden)
        self.ep_group: dist.ProcessGroup | None = None  # set by `expert_parallel`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = F.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # token copies grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = order // self.top_k
        ys = self._dispatch(x[rows], counts)
        ys = ys * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, rows, ys).reshape(shape)

    def _dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.experts(xs, counts.tolist())
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group, ep = self.ep_group, dist.get_world_size(self.ep_group)
        local = self.num_experts // ep
        # How many rows each rank sends this rank for each of its local experts: [ep, local].
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)
        recv = recv.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        got = all_to_all_single_autograd(xs, recv_splits, send_splits, group)
        # Received rows are grouped by source rank, then expert: regroup them by expert.
        sizes = recv.reshape(-1)
        starts = (torch.cumsum(sizes, 0) - sizes).tolist()
        chunks = torch.arange(ep * local).view(ep, local).t().reshape(-1).tolist()
        perm = torch.cat([torch.arange(starts[i], starts[i] + int(sizes[i])) for i in chunks])
        ys = self.experts(got[perm], recv.sum(0).tolist())
        back = torch.empty_like(ys).index_copy(0, perm, ys)  # (source, expert) order again
        return all_to_all_single_autograd(back, send_splits, recv_splits, group)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.moe_norm = RMSNorm(cfg.dim)
        self.moe = MoELayer(cfg)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        pos = torch.arange(s, device=x.device)
        att = F.scaled_dot_product_attention(rope(q, pos), rope(k, pos), v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.moe(self.moe_norm(x))


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight as the constructor does, drawing the same random numbers in
        the same order (modules are visited in the order the constructor made them), for a
        model built on the meta device and then `to_empty`."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, Experts)):  # an Expert's Linears are visited in turn
                m.reset_parameters()
            elif isinstance(m, nn.Embedding):
                m.reset_parameters()
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))


def expert_parallel(model: MoE, ep_mesh) -> MoE:
    """Shard every block's experts `Shard(0)` over `ep_mesh` (from rank 0's values, as
    `parallelize_module` does) and route tokens to them by all-to-all. With per-expert modules
    (`fused_experts=False`) each rank keeps the modules of its own experts (E / ep consecutive
    ones, plain parameters) and drops the others."""
    ep = ep_mesh.size()
    if model.cfg.experts % ep:
        raise ValueError(f"experts ({model.cfg.experts}) must be divisible by the expert-parallel "
                         f"size {ep}")
    for block in model.blocks:
        experts = block.moe.experts
        block.moe.ep_group = ep_mesh.get_group()
        if isinstance(experts, ExpertList):
            local = model.cfg.experts // ep
            mine = ep_mesh.get_local_rank() * local
            experts.experts = nn.ModuleList(list(experts.experts)[mine : mine + local])
            continue
        for name, p in list(experts.named_parameters(recurse=False)):
            dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
    return model
