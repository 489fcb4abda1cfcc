"""torch's generic entry points on veragged's RaggedShard parameters, under
`veragged.route_torch_entry_points()` ([Note: routing torch's entry points]).

Each scenario runs torch's own functions (`torch.distributed.tensor.distribute_tensor`, the
`torch.distributed.checkpoint.state_dict` setters and getters, accelerate's loaders) twice in the
same session on the same ranks: on torch's `fully_shard` without the routing (the reference), and
on `veragged.fully_shard` with it, from the same full state dicts. What each loads, and the
losses, parameters and optimizer states of a few AdamW steps after it, must be equal bitwise;
also under the routing, torch's side must give what it gives without it. Layouts: 1-D (2
ranks), HSDP (2 x 2) and FSDP x TP (dp 2, tp 2: `(StridedRaggedShard, Shard(0))` and
`(RaggedShard, Shard(1))` parameters).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
import torch.distributed.tensor as dtensor
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import veragged
from veragged.placement import RaggedShard, StridedRaggedShard
from veragged.optim import adamw8bit_granularity
from veragged.testing.llama import Llama, LlamaConfig, muon_param_groups, parallelize
from veragged.testing.pool import get_pool

TIMEOUT_S = 120
IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}
STEPS = 3
FULL = StateDictOptions(full_state_dict=True)
FULL_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


# ---- models, full state dicts, training -------------------------------------------------------


def _config(layout: str) -> LlamaConfig:
    return LlamaConfig(fused=False, hidden=96) if layout == "tp" else LlamaConfig()


def _build(impl: str, layout: str, meta: bool, seed: int = 0, **shard_kw):
    """A Llama sharded by `impl`'s fully_shard: "1d" (2 ranks), "hsdp" ((2, 2) mesh), "tp"
    ((dp 2, tp 2), parallelize_module then fully_shard over dp). Returns (model, dp index)."""
    if layout == "tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, dp_index = mesh["dp"], mesh.get_coordinate()[0]
    elif layout == "hsdp":
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        dp_index = dist.get_rank()
    else:
        dp, dp_index = init_device_mesh("cpu", (2,)), dist.get_rank()
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = Llama(_config(layout))
    if layout == "tp":
        parallelize(model, mesh["tp"])
    for block in model.blocks:
        IMPLS[impl](block, mesh=dp, **shard_kw)
    IMPLS[impl](model, mesh=dp, **shard_kw)
    return model, dp_index


def _full_model_sd(layout: str) -> dict[str, torch.Tensor]:
    """The full state dict every scenario loads: another seed's one-process model."""
    torch.manual_seed(1)
    return {k: v.detach().clone() for k, v in Llama(_config(layout)).state_dict().items()}


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _full_optim_sd(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """A full AdamW state dict for `model` (keyed by FQN, as torch's getter gives it) with
    nonzero moments, the same on every rank and for both implementations."""
    g = torch.Generator().manual_seed(2)
    state = {}
    for name, p in model.named_parameters():
        state[name] = {
            "step": torch.tensor(4.0),
            "exp_avg": torch.randn(p.shape, generator=g) * 1e-2,
            "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-4,
        }
    group = {k: v for k, v in optim.param_groups[0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(state)}]}


def _tokens(step: int, dp_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_index)
    return torch.randint(0, LlamaConfig.vocab, (2, 17), generator=g)


def _full(v):
    return (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()


def _flat(tree, prefix=""):
    """Leaves of a nested state dict by dotted path, tensors cloned (DTensors gathered)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        return _flat(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: _full(tree) if torch.is_tensor(tree) else tree}


def _train(model, optim, dp_index: int) -> dict:
    losses = []
    for step in range(STEPS):
        loss = model.loss(_tokens(step, dp_index))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": {n: _full(p) for n, p in model.named_parameters()},
        # torch's getters, full and offloaded to rank 0's CPU
        "msd": _flat(dsd.get_model_state_dict(model, options=FULL_RANK0)),
        "osd": _flat(dsd.get_optimizer_state_dict(model, optim, options=FULL_RANK0)),
    }


# ---- loading a full state dict through torch's entry points -----------------------------------


def _rank0_meta_init(model: nn.Module, full: dict) -> None:
    """torch's test_rank0_broadcast_meta_device_init (test_fully_shard_init.py): rank 0 holds
    the full state dict, every rank broadcasts each tensor and shards it with torch's
    `distribute_tensor(..., src_data_rank=0)` and the sharded parameter's placements."""
    sharded = {}
    for name, meta_param in model.state_dict().items():
        if dist.get_rank() == 0:
            value = full[name].detach().clone()
        else:
            value = torch.empty(meta_param.size(), dtype=meta_param.dtype)
        dist.broadcast(value, src=0)
        dt = dtensor.distribute_tensor(value, meta_param.device_mesh, meta_param.placements,
                                       src_data_rank=0)
        sharded[name] = nn.Parameter(dt)
    model.load_state_dict(sharded, assign=True)


def _load(model, optim_fn, mode: str, layout: str):
    """Load the full model (and then optimizer) state dict with torch's functions in `mode`;
    returns the optimizer."""
    full = _full_model_sd(layout)
    rank0 = dist.get_rank() == 0
    if mode == "distribute":
        _rank0_meta_init(model, full)
        return optim_fn(model)
    broadcast = mode in ("broadcast", "broadcast_offload")
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast,
                            cpu_offload=mode == "broadcast_offload")
    msd = full if rank0 or not broadcast else {}
    if mode == "set_state_dict":
        optim = optim_fn(model)
        dsd.set_state_dict(model, optim, model_state_dict=msd,
                           optim_state_dict=_full_optim_sd(model, optim), options=opts)
        return optim
    dsd.set_model_state_dict(model, msd, options=opts)
    optim = optim_fn(model)  # after the load: a meta model's parameters are new objects
    osd = _full_optim_sd(model, optim)
    dsd.set_optimizer_state_dict(model, optim, osd if rank0 or not broadcast else {},
                                 options=opts)
    return optim


def _scenario(impl: str, layout: str, mode: str, meta: bool, routed: bool) -> dict:
    model, dp_index = _build(impl, layout, meta, seed=5)
    with veragged.route_torch_entry_points() if routed else contextlib.nullcontext():
        optim = _load(model, _adamw, mode, layout)
    assert not veragged.torch_entry_points_routed()
    loaded = {n: _full(p) for n, p in model.named_parameters()}
    kinds = {n: (type(p).__name__, p.device.type, tuple(p.placements))
             for n, p in model.named_parameters()}
    osd_loaded = _flat(dsd.get_optimizer_state_dict(model, optim, options=FULL))
    return {"loaded": loaded, "osd_loaded": osd_loaded, "kinds": kinds,
            **_train(model, optim, dp_index)}


def _both(layout: str, mode: str, meta: bool) -> list[dict]:
    """torch's fully_shard without and with the routing, veragged's with it, in one job."""
    out = {}
    for impl, routed in (("torch", False), ("torch", True), ("veragged", True)):
        out[(impl, routed)] = _scenario(impl, layout, mode, meta, routed)
        dist.barrier()
    return out


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)
        else:
            assert a[k] == b[k], (what, k, a[k], b[k])


SCENARIOS = [  # layout, mode, meta
    ("1d", "every_rank", False),
    ("1d", "broadcast", False),
    ("1d", "broadcast_offload", True),
    ("1d", "set_state_dict", False),
    ("1d", "distribute", True),
    ("hsdp", "every_rank", True),
    ("hsdp", "broadcast", False),
    ("hsdp", "distribute", True),
    ("tp", "every_rank", False),
    ("tp", "broadcast", True),
    ("tp", "distribute", True),
]


@pytest.mark.parametrize("layout,mode,meta", SCENARIOS)
def test_torch_entry_points_load_like_torch(layout, mode, meta):
    world = 2 if layout == "1d" else 4
    results = get_pool(world).run(_both, layout, mode, meta, timeout=TIMEOUT_S)
    full = _full_model_sd(layout)
    for rank, res in enumerate(results):
        ref, ref_routed, got = (res[("torch", False)], res[("torch", True)],
                                res[("veragged", True)])
        for k in ("loaded", "osd_loaded", "losses", "params", "msd", "osd"):
            _assert_same(ref_routed[k] if k != "losses" else {"l": ref_routed[k]},
                         ref[k] if k != "losses" else {"l": ref[k]}, f"torch routed: {k}")
            _assert_same(got[k] if k != "losses" else {"l": got[k]},
                         ref[k] if k != "losses" else {"l": ref[k]}, f"veragged: {k}")
        _assert_same(got["loaded"], full, "loaded = the full state dict")
        assert (got["msd"] == {}) == (rank != 0)
        for name, (kind, device, placements) in got["kinds"].items():
            assert kind == "RaggedDTensor" and device == "cpu", (name, kind, device)
            assert any(isinstance(p, RaggedShard) for p in placements), (name, placements)
        if layout == "tp" and mode == "every_rank":
            q, o = got["kinds"]["blocks.0.q.weight"][2], got["kinds"]["blocks.0.out.weight"][2]
            assert isinstance(q[0], StridedRaggedShard) and q[1] == Shard(0), q
            assert type(o[0]) is RaggedShard and o[1] == Shard(1), o
        if layout == "hsdp" and mode == "every_rank":
            assert got["kinds"]["embed.weight"][2][0] == Replicate()


# ---- veragged's optimizers: full state dict round trips through torch's getters and setters ---


def _veragged_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "muon":
        return veragged.optim.Muon(muon_param_groups(model), lr=2e-2, weight_decay=0.1)
    return veragged.optim.AdamW8bit(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                                    block_size=64, min_8bit_size=1024)


def _optimizer_round_trip(name: str, layout: str, broadcast: bool) -> dict:
    """Train A two steps; load A's full model and optimizer state dicts (torch's getters; with
    `broadcast`, offloaded to rank 0) into a fresh B with torch's setters under the routing;
    then one more step on both."""
    kw = {"granularity_fn": adamw8bit_granularity(64, 1024)} if name == "adamw8bit" else {}
    a, dp_index = _build("veragged", layout, meta=False, seed=0, **kw)
    opt_a = _veragged_optimizer(name, a)
    for step in range(2):
        a.loss(_tokens(step, dp_index)).backward()
        opt_a.step()
        opt_a.zero_grad()
    get = FULL_RANK0 if broadcast else FULL
    # deep copies, as from a file: torch's full state dicts share A's 0-dim `step` tensors
    msd = copy.deepcopy(dsd.get_model_state_dict(a, options=get))
    osd = copy.deepcopy(dsd.get_optimizer_state_dict(a, opt_a, options=get))
    b, _ = _build("veragged", layout, meta=False, seed=3, **kw)
    opt_b = _veragged_optimizer(name, b)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    with veragged.route_torch_entry_points():
        dsd.set_model_state_dict(b, msd, options=opts)
        dsd.set_optimizer_state_dict(b, opt_b, osd, options=opts)
    out = {"osd_a": _flat(dsd.get_optimizer_state_dict(a, opt_a, options=FULL)),
           "osd_b": _flat(dsd.get_optimizer_state_dict(b, opt_b, options=FULL)),
           "kinds": sorted({type(v).__name__ for v in _leaves(opt_b.state_dict())})}
    for model, optim in ((a, opt_a), (b, opt_b)):
        loss = model.loss(_tokens(7, dp_index))
        loss.backward()
        optim.step()
        optim.zero_grad()
        out[model is a] = {"loss": {"l": loss.detach()},
                           "params": {n: _full(p) for n, p in model.named_parameters()},
                           "osd": _flat(dsd.get_optimizer_state_dict(model, optim, options=FULL))}
    return out


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


@pytest.mark.parametrize("name,layout,broadcast", [
    ("muon", "1d", True), ("adamw8bit", "1d", False), ("adamw8bit", "1d", True),
    ("muon", "tp", True),
])
def test_veragged_optimizers_round_trip_through_torch_setters(name, layout, broadcast):
    world = 2 if layout == "1d" else 4
    for res in get_pool(world).run(_optimizer_round_trip, name, layout, broadcast,
                                   timeout=TIMEOUT_S):
        assert "RaggedDTensor" in res["kinds"], res["kinds"]
        _assert_same(res["osd_b"], res["osd_a"], "loaded optimizer state")
        for k in ("loss", "params", "osd"):
            _assert_same(res[False][k], res[True][k], f"B vs A after one more step: {k}")
