"""Full state dicts into veragged-sharded models and optimizers (veragged.checkpoint.state_dict).

Each scenario runs on 2 gloo ranks twice in the same session: torch's `fully_shard` with torch's
`torch.distributed.checkpoint.state_dict` setters (the reference), and `veragged.fully_shard` with
veragged's setters, on the same model and full state dict; what each loads, and the parameters
after one forward/backward/AdamW step, must be equal bitwise. torch's own setters on a veragged
model must raise (torch's `distribute_tensor` and `compute_local_shape_and_global_offset` know
only torch's placements) rather than load wrong data.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import veragged
import veragged.checkpoint as vcp
from tests.harness.pool import get_pool

TIMEOUT_S = 120
IMPLS = ("torch", "veragged")
SETTERS = {
    "torch": (dsd.set_model_state_dict, dsd.set_optimizer_state_dict, dsd.set_state_dict),
    "veragged": (vcp.set_model_state_dict, vcp.set_optimizer_state_dict, vcp.set_state_dict),
}


def _net() -> nn.Sequential:
    # BatchNorm adds buffers (not sharded) and a 0-dim one (num_batches_tracked).
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)
    )


def _sharded(impl: str, seed: int = 0, meta: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = _net()
    shard = torch_fully_shard if impl == "torch" else veragged.fully_shard
    for i in (0, 3):
        shard(model[i])
    shard(model)
    return model


def _full_state(drop: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    net = _net()
    net(torch.randn(5, 4))  # non-default BatchNorm statistics
    return {k: v.detach().clone() for k, v in net.state_dict().items() if k != drop}


def _full(v: torch.Tensor) -> torch.Tensor:
    return (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in model.state_dict().items()}


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    model(x).square().sum().backward()
    optim.step()
    optim.zero_grad()


def _load_then_step(impl: str, broadcast: bool, strict: bool, drop: str | None, meta: bool):
    """Load the full state dict with `impl`'s set_model_state_dict, then one training step."""
    model = _sharded(impl, meta=meta)
    full = _full_state(drop)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=strict)
    sd = full if dist.get_rank() == 0 or not broadcast else {}
    try:  # with assign (meta), rank 0's plain tensors become the buffers, as with torch's
        keys = SETTERS[impl][0](model, sd, options=options)
    except RuntimeError as e:
        return {"error": str(e)}
    loaded = _values(model)
    kinds = {n: (type(p).__name__, p.device.type) for n, p in model.named_parameters()}
    _step(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), seed=7)
    return {"keys": (sorted(keys.missing_keys), sorted(keys.unexpected_keys)),
            "loaded": loaded, "kinds": kinds, "stepped": _values(model), "full": _full_state(drop)}


LOADS = [  # broadcast, strict, drop, meta
    (False, True, None, False),
    (False, True, "4.bias", False),
    (False, False, "4.bias", False),
    (True, True, None, False),
    (True, True, "4.bias", False),
    (True, False, "4.bias", False),
    (True, True, None, True),
]


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k, a[k], b[k])


@pytest.mark.parametrize("broadcast,strict,drop,meta", LOADS)
def test_load_full_model_state_dict_matches_torch(broadcast, strict, drop, meta):
    res = {impl: get_pool(2).run(_load_then_step, impl, broadcast, strict, drop, meta,
                                 timeout=TIMEOUT_S) for impl in IMPLS}
    for rank in range(2):
        ref, got = res["torch"][rank], res["veragged"][rank]
        if "error" in ref:  # broadcast with strict=True and a key missing on rank 0
            assert broadcast and strict and drop is not None
            assert "error" in got, got.get("keys")
            assert f'Missing key(s) in state_dict: "{drop}"' in ref["error"], ref["error"]
            assert f'Missing key(s) in state_dict: "{drop}"' in got["error"], got["error"]
            continue
        assert "error" not in got, got["error"]
        assert got["keys"] == ref["keys"]
        _assert_equal(got["loaded"], ref["loaded"], "loaded")
        for k, v in got["loaded"].items():
            if k != drop:
                assert torch.equal(v, got["full"][k]), k
        _assert_equal(got["stepped"], ref["stepped"], "after one step")
        assert all(kind == ("RaggedDTensor", "cpu") for kind in got["kinds"].values())
    if drop is not None and not (broadcast and strict):  # the missing key kept its value
        assert not torch.equal(res["veragged"][0]["loaded"][drop], _full_state()[drop])


def _round_trip(impl: str, broadcast: bool, combined: bool):
    """Train A one step, take its full model and optimizer state dicts, load them into a fresh
    B (other initial values, an optimizer without state), then one more step on both."""
    set_model, set_optim, set_both = SETTERS[impl]
    get_opts = StateDictOptions(full_state_dict=True)
    a = _sharded(impl, seed=0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    _step(a, opt_a, seed=3)
    # deep copies, as from a file: the full state dict shares A's 0-dim `step` tensors
    msd = copy.deepcopy(dsd.get_model_state_dict(a, options=get_opts))
    osd = copy.deepcopy(dsd.get_optimizer_state_dict(a, opt_a, options=get_opts))
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd_rank0 = dsd.get_model_state_dict(a, options=offload)
    osd_rank0 = dsd.get_optimizer_state_dict(a, opt_a, options=offload)
    got = {"msd": _flat(msd), "osd": _flat(osd), "msd_rank0": _flat(msd_rank0),
           "osd_rank0": _flat(osd_rank0)}  # copies: torch's setters put DTensors into msd

    b = _sharded(impl, seed=2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    mine = dist.get_rank() == 0 or not broadcast
    # torch's set_state_dict cannot be the reference with broadcast_from_rank0: ranks given an
    # empty model_state_dict skip the model's load (optim_only) while rank 0 broadcasts it, so
    # their collectives go out of step. The reference loads the model and the optimizer apart.
    if combined and impl == "veragged":
        set_both(b, opt_b, model_state_dict=msd if mine else {},
                 optim_state_dict=osd if mine else {}, options=options)
    else:
        set_model(b, msd if mine else {}, options=options)
        set_optim(b, opt_b, osd if mine else {}, options=options)
    osd_b = _flat(dsd.get_optimizer_state_dict(b, opt_b, options=get_opts))
    _step(a, opt_a, seed=5)
    _step(b, opt_b, seed=5)
    return {**got, "osd_b": osd_b, "a": _values(a), "b": _values(b)}


def _flat(tree, prefix=""):
    """Leaves of a (possibly nested) state dict by dotted path, tensors cloned."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        return _flat(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: tree.detach().clone() if torch.is_tensor(tree) else tree}


def _assert_same_tree(fa, fb, what):
    """Two `_flat` state dicts hold the same keys and values (tensors bitwise)."""
    assert fa.keys() == fb.keys(), (what, sorted(fa.keys() ^ fb.keys()))
    for k in fa:
        if torch.is_tensor(fa[k]):
            assert torch.is_tensor(fb[k]) and torch.equal(fa[k], fb[k]), (what, k)
        else:
            assert fa[k] == fb[k], (what, k, fa[k], fb[k])


@pytest.mark.parametrize(
    "broadcast,combined", [(False, False), (True, False), (True, True)]
)
def test_optimizer_full_state_dict_round_trip_matches_torch(broadcast, combined):
    res = {impl: get_pool(2).run(_round_trip, impl, broadcast, combined,
                                 timeout=TIMEOUT_S) for impl in IMPLS}
    for rank in range(2):
        ref, got = res["torch"][rank], res["veragged"][rank]
        # torch's getters work on veragged models as they are, and agree with torch's FSDP2
        _assert_same_tree(got["msd"], ref["msd"], "full model state dict")
        _assert_same_tree(got["osd"], ref["osd"], "full optimizer state dict")
        _assert_same_tree(got["msd_rank0"], ref["msd_rank0"], "cpu_offload model state dict")
        _assert_same_tree(got["osd_rank0"], ref["osd_rank0"], "cpu_offload optimizer state dict")
        assert (got["msd_rank0"] == {}) == (rank != 0) and bool(got["msd_rank0"]) == (rank == 0)
        # B took A's optimizer state, and one more step keeps them equal
        _assert_same_tree(got["osd_b"], got["osd"], "loaded optimizer state")
        params = [k for k in got["a"] if "running" not in k and "batches" not in k]
        # (BatchNorm's statistics are per rank: with broadcast_from_rank0 B has rank 0's)
        _assert_equal(*({k: d[k] for k in params} for d in (got["b"], got["a"])), "B vs A")
        _assert_equal(got["b"], ref["b"], "veragged vs torch after the next step")


def _torch_setter_on_veragged(case: str):
    """torch's own setter on a veragged model: raises (nothing loaded where the model had data)."""
    meta = case == "meta_broadcast"
    model = _sharded("veragged", meta=meta)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = None if meta else _values(model)
    full = _full_state()
    broadcast = case in ("broadcast", "meta_broadcast")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    sd = full if dist.get_rank() == 0 or not broadcast else {}
    if case == "optimizer":  # a full optimizer state dict of ones, every rank
        osd = dsd.get_optimizer_state_dict(model, optim, options=StateDictOptions(
            full_state_dict=True))  # (AdamW's state for every parameter, from a zero step)
        before = _exp_avgs(model, optim)
        for state in osd["state"].values():
            state["exp_avg"] = torch.ones_like(state["exp_avg"])
    try:
        if case == "optimizer":
            dsd.set_optimizer_state_dict(model, optim, osd, options=options)
        else:
            dsd.set_model_state_dict(model, sd, options=options)
    except RuntimeError as e:
        if case == "optimizer":
            _assert_equal(_exp_avgs(model, optim), before, "optimizer after the failed load")
        elif before is not None:
            _assert_equal(_values(model), before, "model after the failed load")
        return type(e).__name__, str(e)[:200]
    return None


def _exp_avgs(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    states = dsd.get_optimizer_state_dict(model, optim)["state"]
    return {n: _full(s["exp_avg"]) for n, s in states.items()}


@pytest.mark.parametrize("case", ["every_rank", "broadcast", "meta_broadcast", "optimizer"])
def test_torch_setters_raise_on_veragged_models(case):
    for result in get_pool(2).run(_torch_setter_on_veragged, case, timeout=TIMEOUT_S):
        assert result is not None, f"torch's setter loaded a full state dict ({case})"
        assert result[0] == "RuntimeError", result


def _bad_rank0_value(kind: str):
    model = _sharded("veragged")
    full = _full_state()
    if kind == "dtensor":
        full["3.weight"] = model.state_dict()["3.weight"]
    else:
        full["3.weight"] = torch.zeros(8, 9)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    try:
        vcp.set_model_state_dict(model, full if dist.get_rank() == 0 else {}, options=options)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["dtensor", "shape"])
def test_broadcast_rejects_bad_rank0_values_on_every_rank(kind):
    for msg in get_pool(2).run(_bad_rank0_value, kind, timeout=TIMEOUT_S):
        assert msg is not None and "'3.weight'" in msg, msg
        assert ("DTensor" if kind == "dtensor" else "(8, 9)") in msg, msg
