"""Regression tests for `load_state_dict(assign=True)` on fully_shard models
([Note: fully_shard state dicts]).

Each scenario runs under torch's `fully_shard` and `veragged.fully_shard` on 2 gloo ranks and
compares what the script observes. Before the fix, values assigned to a model built on the meta
device were dropped (its DBuffer stayed on meta and the first forward raised), and DTensors with
other placements or plain tensors could not be assigned.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import veragged
from tests.harness.pool import get_pool

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))


def _sharded(impl: str, meta: bool) -> nn.Sequential:
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = _net()
    for i in (0, 2):
        IMPLS[impl](model[i])
    IMPLS[impl](model)
    return model


def _full_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {k: v.detach().clone() for k, v in _net().state_dict().items()}


def _pieces(model: nn.Module, full: dict[str, torch.Tensor]) -> list[dict[str, nn.Parameter]]:
    """One state dict per parameter, each sharded like the model's parameter
    (`veragged.distribute_tensor` hands torch's placements to torch's)."""
    return [
        {k: nn.Parameter(veragged.distribute_tensor(full[k], p.device_mesh, p.placements))}
        for k, p in model.state_dict().items()
    ]


def _load_in_pieces(impl: str, meta: bool):
    full = _full_state()
    model = _sharded(impl, meta)
    ids = {n: id(p) for n, p in model.named_parameters()}
    devices = []
    for sd in _pieces(model, full):
        model.load_state_dict(sd, strict=False, assign=True)
        devices.append({k: v.device.type for k, v in model.state_dict().items()})
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(x).sum()
    loss.backward()
    values = {n: p.full_tensor() for n, p in model.named_parameters()}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    kept = all(id(p) == ids[n] for n, p in model.named_parameters())
    return devices, loss.detach(), values, grads, kept, full


@pytest.mark.parametrize("meta", [True, False])
def test_assign_in_pieces_matches_torch(meta):
    res = {impl: get_pool(2).run(_load_in_pieces, impl, meta) for impl in IMPLS}
    for rank in range(2):
        dev_t, loss_t, val_t, grad_t, _, full = res["torch"][rank]
        dev_v, loss_v, val_v, grad_v, kept, _ = res["veragged"][rank]
        assert dev_v == dev_t  # a group on meta shows what was assigned so far, the rest on meta
        if meta:
            assert dev_v[0] == {"0.weight": "cpu", "0.bias": "meta", "2.weight": "meta",
                                "2.bias": "meta", "3.weight": "meta", "3.bias": "meta"}
        torch.testing.assert_close(loss_v, loss_t, atol=1e-6, rtol=0)
        for n in val_t:
            torch.testing.assert_close(val_v[n], full[n], atol=0, rtol=0)
            torch.testing.assert_close(val_v[n], val_t[n], atol=0, rtol=0)
            torch.testing.assert_close(grad_v[n], grad_t[n], atol=1e-6, rtol=0)
        assert kept  # veragged keeps its parameter objects (views into the DBuffer)


def _forward_before_complete(impl: str):
    model = _sharded(impl, meta=True)
    model.load_state_dict(_pieces(model, _full_state())[0], strict=False, assign=True)
    try:
        model(torch.randn(3, 4))
    except RuntimeError as e:
        return str(e)
    return None


def test_forward_on_partly_loaded_meta_model_raises_as_torch():
    res = {impl: get_pool(2).run(_forward_before_complete, impl) for impl in IMPLS}
    for impl in IMPLS:
        for msg in res[impl]:
            assert msg is not None and "still on meta device" in msg, (impl, msg)


def _assign_other_layouts():
    """veragged only (torch's FSDP2 takes assigned local tensors as they are): DTensors with
    torch's placements and plain full tensors, loaded with assign=True."""
    full = _full_state()
    model = _sharded("veragged", meta=False)
    params = dict(model.named_parameters())
    storage = {n: p._local_tensor.untyped_storage().data_ptr() for n, p in params.items()}
    mesh = params["0.weight"].device_mesh
    kinds = [
        lambda t: t,
        lambda t: torch_distribute_tensor(t, mesh, [Replicate()]),
        lambda t: torch_distribute_tensor(t, mesh, [Shard(0)]),
    ]
    sd = {k: kinds[i % 3](t) for i, (k, t) in enumerate(full.items())}
    model.load_state_dict(sd, assign=True)
    for n, p in model.named_parameters():
        assert p is params[n] and isinstance(p, veragged.RaggedDTensor) and p.requires_grad
        assert p._local_tensor.untyped_storage().data_ptr() == storage[n]
        torch.testing.assert_close(p.full_tensor(), full[n], atol=0, rtol=0)


def test_assign_other_placements_and_full_tensors():
    get_pool(2).run(_assign_other_layouts)
