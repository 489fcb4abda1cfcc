"""torch 2.15's `fully_shard` arguments for SPMD meshes on ours: `dp_mesh_dims` (parameters are
DTensors on the full mesh, Replicate on the data-parallel dims) and `shard_placement_fn`
returning `ShardPlacementResult` (a mesh per parameter, torchtitan's MoE layout), each against
torch's fully_shard in the same run ([Note: data-parallel meshes])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from veragged.testing.pool import get_pool

from tests.fsdp.test_lifecycle import IMPLS

fsdp = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
if not hasattr(fsdp, "ShardPlacementResult"):
    pytest.skip("torch < 2.15 has no dp_mesh_dims / ShardPlacementResult", allow_module_level=True)
from torch.distributed.fsdp import DataParallelMeshDims  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: E402
    FSDPMeshInfo, ShardPlacementResult,
)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 24), nn.Linear(24, 16), nn.Linear(16, 6)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.relu(x) if i < len(self.layers) - 1 else x
        return x


# Tensor-parallel placements on the "tp" dim: column-wise, row-wise, replicated.
_TP = {"layers.0.weight": Shard(0), "layers.0.bias": Shard(0),
       "layers.1.weight": Shard(1), "layers.1.bias": Replicate(),
       "layers.2.weight": Replicate(), "layers.2.bias": Replicate()}


def _full(p):
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _train_full_mesh(impl: str, tp: bool, steps: int = 4):
    world = dist.get_world_size()
    if tp:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = MLP()
    for name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False)):
            fqn = f"{name}.{pname}"
            placements = [Replicate()] + ([_TP[fqn]] if tp else [])
            setattr(mod, pname, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    dims = DataParallelMeshDims(shard="dp_shard")
    fs = IMPLS[impl]
    for layer in model.layers[:2]:
        fs(layer, mesh=mesh, dp_mesh_dims=dims)
    fs(model, mesh=mesh, dp_mesh_dims=dims)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world * 3, 16, generator=g)
        x = distribute_tensor(x, mesh, [Shard(0)] + ([Replicate()] if tp else []))
        loss = (model(x) ** 2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.full_tensor())
    unsharded = [type(p).__name__ for p in model.parameters()]
    return torch.stack(losses), {n: _full(p) for n, p in model.named_parameters()}, unsharded


@pytest.mark.parametrize("tp", [False, True], ids=["dp4", "dp2xtp2"])
def test_dp_mesh_dims_matches_torch(tp):
    ref = get_pool(4).run(_train_full_mesh, "torch", tp)
    res = get_pool(4).run(_train_full_mesh, "veragged", tp)
    for (rl, rp, ru), (l, p, u) in zip(ref, res):
        assert ru == ["DTensor"] * 6 and u == ["RaggedDTensor"] * 6
        if tp:  # dp 2: a sum of two is the same whichever rank adds it, so bitwise
            assert torch.equal(rl, l), (rl, l)
        for n in rp:
            if tp:
                assert torch.equal(rp[n], p[n]), n
            else:  # dp 4: gloo's reduce-scatter adds an element's four parts in an order that
                # depends on the rank that receives it, which differs between torch.chunk's
                # layout and ours: fp32 round-off
                torch.testing.assert_close(rp[n], p[n], rtol=1e-5, atol=1e-6, msg=n)


def _forward_sees_full_mesh_dtensors():
    """The unsharded parameters in forward are DTensors on the full mesh, Replicate on dp."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh,
                                                [Replicate(), Shard(0)]))
    lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [Replicate(), Shard(0)]))
    IMPLS["veragged"](lin, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(
        (m.weight.device_mesh is mesh, tuple(m.weight.placements), tuple(m.weight.shape))))
    lin(distribute_tensor(torch.randn(4, 8), mesh, [Shard(0), Replicate()]))
    sharded = lin.weight
    return seen, sharded.device_mesh.mesh_dim_names, tuple(sharded.shape)


def test_unsharded_parameters_on_the_full_mesh():
    for seen, names, shape in get_pool(4).run(_forward_sees_full_mesh_dtensors):
        assert seen == [(True, (Replicate(), Shard(0)), (4, 8))]
        assert names == ("dp_shard", "tp") and shape == (4, 8)


class TwoMeshModel(nn.Module):
    """A dense layer over every rank and an "expert" layer over a 2-rank expert-data mesh."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(12, 10)
        self.expert = nn.Linear(10, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.relu(self.expert(torch.relu(self.dense(x)))))


def _train_two_meshes(impl: str, steps: int = 4):
    world, rank = dist.get_world_size(), dist.get_rank()
    dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    dense_info = FSDPMeshInfo(dense_mesh, shard_mesh_dim=0)
    expert_info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    torch.manual_seed(0)
    model = TwoMeshModel()
    experts = set(model.expert.parameters())

    def place(p):
        if p in experts:
            return ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)
        return ShardPlacementResult(placement=None, mesh_info=dense_info)

    fs = IMPLS[impl]
    fs(model, mesh=dense_mesh, shard_placement_fn=place)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = (model(torch.randn(5, 12, generator=g)) ** 2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    meshes = {n: p.device_mesh.size() for n, p in model.named_parameters()}
    return torch.stack(losses), {n: _full(p) for n, p in model.named_parameters()}, meshes


def test_shard_placement_result_meshes_per_parameter():
    ref = get_pool(4).run(_train_two_meshes, "torch")
    res = get_pool(4).run(_train_two_meshes, "veragged")
    for (rl, rp, rm), (l, p, m) in zip(ref, res):
        assert rm == m == {"dense.weight": 4, "dense.bias": 4, "expert.weight": 2,
                           "expert.bias": 2, "head.weight": 4, "head.bias": 4}
        # The dense layers reduce over 4 ranks: fp32 round-off, as in test_dp_mesh_dims_matches_torch.
        torch.testing.assert_close(rl, l, rtol=1e-5, atol=1e-7)
        for n in rp:
            torch.testing.assert_close(rp[n], p[n], rtol=1e-5, atol=1e-6, msg=n)


def _errors():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out = []

    def catch(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
        else:
            out.append(None)

    def lin(placements=(Replicate(), Replicate())):
        m = nn.Linear(4, 4)
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, list(placements)))
        m.bias = nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Replicate(), Replicate()]))
        return m

    fs = IMPLS["veragged"]
    catch(lambda: fs(lin(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")))
    catch(lambda: fs(lin(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp_shard")))
    catch(lambda: fs(lin((Shard(0), Replicate())), mesh=mesh,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    catch(lambda: fs(lin(), mesh=mesh, reshard_after_forward=2,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    catch(lambda: fs(nn.Linear(4, 4), mesh=mesh,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    catch(lambda: fs(nn.Linear(4, 4), mesh=mesh["dp_shard"], shard_placement_fn=lambda p: 3))
    return out


def test_bad_input_raises_naming_it():
    out = get_pool(4).run(_errors)[0]
    assert out[0][0] == "ValueError" and "'dp' not found" in out[0][1]
    assert out[1][0] == "NotImplementedError" and "DDP" in out[1][1]
    assert out[2][0] == "ValueError" and "Expected Replicate() on DP shard dim" in out[2][1]
    assert out[3][0] == "NotImplementedError" and "dp_mesh_dims" in out[3][1]
    assert out[4][0] == "ValueError" and "'weight'" in out[4][1]
    assert out[5][0] == "ValueError" and "got 3" in out[5][1]
