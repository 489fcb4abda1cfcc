"""`fully_shard` with expert parallelism (torchtitan's dp_shard_in_ep layout): the fused experts
of veragged.models.moe sharded `Shard(0)` over the ep mesh dim, FSDP over the rest, tokens routed
by all-to-all. veragged against torch's FSDP2 in the same layout and against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from tests.fsdp._reference import full as _full
from tests.fsdp._reference import one_process
from tests.fsdp._reference import optimizer as _optimizer
from tests.fsdp.test_lifecycle import IMPLS, TORCH_HAS_UNUSED_PARAMS_MODE, _same
from veragged.placement import StridedRaggedShard
from tests.harness.device import rank_device_type
from veragged.models.moe import MoE, MoEConfig, expert_parallel
from tests.harness.pool import get_pool

CFG = MoEConfig(experts=4, top_k=2)


def _tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, CFG.vocab, (2, 13), generator=g)


def _shard_moe(impl, cfg, ep, chunk_experts=False, unused_params=False):
    """`cfg`'s MoE under `impl`'s fully_shard in torchtitan's dp_shard_in_ep layout."""
    world = dist.get_world_size()
    mesh = init_device_mesh(rank_device_type(), (world // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    dp = mesh._flatten("dp")
    torch.manual_seed(0)
    model = MoE(cfg)
    expert_parallel(model, mesh["ep"])
    fs = IMPLS[impl]
    for block in model.blocks:
        experts = block.moe.experts
        # torchtitan chunks the experts' dim 1 over dp when they are fewer than the dp ranks.
        fs(experts, mesh=mesh["dp_mod_ep"],
           shard_placement_fn=(lambda p: Shard(1)) if chunk_experts else None)
        # The all-to-all's backward already summed the ep ranks' contributions: divide the
        # reduced expert gradients by every data-parallel rank, as torchtitan does.
        experts.set_gradient_divide_factor(world)
        if ep < world:  # torch: gloo has no PREMUL_SUM. Not on one rank, where torch 2.15
            # divides twice with it (its world-size-1 copy divides, then the post-divide).
            experts.set_force_sum_reduction_for_comms(True)
        if unused_params:  # torch's FSDP2 needs it when ranks reach different experts
            experts.set_reduce_scatter_unused_params(True)
        fs(block, mesh=dp)
    fs(model, mesh=dp)
    return model


def _train_moe(impl, ep, steps, opt="adamw", chunk_experts=False):
    model = _shard_moe(impl, CFG, ep, chunk_experts)
    optim = _optimizer(model, opt)
    losses = []
    for step in range(steps):
        loss = model.loss(_tokens(step, dist.get_rank()))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    return losses, {n: _full(p) for n, p in model.named_parameters()}, placements


def _one_process(world, steps):
    return one_process(lambda: MoE(CFG), lambda step: [_tokens(step, r) for r in range(world)],
                       steps)


@pytest.mark.parametrize("ep", [2, 4])
def test_moe_ep_matches_torch_and_one_process(ep):
    world, steps = 4, 10
    ref = get_pool(world).run(_train_moe, "torch", ep, steps, "sgd")
    res = get_pool(world).run(_train_moe, "veragged", ep, steps, "sgd")
    single_losses, single_params = _one_process(world, steps)
    mean = torch.stack([torch.stack(l) for l, _, _ in res]).mean(0)
    torch.testing.assert_close(mean, torch.stack(single_losses), atol=1e-5, rtol=1e-5)
    for (l_t, p_t, _), (l_v, p_v, pl_v) in zip(ref, res):
        # The dense parameters are reduced over 4 ranks, where gloo's summation order follows an
        # element's place in the buffer, which the planned layout moves: fp32 round-off, carried
        # into the experts' inputs from the second step (2 ranks, as in test_tp, give the bits).
        torch.testing.assert_close(torch.stack(l_t), torch.stack(l_v), atol=1e-5, rtol=1e-6)
        _same(p_t, p_v, atol=1e-6)
        _same(single_params, p_v, atol=1e-5)
        w1 = pl_v["blocks.0.moe.experts.w1"]
        assert w1[-1] == Shard(0) and len(w1) == 2
        if ep < world:  # FSDP over dp_mod_ep after the ep Shard(0): strided
            assert isinstance(w1[0], StridedRaggedShard) and w1[0].split_factor == ep
        assert len(pl_v["blocks.0.q.weight"]) == 1  # the flattened dp mesh


def test_moe_ep_experts_chunked_on_dim1_as_torchtitan():
    """`shard_placement_fn` -> Shard(1) on the ep-sharded experts: torch's layout, plain
    (Shard(1), Shard(0)) DTensors on the (dp_mod_ep, ep) mesh, torch's numbers."""
    ref = get_pool(4).run(_train_moe, "torch", 2, 3, "sgd", True)
    res = get_pool(4).run(_train_moe, "veragged", 2, 3, "sgd", True)
    for (l_t, p_t, pl_t), (l_v, p_v, pl_v) in zip(ref, res):
        torch.testing.assert_close(torch.stack(l_t), torch.stack(l_v), atol=1e-5, rtol=1e-6)
        _same(p_t, p_v, atol=1e-6)
        assert pl_v["blocks.0.moe.experts.w1"] == (Shard(1), Shard(0))
        assert pl_t["blocks.0.moe.experts.w1"] == pl_v["blocks.0.moe.experts.w1"]


# --- one module per expert, experts without tokens -----------------------------------------------

SPARSE = MoEConfig(experts=8, top_k=1, fused_experts=False)  # few tokens: many experts get none


def _sparse_tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + 1000 * step + rank)
    return torch.randint(0, SPARSE.vocab, (1, 6), generator=g)


def _train_sparse(impl, steps):
    model = _shard_moe(impl, SPARSE, 2, unused_params=True)
    optim = _optimizer(model, "sgd")
    losses, nones = [], []
    for step in range(steps):
        loss = model.loss(_sparse_tokens(step, dist.get_rank()))
        loss.backward()
        nones.append({n: p.grad is None for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, {n: _full(p) for n, p in model.named_parameters()}, nones


@pytest.mark.skipif(not TORCH_HAS_UNUSED_PARAMS_MODE,
                    reason="this torch's FSDP2 has no set_reduce_scatter_unused_params (2.11)")
def test_per_expert_modules_with_unused_params_reduced_match_torch():
    """Experts without tokens on some ranks (or all): in the unused-params mode every rank gets
    every expert's gradient, zeros where no rank reached it, as torch's FSDP2 gives."""
    ref = get_pool(4).run(_train_sparse, "torch", 3)
    res = get_pool(4).run(_train_sparse, "veragged", 3)
    for (l_t, p_t, n_t), (l_v, p_v, n_v) in zip(ref, res):
        torch.testing.assert_close(torch.stack(l_t), torch.stack(l_v), atol=1e-5, rtol=1e-6)
        _same(p_t, p_v, atol=1e-6)
        assert n_t == n_v
