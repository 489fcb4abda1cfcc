"""torch's generic entry points on veragged's RaggedShard parameters, under
`veragged.route_torch_entry_points()` ([Note: routing torch's entry points]).

Each scenario runs torch's own functions (`torch.distributed.tensor.distribute_tensor` in the
rank-0 meta-init recipe of torch's test_rank0_broadcast_meta_device_init, the
`torch.distributed.checkpoint.state_dict` setters and getters, accelerate's loaders) in the same
job on the same ranks: on torch's `fully_shard` without the routing (the reference), and on
`veragged.fully_shard` with it, from the same full state dicts. What each loads, and the losses,
parameters and optimizer states of a few AdamW steps after it, must be equal bitwise; where torch's
side also runs under the routing, it must give what it gives without it. Layouts: 1-D (2 ranks),
HSDP (2 x 2) and FSDP x TP (dp 2, tp 2: `(StridedRaggedShard, Shard(0))` and `(RaggedShard,
Shard(1))` parameters). veragged's Muon and AdamW8bit have no torch peer: their full state dicts
round-trip through torch's getters and setters into a fresh model that then steps like the first.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import logging
import shutil
import sys
import tempfile
import types
from unittest import mock

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
from veragged.optim import adamw8bit_granularity
from veragged.placement import RaggedShard, StridedRaggedShard
from veragged.placement.collectives import alive
from tests.harness.device import rank_device_type
from veragged.models.llama import Llama, LlamaConfig, muon_param_groups, parallelize
from tests.harness.pool import get_pool

TIMEOUT_S = 120
IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}
STEPS = 2
FULL = StateDictOptions(full_state_dict=True)
FULL_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


# ---- models, full state dicts, training -------------------------------------------------------


def _config(layout: str) -> LlamaConfig:
    return LlamaConfig(fused=False, hidden=96) if layout == "tp" else LlamaConfig()


_MESHES: dict = {}  # layout -> (mesh, dp mesh, dp index): one set of groups per pool job


def _meshes(layout: str):
    cached = _MESHES.get(layout)
    if cached is not None and _live(cached[0]):  # the pool ends a job's groups
        return cached
    if layout == "tp":
        mesh = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("dp", "tp"))
        made = (mesh, mesh["dp"], mesh.get_coordinate()[0])
    elif layout == "hsdp":
        mesh = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("rep", "shard"))
        made = (mesh, mesh, dist.get_rank())
    else:
        mesh = init_device_mesh(rank_device_type(), (2,))
        made = (mesh, mesh, dist.get_rank())
    _MESHES[layout] = made
    return made


def _live(mesh) -> bool:
    try:
        return alive(mesh.get_group(0))
    except RuntimeError:  # torch 2.15 raises where the group is gone
        return False


def _build(impl: str, layout: str, meta: bool, seed: int = 0, **shard_kw):
    """A Llama sharded by `impl`'s fully_shard: "1d" (2 ranks), "hsdp" ((2, 2) mesh), "tp"
    ((dp 2, tp 2), parallelize_module then fully_shard over dp). Returns (model, dp index)."""
    mesh, dp, dp_index = _meshes(layout)
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
    broadcast = mode in ("broadcast", "broadcast_offload", "broadcast_nonstrict")
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast,
                            cpu_offload=mode == "broadcast_offload",
                            strict=mode != "broadcast_nonstrict")
    if mode == "broadcast_nonstrict":  # a key rank 0 lacks keeps the model's own value
        del full["blocks.0.down.weight"]
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


def _both(layout: str, mode: str, meta: bool, torch_routed: bool) -> dict:
    """torch's fully_shard without the routing (and with it if `torch_routed`), veragged's with
    it, in one job."""
    runs = [("torch", False), ("veragged", True)] + [("torch", True)] * torch_routed
    return {(impl, routed): _scenario(impl, layout, mode, meta, routed) for impl, routed in runs}


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)
        else:
            assert a[k] == b[k], (what, k, a[k], b[k])


SCENARIOS = [  # layout, mode, meta, also run torch's side under the routing
    ("1d", "every_rank", False, True),
    ("1d", "broadcast", False, True),
    ("1d", "broadcast_offload", True, False),
    ("1d", "set_state_dict", False, False),
    ("1d", "distribute", True, True),
    ("hsdp", "every_rank", True, True),
    ("hsdp", "distribute", True, False),
    ("tp", "every_rank", False, False),
    ("tp", "broadcast", True, True),
    ("tp", "distribute", True, False),
    ("1d", "broadcast_nonstrict", False, False),
    ("tp", "broadcast_nonstrict", False, False),
]


@pytest.mark.parametrize("layout,mode,meta,torch_routed", SCENARIOS)
def test_torch_entry_points_load_like_torch(layout, mode, meta, torch_routed):
    world = 2 if layout == "1d" else 4
    results = get_pool(world).run(_both, layout, mode, meta, torch_routed, timeout=TIMEOUT_S)
    full = _full_model_sd(layout)
    for rank, res in enumerate(results):
        ref, got = res[("torch", False)], res[("veragged", True)]
        for k in ("loaded", "osd_loaded", "losses", "params", "msd", "osd"):
            wrap = (lambda d: {"l": d}) if k == "losses" else (lambda d: d)
            _assert_same(wrap(got[k]), wrap(ref[k]), f"veragged: {k}")
            if torch_routed:  # the routing leaves torch's own placements to torch
                _assert_same(wrap(res[("torch", True)][k]), wrap(ref[k]), f"torch routed: {k}")
        expected = full
        if mode == "broadcast_nonstrict":  # the key rank 0 lacked kept the model's own init
            kept = got["loaded"]["blocks.0.down.weight"]
            assert not torch.equal(kept, full["blocks.0.down.weight"])
            expected = {**full, "blocks.0.down.weight": kept}
        _assert_same(got["loaded"], expected, "loaded = the full state dict")
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
])
def test_veragged_optimizers_round_trip_through_torch_setters(name, layout, broadcast):
    world = 2 if layout == "1d" else 4
    for res in get_pool(world).run(_optimizer_round_trip, name, layout, broadcast,
                                   timeout=TIMEOUT_S):
        assert "RaggedDTensor" in res["kinds"], res["kinds"]
        _assert_same(res["osd_b"], res["osd_a"], "loaded optimizer state")
        for k in ("loss", "params", "osd"):
            _assert_same(res[False][k], res[True][k], f"B vs A after one more step: {k}")


# ---- accelerate's FSDP2 full-state-dict paths, called as accelerate calls them -------------------


def _accelerate_stand_ins():
    """accelerate's FSDP2 plugin and Accelerator as far as its fsdp_utils read them (a real
    Accelerator on CPU falls back to DDP: tests/clients has the end-to-end runs)."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )

    plugin = types.SimpleNamespace(
        fsdp_version=2, state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    accelerator = types.SimpleNamespace(
        process_index=rank, num_processes=world, is_main_process=rank == 0, is_fsdp2=True,
        wait_for_everyone=dist.barrier)
    return plugin, accelerator


def _accelerate(impl: str, routed: bool) -> dict:
    """accelerate's FULL_STATE_DICT `save_fsdp_model`/`save_fsdp_optimizer` of a trained A, then
    its `load_fsdp_model`/`load_fsdp_optimizer` (torch's setters with broadcast_from_rank0) into
    a fresh B and its `fsdp2_load_full_state_dict` (cpu_ram_efficient_loading: torch's
    `distribute_tensor` on rank 0's broadcast tensors) into a meta model C; then one step on
    each."""
    fsdp_utils = importlib.import_module("accelerate.utils.fsdp_utils")
    # accelerate's logger insists on its process state (PartialState); a plain one stands in
    with mock.patch.object(fsdp_utils, "logger", logging.getLogger(__name__)):
        return _accelerate_run(fsdp_utils, impl, routed)


def _accelerate_run(fsdp_utils, impl: str, routed: bool) -> dict:
    plugin, accelerator = _accelerate_stand_ins()
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    a, dp_index = _build(impl, "1d", meta=False, seed=0)
    opt_a = _adamw(a)
    for step in range(2):
        a.loss(_tokens(step, dp_index)).backward()
        opt_a.step()
        opt_a.zero_grad()
    fsdp_utils.save_fsdp_model(plugin, accelerator, a, folder)
    fsdp_utils.save_fsdp_optimizer(plugin, accelerator, opt_a, a, folder)
    b, _ = _build(impl, "1d", meta=False, seed=3)
    opt_b = _adamw(b)
    c, _ = _build(impl, "1d", meta=True, seed=4)
    full = (torch.load(f"{folder}/{fsdp_utils.FSDP_MODEL_NAME}.bin", weights_only=True)
            if dist.get_rank() == 0 else {})
    with veragged.route_torch_entry_points() if routed else contextlib.nullcontext():
        fsdp_utils.load_fsdp_model(plugin, accelerator, b, folder)
        fsdp_utils.load_fsdp_optimizer(plugin, accelerator, opt_b, b, folder)
        fsdp_utils.fsdp2_load_full_state_dict(accelerator, c, full)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    opt_c = _adamw(c)
    out = {"kinds": {n: type(p).__name__ for n, p in c.named_parameters()}}
    for key, model, optim in (("a", a, opt_a), ("b", b, opt_b), ("c", c, opt_c)):
        loss = model.loss(_tokens(7, dp_index))
        loss.backward()
        optim.step()
        optim.zero_grad()
        out[key] = {"loss": {"l": loss.detach()},
                    "params": {n: _full(p) for n, p in model.named_parameters()},
                    "osd": _flat(dsd.get_optimizer_state_dict(model, optim, options=FULL))}
    return out


def _accelerate_both() -> dict:
    return {impl: _accelerate(impl, routed=impl == "veragged") for impl in IMPLS}


def test_accelerate_full_state_dict_loading():
    pytest.importorskip("accelerate.utils.fsdp_utils")
    for res in get_pool(2).run(_accelerate_both, timeout=TIMEOUT_S):
        ref, got = res["torch"], res["veragged"]
        assert set(got["kinds"].values()) == {"RaggedDTensor"}, got["kinds"]
        for key in ("a", "b", "c"):
            for k in ("loss", "params", "osd"):
                _assert_same(got[key][k], ref[key][k], f"veragged vs torch, model {key}: {k}")
        for k in ("loss", "params", "osd"):  # B resumed A exactly
            _assert_same(got["b"][k], got["a"][k], f"B vs A: {k}")


# ---- the opt-in itself: what it rebinds, holds, undo -------------------------------------------


def _bindings() -> dict[str, object]:
    import torch.distributed._state_dict_utils as sdu
    import torch.distributed._tensor as old_tensor
    import torch.distributed.tensor._api as api

    import veragged.placement.api as vapi

    return {
        "tensor": dtensor.distribute_tensor, "_api": api.distribute_tensor,
        "_tensor": old_tensor.distribute_tensor,
        "sdu": sdu.distribute_tensor, "sdu._distribute_tensors": sdu._distribute_tensors,
        "sdu._distribute_state_dict": sdu._distribute_state_dict,
        "dsd._distribute_state_dict": dsd._distribute_state_dict,
        "veragged": vapi._torch_distribute_tensor,
    }


def test_route_rebinds_and_undoes_exactly():
    before = _bindings()
    assert not veragged.torch_entry_points_routed()
    # a client that bound torch's function under another name before the opt-in ...
    early = types.ModuleType("_veragged_test_early_client")
    exec("from torch.distributed.tensor import distribute_tensor as dt", early.__dict__)
    sys.modules[early.__name__] = early
    late = types.ModuleType("_veragged_test_late_client")
    try:
        with veragged.route_torch_entry_points() as hold:
            routed = _bindings()
            # ... and one that imports it while routed
            exec("from torch.distributed.tensor import distribute_tensor", late.__dict__)
            sys.modules[late.__name__] = late
            assert veragged.torch_entry_points_routed()
            for name in before:
                if name == "veragged":  # veragged's own binding of torch's stays torch's
                    assert routed[name] is before[name]
                else:
                    assert routed[name] is not before[name], name
                    assert routed[name].__wrapped__ is before[name], name
            assert early.dt is routed["tensor"] and late.distribute_tensor is routed["tensor"]
            assert inspect.signature(routed["tensor"]) == inspect.signature(before["tensor"])
            # idempotent: a second hold wraps nothing again, and its undo keeps the first's
            second = veragged.route_torch_entry_points()
            assert _bindings() == routed
            second.undo()
            second.undo()
            assert _bindings() == routed and veragged.torch_entry_points_routed()
            assert isinstance(hold, veragged.TorchEntryPointRouting)
        assert _bindings() == before and not veragged.torch_entry_points_routed()
        assert early.dt is before["tensor"] and late.distribute_tensor is before["tensor"]
        # a with block undoes on an exception too
        with pytest.raises(KeyError):
            with veragged.route_torch_entry_points():
                raise KeyError("x")
        assert _bindings() == before
        # unroute_torch_entry_points: at once, whatever holds remain; stale holds then do nothing
        stale = [veragged.route_torch_entry_points() for _ in range(2)]
        veragged.unroute_torch_entry_points()
        assert _bindings() == before and not veragged.torch_entry_points_routed()
        fresh = veragged.route_torch_entry_points()
        for h in stale:
            h.undo()
        assert veragged.torch_entry_points_routed()
        fresh.undo()
        assert _bindings() == before
    finally:
        veragged.unroute_torch_entry_points()
        sys.modules.pop(early.__name__, None)
        sys.modules.pop(late.__name__, None)


def _direct_calls() -> dict:
    """torch's distribute_tensor under the routing: calls without RaggedShard reach torch's with
    the same arguments and return its result; RaggedShard calls equal veragged's; errors."""
    import veragged.checkpoint.torch_entry_points as routing

    rank = dist.get_rank()
    mesh = init_device_mesh(rank_device_type(), (2,))
    mine = torch.arange(48.0).view(12, 4) + 100 * rank  # each rank's own data
    out = {}
    with veragged.route_torch_entry_points():
        spy = mock.Mock(wraps=routing._TORCH_DISTRIBUTE_TENSOR)
        with mock.patch.object(routing, "_TORCH_DISTRIBUTE_TENSOR", spy):
            got = dtensor.distribute_tensor(mine, mesh, [Shard(1)], src_data_rank=None)
            assert spy.call_args == mock.call(mine, mesh, [Shard(1)], src_data_rank=None)
            copy_ = mine.clone()  # torch's Replicate broadcasts into its input
            got2 = dtensor.distribute_tensor(copy_, mesh)
            assert spy.call_args == mock.call(copy_, mesh)
        assert type(got) is DTensor and type(got2) is DTensor
        out["torch"] = (got.to_local(), got2.to_local())
        ragged = RaggedShard((0,), (1, 2))
        for src in (0, None):
            leaf = mine.clone().requires_grad_(True)
            dt = dtensor.distribute_tensor(leaf, mesh, (ragged,), src_data_rank=src)
            ref = veragged.distribute_tensor(mine, mesh, [ragged], src_data_rank=src)
            assert type(dt).__name__ == "RaggedDTensor" and dt.requires_grad and dt.is_leaf
            assert torch.equal(dt.to_local(), ref.to_local())
            out[f"ragged src={src}"] = dt.to_local().detach()
        errors = {}
        for name, call in {
            "non-leaf": lambda: dtensor.distribute_tensor(
                mine.clone().requires_grad_(True) * 2, mesh, [ragged]),
            "shape": lambda: dtensor.distribute_tensor(torch.zeros(5, 4), mesh, [ragged]),
        }.items():
            try:
                call()
            except (RuntimeError, ValueError) as e:
                errors[name] = (type(e).__name__, str(e))
        out["errors"] = errors
    return out


def test_distribute_tensor_routes_ragged_calls_only():
    results = get_pool(2).run(_direct_calls, timeout=TIMEOUT_S)
    full0 = torch.arange(48.0).view(12, 4)  # rank 0's data
    rows = {0: slice(0, 4), 1: slice(4, 12)}
    for rank, res in enumerate(results):
        mine = full0 + 100 * rank
        assert torch.equal(res["torch"][0], mine[:, 2 * rank:2 * rank + 2])  # torch's Shard(1)
        assert torch.equal(res["torch"][1], full0)  # torch's Replicate: rank 0's data
        assert torch.equal(res["ragged src=0"], full0[rows[rank]].reshape(-1))
        assert torch.equal(res["ragged src=None"], mine[rows[rank]].reshape(-1))
        assert res["errors"]["non-leaf"] == (
            "RuntimeError", "`distribute_tensor` should be used to distribute leaf tensors! but "
            "found non-leaf tensor!")
        kind, msg = res["errors"]["shape"]
        assert kind == "ValueError" and "[5, 4]" in msg and "RaggedShard" in msg, msg


def _bad_full_shape(mode: str, layout: str):
    model, _ = _build("veragged", layout, meta=False)
    full = _full_model_sd(layout)
    name = "blocks.0.down.weight"
    full[name] = torch.zeros(full[name].shape[0], full[name].shape[1] + 1)
    broadcast = mode == "broadcast"
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    try:
        with veragged.route_torch_entry_points():
            dsd.set_model_state_dict(model, full if dist.get_rank() == 0 or not broadcast else {},
                                     options=opts)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("mode,layout", [("every_rank", "1d"), ("broadcast", "1d"),
                                         ("broadcast", "tp")])
def test_wrong_full_shape_raises_naming_the_parameter(mode, layout):
    world = 2 if layout == "1d" else 4
    for msg in get_pool(world).run(_bad_full_shape, mode, layout, timeout=TIMEOUT_S):
        assert msg is not None
        assert "'blocks.0.down.weight'" in msg, msg
        down = _config(layout)
        assert f"({down.dim}, {down.hidden + 1})" in msg and f"({down.dim}, {down.hidden})" in msg


# ---- torch's test_rank0_broadcast_meta_device_init, on veragged.fully_shard -----------------------


def _rank0_broadcast_meta_device_init(impl: str) -> dict:
    """torch's test (test/distributed/_composable/fsdp/test_fully_shard_init.py), its body kept:
    torch's Transformer, rank 0's full state dict broadcast parameter by parameter and sharded
    with torch's `distribute_tensor(..., sharded_meta_param.placements)` into a meta-initialised
    model, against a reference built from rank 0's broadcast model; `impl`'s fully_shard, with
    the routing for veragged's."""
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        ModelArgs,
        Transformer,
        TransformerBlock,
    )

    fully_shard = IMPLS[impl]
    rank = dist.get_rank()
    model_args = ModelArgs(dropout_p=0.0)
    if rank == 0:
        torch.manual_seed(42)
        ref_model = Transformer(model_args)
        full_sd = ref_model.state_dict()
    fsdp_mesh = init_device_mesh(rank_device_type(), (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(model_args)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    assert all(p.device == torch.device("meta") for p in model.parameters())
    meta_sharded_sd = model.state_dict()
    sharded_sd = {}
    with veragged.route_torch_entry_points() if impl == "veragged" else contextlib.nullcontext():
        if rank == 0:
            assert list(meta_sharded_sd.keys()) == list(full_sd.keys())
            for (param_name, full_param), sharded_meta_param in zip(
                full_sd.items(), meta_sharded_sd.values()
            ):
                full_param = full_param.detach().to("cpu")
                mesh = sharded_meta_param.device_mesh
                dist.broadcast(full_param, src=0, group=mesh.get_group(0))
                sharded_tensor = dtensor.distribute_tensor(
                    full_param, mesh, sharded_meta_param.placements
                )
                sharded_sd[param_name] = nn.Parameter(sharded_tensor)
        else:
            for param_name, sharded_meta_param in meta_sharded_sd.items():
                full_tensor = torch.empty(
                    sharded_meta_param.size(), device="cpu", dtype=sharded_meta_param.dtype
                )
                mesh = sharded_meta_param.device_mesh
                dist.broadcast(full_tensor, src=0, group=mesh.get_group(0))
                sharded_tensor = dtensor.distribute_tensor(
                    full_tensor, mesh, sharded_meta_param.placements
                )
                sharded_sd[param_name] = nn.Parameter(sharded_tensor)
    model.load_state_dict(sharded_sd, assign=True)
    for param in model.parameters():
        assert isinstance(param, DTensor) and param.device.type == "cpu"
    if rank != 0:
        ref_model = Transformer(model_args)
    for param in ref_model.parameters():
        torch.distributed.broadcast(param.detach(), src=0)
    for module in ref_model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=fsdp_mesh)
    fully_shard(ref_model, mesh=fsdp_mesh)
    for (param_name, param), (ref_param_name, ref_param) in zip(
        model.named_parameters(), ref_model.named_parameters()
    ):
        assert param_name == ref_param_name
        assert torch.equal(param.full_tensor(), ref_param.full_tensor()), param_name
    inp = torch.randint(0, model_args.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(rank))
    loss = model(inp).sum()
    loss.backward()
    ref_loss = ref_model(inp).sum()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for param, ref_param in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(param.grad.full_tensor(), ref_param.grad.full_tensor())
    return {"kind": type(next(model.parameters())).__name__, "loss": loss.detach(),
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def _rank0_broadcast_both() -> dict:
    return {impl: _rank0_broadcast_meta_device_init(impl) for impl in IMPLS}


def test_rank0_broadcast_meta_device_init():
    for res in get_pool(2).run(_rank0_broadcast_both, timeout=TIMEOUT_S):
        assert res["torch"]["kind"] == "DTensor" and res["veragged"]["kind"] == "RaggedDTensor"
        assert torch.equal(res["veragged"]["loss"], res["torch"]["loss"])
        _assert_same(res["veragged"]["grads"], res["torch"]["grads"], "gradients")
