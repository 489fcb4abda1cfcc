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

from tests.fsdp.test_lifecycle import IMPLS
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

fsdp = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
if not hasattr(fsdp, "ShardPlacementResult"):
    pytest.skip("torch < 2.15 has no dp_mesh_dims / ShardPlacementResult", allow_module_level=True)
from torch.distributed.fsdp import (  # noqa: E402
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: E402
    FSDPMeshInfo,
    ShardPlacementResult,
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
        mesh = init_device_mesh(rank_device_type(), (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    else:
        mesh = init_device_mesh(rank_device_type(), (world,), mesh_dim_names=("dp_shard",))
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
    mesh = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("dp_shard", "tp"))
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
    dense_mesh = init_device_mesh(rank_device_type(), (world,), mesh_dim_names=("dp",))
    sparse = init_device_mesh(rank_device_type(), (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
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
    mesh = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("dp_shard", "tp"))
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
    catch(lambda: fs(lin((Shard(0), Replicate())), mesh=mesh,
                     dp_mesh_dims=DataParallelMeshDims(replicate="dp_shard")))
    catch(lambda: fs(lin((Shard(0), Replicate())), mesh=mesh,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    catch(lambda: fs(lin(), mesh=mesh, reshard_after_forward=2,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    catch(lambda: fs(nn.Linear(4, 4), mesh=mesh,
                     dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")))
    catch(lambda: fs(nn.Linear(4, 4), mesh=mesh["dp_shard"], shard_placement_fn=lambda p: 3))
    catch(lambda: fs(lin(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp_shard"),
                     granularity_fn=lambda fqn, p: 4))
    return out


def test_bad_input_raises_naming_it():
    out = get_pool(4).run(_errors)[0]
    assert out[0][0] == "ValueError" and "'dp' not found" in out[0][1]
    assert out[1][0] == "ValueError" and "Expected Replicate() on DP replicate dim" in out[1][1]
    assert out[2][0] == "ValueError" and "Expected Replicate() on DP shard dim" in out[2][1]
    assert out[3][0] == "NotImplementedError" and "dp_mesh_dims" in out[3][1]
    assert out[4][0] == "ValueError" and "'weight'" in out[4][1]
    assert out[5][0] == "ValueError" and "got 3" in out[5][1]
    assert out[6][0] == "ValueError" and "granularity_fn" in out[6][1] and "DDP" in out[6][1]


# --- torch's DDP mode: dp_mesh_dims naming no shard dim ([Note: replicated DBuffers]) ---------

_DDP = DataParallelMeshDims(replicate="ddp")


def _ddp_model(impl: str, tp: bool, seed: int = 0, mesh=None, **kwargs):
    """MLP on the ("ddp",) mesh, or ("ddp", "tp") with _TP's placements; DDP mode per layer.
    A second model takes the first one's `mesh`: DTensor's sharding cache hands an equal mesh's
    parameters the first mesh object, which fully_shard (torch's too) refuses."""
    world = dist.get_world_size()
    if mesh is not None:
        pass
    elif tp:
        mesh = init_device_mesh(rank_device_type(), (world // 2, 2), mesh_dim_names=("ddp", "tp"))
    else:
        mesh = init_device_mesh(rank_device_type(), (world,), mesh_dim_names=("ddp",))
    torch.manual_seed(seed)
    model = MLP()
    for name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False)):
            placements = [Replicate()] + ([_TP[f"{name}.{pname}"]] if tp else [])
            setattr(mod, pname, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    fs = IMPLS[impl]
    for layer in model.layers[:2]:
        fs(layer, mesh=mesh, dp_mesh_dims=_DDP, **kwargs)
    fs(model, mesh=mesh, dp_mesh_dims=_DDP, **kwargs)
    return model, mesh


def _ddp_steps(model, optim, mesh, steps: range, clip=None):
    """Each dp rank its own batch, given as Replicate on every dim (torch's DDP-mode test);
    the gradients clipped by `clip` (torch's clip_grad_norm_ by default). Returns the losses,
    the total norms and the last step's reduced gradients (full tensors)."""
    clip = clip or torch.nn.utils.clip_grad_norm_
    rank = mesh.get_coordinate()[0]
    losses, norms = [], []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x = DTensor.from_local(torch.randn(3, 16, generator=g), mesh,
                               [Replicate()] * mesh.ndim, run_check=False)
        loss = (model(x) ** 2).mean()
        loss.backward()
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        norm = clip(model.parameters(), max_norm=0.5)
        norms.append(_full(norm))
        optim.step()
        optim.zero_grad()
        losses.append(loss.to_local().detach())
    return torch.stack(losses), torch.stack(norms), grads


def _train_ddp(impl: str, tp: bool, steps: int = 4):
    model, mesh = _ddp_model(impl, tp)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, grads = _ddp_steps(model, optim, mesh, range(steps))
    layout = {n: (type(p).__name__, p.device_mesh == mesh, tuple(p.placements),
                  tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    return losses, norms, grads, {n: _full(p) for n, p in model.named_parameters()}, layout


@pytest.mark.parametrize("world,tp", [(2, False), (4, True)], ids=["ddp2", "ddp2xtp2"])
def test_ddp_mode_matches_torch(world, tp):
    """DDP mode (replicate only) trains bitwise as torch's: the sharded parameters are torch's
    DTensors (Replicate on ddp, the TP placements kept, the TP block as local tensor), the
    gradients are averaged over the 2 ddp ranks (a sum of two is the same whichever rank adds
    it, and x / 2 is exactly x * 0.5, which our gradients land with), and torch's
    clip_grad_norm_ gives the same norms."""
    ref = get_pool(world).run(_train_ddp, "torch", tp, timeout=180)
    res = get_pool(world).run(_train_ddp, "veragged", tp, timeout=180)
    for (rl, rn, rg, rp, ru), (l, n, g, p, u) in zip(ref, res):
        assert u == ru, (u, ru)
        assert all(t == "DTensor" and same for t, same, _, _ in u.values())
        assert all(pl[0] == Replicate() for _, _, pl, _ in u.values())
        assert torch.equal(rl, l), (rl, l)
        assert torch.equal(rn, n), (rn, n)
        for name in rp:
            assert torch.equal(rg[name], g[name]), name
            assert torch.equal(rp[name], p[name]), name
    assert not torch.equal(res[0][0], res[-1][0])  # the dp ranks saw different data


def _ddp_checkpoint(save_impl: str, load_impl: str, path: str):
    """Train `save_impl` 2 steps, save model and optimizer with DCP, train on; load the
    checkpoint into a differently initialised `load_impl` model and train the same steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from veragged.fsdp.clip import clip_grad_norm_

    model, mesh = _ddp_model(save_impl, tp=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _ddp_steps(model, optim, mesh, range(2))
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = {n: _full(p) for n, p in model.named_parameters()}
    on = _ddp_steps(model, optim, mesh, range(2, 4), clip=clip_grad_norm_)

    other, _ = _ddp_model(load_impl, tp=True, seed=1, mesh=mesh)
    other_optim = torch.optim.AdamW(other.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(other, other_optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(other, other_optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    loaded = {n: _full(p) for n, p in other.named_parameters()}
    again = _ddp_steps(other, other_optim, mesh, range(2, 4), clip=clip_grad_norm_)
    return saved, loaded, on[:2], again[:2]


@pytest.mark.parametrize("save_impl,load_impl", [("veragged", "veragged"), ("veragged", "torch"),
                                                 ("torch", "veragged")])
def test_ddp_mode_dcp_round_trip(tmp_path, save_impl, load_impl):
    """A DDP-mode checkpoint (model and AdamW state, 2x2 ddp x tp) loads into either
    implementation, and training goes on bitwise as without the round trip (veragged's
    clip_grad_norm_ after it)."""
    path = str(tmp_path / "ckpt")
    for saved, loaded, on, again in get_pool(4).run(_ddp_checkpoint, save_impl, load_impl, path,
                                                    timeout=240):
        for n in saved:
            assert torch.equal(saved[n], loaded[n]), n
        for a, b in zip(on, again):
            assert torch.equal(a, b), (a, b)


def _ddp_accumulate(impl: str, mode: str, steps: int = 2, micro: int = 3):
    """DDP mode with gradient accumulation over `micro` micro-batches: without gradient sync
    (`set_requires_gradient_sync`) or without the all-reduce (`set_requires_all_reduce`) on all
    but the last one."""
    model, mesh = _ddp_model(impl, tp=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = mesh.get_coordinate()[0]
    grads = []
    for step in range(steps):
        for i in range(micro):
            last = i == micro - 1
            if mode == "sync":
                model.set_requires_gradient_sync(last)
            else:
                model.set_requires_all_reduce(last)
            g = torch.Generator().manual_seed(100 * step + 10 * i + rank)
            x = DTensor.from_local(torch.randn(3, 16, generator=g), mesh, [Replicate()],
                                   run_check=False)
            (model(x) ** 2).mean().backward()
        # copies: a Replicate full_tensor() is the local tensor, and ours is a view of the
        # DBuffer's shard gradient, which the next step's reduction writes again
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    return grads, {n: _full(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["sync", "all_reduce"])
def test_ddp_mode_gradient_accumulation_matches_torch(mode):
    """Micro-batches without gradient sync (or without the all-reduce, whose sums torch keeps
    aside) accumulate to torch's bits: 2 ranks, the halving exact."""
    ref = get_pool(2).run(_ddp_accumulate, "torch", mode, timeout=120)
    res = get_pool(2).run(_ddp_accumulate, "veragged", mode, timeout=120)
    for (rg, rp), (g, p) in zip(ref, res):
        for a, b in zip(rg, g):
            for name in a:
                assert torch.equal(a[name], b[name]), name
        for name in rp:
            assert torch.equal(rp[name], p[name]), name


def _train_ddp_two_dims(impl: str, steps: int = 3):
    """DDP mode over two replicate dims of a 2x2 mesh (flattened into one, as torch)."""
    mesh = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)
    model = MLP()
    for mod in model.layers:
        for pname, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, pname, nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                               [Replicate(), Replicate()])))
    IMPLS[impl](model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate=("a", "b")))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = DTensor.from_local(torch.randn(3, 16, generator=g), mesh, [Replicate()] * 2,
                               run_check=False)
        loss = (model(x) ** 2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.to_local().detach())
    layout = {n: (p.device_mesh is mesh, tuple(p.placements)) for n, p in model.named_parameters()}
    return torch.stack(losses), {n: _full(p) for n, p in model.named_parameters()}, layout


def test_ddp_mode_over_two_replicate_dims():
    """replicate=("a", "b"): the parameters stay on the caller's 2-D mesh (Replicate on both
    dims, as torch's); the gradients are averaged over all 4 ranks in one all-reduce. Not
    bitwise: gloo's all-reduce chunks our buffer (its verdict flags and alignment included)
    otherwise than torch's, and a sum of four depends on the order: fp32 round-off."""
    ref = get_pool(4).run(_train_ddp_two_dims, "torch", timeout=120)
    res = get_pool(4).run(_train_ddp_two_dims, "veragged", timeout=120)
    for (rl, rp, ru), (l, p, u) in zip(ref, res):
        assert u == ru == {n: (True, (Replicate(), Replicate())) for n in rp}
        torch.testing.assert_close(rl, l, rtol=1e-5, atol=1e-7)
        for n in rp:
            torch.testing.assert_close(rp[n], p[n], rtol=1e-5, atol=1e-6, msg=n)


_POLICIES = {
    "bf16": dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32)),
    "offload": dict(offload_policy=CPUOffloadPolicy(pin_memory=False)),
}


def _train_ddp_policy(impl: str, policy: str, steps: int = 3):
    model, mesh = _ddp_model(impl, tp=False, **_POLICIES[policy])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, _ = _ddp_steps(model, optim, mesh, range(steps))
    return losses, norms, {n: _full(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", sorted(_POLICIES))
def test_ddp_mode_policies_match_torch(policy):
    """DDP mode with bf16 parameters reduced in fp32, or with CPU offload: torch's bits."""
    ref = get_pool(2).run(_train_ddp_policy, "torch", policy, timeout=120)
    res = get_pool(2).run(_train_ddp_policy, "veragged", policy, timeout=120)
    for (rl, rn, rp), (l, n, p) in zip(ref, res):
        assert torch.equal(rl, l), (rl, l)
        assert torch.equal(rn, n), (rn, n)
        for name in rp:
            assert torch.equal(rp[name], p[name]), name


def _ddp_records():
    """After a DDP-mode backward: no verdict record (the replicas exchange no verdict flags,
    [Note: grad verdicts for optimizers]), so veragged's optimizers keep their presence
    all-reduce (tests/optim/test_backward_verdicts.py: dp-sharded parameters get one)."""
    from veragged.placement.tensor import GRAD_VERDICTS

    model, mesh = _ddp_model("veragged", False)
    _ddp_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh, range(1))
    model(DTensor.from_local(torch.randn(3, 16), mesh, [Replicate()],
                             run_check=False)).to_local().square().mean().backward()
    return [GRAD_VERDICTS.get(id(p)) is not None for p in model.parameters()]


def test_ddp_mode_records_no_verdicts():
    for ddp in get_pool(2).run(_ddp_records, timeout=120):
        assert ddp and not any(ddp), ddp
