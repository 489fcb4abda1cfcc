"""`shard_placement_fn` returning `Shard(d)` with d > 0 ([Note: chunked parameters]).

Each scenario trains the same model under torch's `fully_shard` and `veragged.fully_shard` with
the same `shard_placement_fn` (2-D weights on dim 1, the rest on dim 0) and compares gradients
(None where torch has None), parameters and the sharded parameters' placements and local shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from tests.fsdp.test_lifecycle import (
    IMPLS,
    Net,
    _data,
    _gather_every_group_once,
    _grads,
    _params,
    _same,
)
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool


def _dim1_for_matrices(p: nn.Parameter):
    return Shard(1) if p.ndim == 2 else Shard(0)


def _train(impl, mesh_shape, mixed, k, no_sync):
    torch.manual_seed(0)
    model = Net()
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh(rank_device_type(), mesh_shape, mesh_dim_names=names)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed else MixedPrecisionPolicy())
    kw = dict(mesh=mesh, shard_placement_fn=_dim1_for_matrices, mp_policy=mp,
              reshard_after_forward=k)
    fs = IMPLS[impl]
    for b in [*model.blocks, model.extra]:
        fs(b, **kw)
    fs(model, **kw)
    if no_sync:
        _gather_every_group_once(model, impl, use_extra=True)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    layout = {n: (tuple(p.placements), tuple(p.to_local().shape), p.to_local().is_contiguous())
              for n, p in model.named_parameters() if p.ndim == 2}
    out = []
    rank = dist.get_rank()
    for step in range(3):
        use_extra = step == 1  # `extra` is reached on one step only: None on the others
        if no_sync:
            model.set_requires_gradient_sync(False)
            model(_data(10 + step, rank), use_extra=use_extra).sum().backward()
            model.set_requires_gradient_sync(True)
        model(_data(step, rank), use_extra=use_extra).sum().backward()
        out.append(_grads(model))
        optim.step()
        optim.zero_grad()
    return out, _params(model), layout


CASES = {
    "1d": ((2,), False, True, False),
    "1d-bf16-no-sync": ((2,), True, True, True),
    "hsdp": ((2, 2), False, True, False),
    "reshard-to-2": ((4,), False, 2, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shard_dim1_matches_torch(case):
    mesh_shape, mixed, k, no_sync = CASES[case]
    world = 1
    for s in mesh_shape:
        world *= s
    # torch 2.15's reshard_after_forward=k gathers stale post-forward shards after a step (see
    # test_lifecycle.test_reshard_after_forward_to_a_smaller_world): compare with its True.
    ref = get_pool(world).run(_train, "torch", mesh_shape, mixed, True, no_sync)
    res = get_pool(world).run(_train, "veragged", mesh_shape, mixed, k, no_sync)
    atol = 1e-2 if mixed else 1e-5
    for rank in range(world):
        (g_t, p_t, l_t), (g_v, p_v, l_v) = ref[rank], res[rank]
        assert l_v == l_t  # torch's placements (Shard(1)), local shapes, contiguous
        assert all(any(isinstance(x, Shard) and x.dim == 1 for x in pl) for pl, _, _ in l_v.values())
        for a, b in zip(g_t, g_v):
            _same(a, b, atol=atol)
        assert g_v[0]["extra.lin.weight"] is None and g_v[1]["extra.lin.weight"] is not None
        _same(p_t, p_v, atol=atol)


def _uneven(impl):
    model = nn.Linear(3, 4)  # weight (4, 3): 3 columns on 2 ranks
    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        IMPLS[impl](model, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    return True


def test_uneven_dim1_raises_as_torch():
    assert all(get_pool(2).run(_uneven, "veragged"))


def _state_dict_round_trip():
    torch.manual_seed(0)
    model = Net()
    IMPLS["veragged"](model, shard_placement_fn=_dim1_for_matrices)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert isinstance(sd["inp.weight"], DTensor) and sd["inp.weight"].placements == (Shard(1),)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    model.load_state_dict(sd)
    return all(torch.equal(_params(model)[k], v.full_tensor()) for k, v in sd.items())


def test_state_dict_round_trip():
    assert all(get_pool(2).run(_state_dict_round_trip))
