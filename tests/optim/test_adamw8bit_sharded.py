"""AdamW8bit on `veragged.fully_shard` parameters: the state and the parameters are bitwise
the same on 1, 2 and 4 gloo ranks; grad=None on some ranks; DCP saved on 4 ranks, resumed on 2.

Every run gets the same global gradients: each step, every parameter's full gradient is drawn
from a seed and each rank keeps its shard of it (a real backward would sum the ranks' partial
gradients in a world-size dependent order and so differ in the last bits).
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

import veragged
from veragged.optim import adamw8bit as adamw8bit_module
from veragged.optim.adamw8bit import AdamW8bit, adamw8bit_granularity
from tests.harness import get_mesh, run_on_ranks

BLOCK, MIN_8BIT = 32, 256  # small, so a small model has many blocks and both kinds of state
KW = dict(lr=1e-2, weight_decay=0.1, block_size=BLOCK, min_8bit_size=MIN_8BIT)
STEPS = 4


class Net(nn.Module):
    """Uneven sizes: a 3-element bias, weights that are (not) multiples of the block size."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 64)  # weight 1536 = 48 blocks; bias 64 (fp32 state)
        self.b = nn.Linear(64, 37)  # weight 2368 = 74 blocks; bias 37
        self.c = nn.Linear(37, 3)  # weight 111 (fp32 state); bias 3
        self.odd = nn.Parameter(torch.randn(10, 30))  # 300 >= 256, not a multiple of 32


def _model(world: int) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if world > 1:
        fn = adamw8bit_granularity(BLOCK, MIN_8BIT)
        for sub in (model.a, model.b):
            veragged.fully_shard(sub, mesh=get_mesh(), granularity_fn=fn)
        veragged.fully_shard(model, mesh=get_mesh(), granularity_fn=fn)
    return model


def _grad(fqn: str, shape, step: int, drop: dict | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + sum(map(ord, fqn)))
    g = torch.randn(shape, generator=gen) * 0.1
    if fqn == "b.weight" and step == 2:
        g.view(-1)[5] = float("nan")  # NaN policy must not depend on the sharding either
    for lo, hi in (drop or {}).get((fqn, step), ()):
        g.view(-1)[lo:hi] = 0  # the reference of a rank that has no gradient
    return g


def _set_grads(model, step: int, drop_rank: int | None = None) -> dict:
    """Give every parameter its shard of the global gradient. `drop_rank` sets `grad = None`
    on that rank for "b.weight" at step 1 and for everything at step 2; returns the flat ranges
    it dropped, per (fqn, step)."""
    dropped = {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for fqn, p in model.named_parameters():
        g = _grad(fqn, p.shape, step, None)
        if not isinstance(p, DTensor):
            p.grad = g
            continue
        n, off = veragged.local_numel_and_offset(p.shape, p.device_mesh, p.placements)
        if drop_rank is not None and (step == 2 or (step == 1 and fqn == "b.weight")):
            ranges = [None] * dist.get_world_size()
            dist.all_gather_object(ranges, (off, off + n))
            dropped[(fqn, step)] = ranges[drop_rank : drop_rank + 1]
            if rank == drop_rank:
                p.grad = None
                continue
        local = g.reshape(-1)[off : off + n].clone()
        p.grad = veragged.DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                             stride=p.stride())
    return dropped


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, opt) -> dict:
    out = {}
    for fqn, p in model.named_parameters():
        out[fqn] = _full(p)
        for key, value in opt.state[p].items():
            out[f"{fqn}/{key}"] = _full(value)
    return out


def _train(world: int, steps=STEPS, drop_rank=None, drop=None):
    """World 1: one process, plain tensors (`drop` zeroes the dropped ranges of the gradient).
    Gradients dropped by hand on one rank: the ranks agree over the mesh ("mesh"). Returns
    the snapshot, the dropped ranges and the 8-bit kernel launches per step."""
    model = _model(world)
    opt = AdamW8bit(model.parameters(), **KW, grad_agreement="mesh")
    dropped, launches = {}, []
    for step in range(steps):
        if world == 1:
            for fqn, p in model.named_parameters():
                p.grad = _grad(fqn, p.shape, step, drop)
        else:
            dropped.update(_set_grads(model, step, drop_rank))
        launches.append(0)
        real = adamw8bit_module.adamw8bit_multi_step_

        def counting(*args, **kwargs):
            launches[-1] += 1
            real(*args, **kwargs)

        with mock.patch.object(adamw8bit_module, "adamw8bit_multi_step_", counting):
            opt.step()
        opt.zero_grad()
    return _snapshot(model, opt), dropped, launches


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (k, (a[k] != b[k]).sum())


def _state_kinds(snapshot):
    return {k.split("/")[0] for k in snapshot if k.endswith("exp_avg_codes")}


def test_world_size_invariance():
    """Bitwise the single process on 2 and 4 ranks, with one 8-bit launch per step for the
    three fully_shard groups' 8-bit parameters (one optimizer param group, one dtype)."""
    ref, _, launches = _train(1)
    assert _state_kinds(ref) == {"a.weight", "b.weight", "odd"} and launches == [1] * STEPS
    for world in (2, 4):
        for got, _, launches in run_on_ranks(_train, world, args=(world,), timeout=120):
            _assert_same(ref, got)
            assert launches == [1] * STEPS, launches


def test_grad_none_on_one_rank():
    got, dropped, _ = run_on_ranks(_train, 2, args=(2, STEPS, 1), timeout=120)[0]
    assert dropped and any(hi > lo for ranges in dropped.values() for lo, hi in ranges)
    ref, _, _ = _train(1, drop=dropped)
    _assert_same(ref, got)


def _check_layout():
    """An FSDP2-style Shard(0) DTensor whose rows do not align with the blocks is refused."""
    mesh = get_mesh()
    w = veragged.distribute_tensor(torch.randn(10, 30), mesh, [Shard(0)])  # 3 rows = 90
    with pytest.raises(ValueError, match=r"parameter w \(shape \[10, 30\], 300 elements\) is "
                                         r"sharded so that rank 0 of mesh dim 0 holds 90 elements "
                                         r"at flat offset 0, which is not a whole number of 32-"):
        AdamW8bit([("w", nn.Parameter(w))], **KW)  # named parameters name the error
    ok = veragged.distribute_tensor(torch.randn(16, 32), mesh, [Shard(0)])  # 4 rows = 4 blocks
    opt = AdamW8bit([nn.Parameter(ok)], **KW)
    absmax = next(iter(opt.state.values()))["exp_avg_absmax"]
    return absmax.shape, absmax.placements, absmax.to_local().shape


def test_unaligned_shard_raises():
    shape, placements, local = run_on_ranks(_check_layout, 4, timeout=60)[1]
    assert shape == (16,) and local == (4,)
    assert placements == (veragged.RaggedShard((0,), (4, 4, 4, 4)),)


def _save(path):
    model = _model(4)
    opt = AdamW8bit(model.parameters(), **KW)
    for step in range(STEPS - 1):
        _set_grads(model, step)
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _resume(path):
    model = _model(2)
    opt = AdamW8bit(model.parameters(), **KW)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    kinds = {k: v.dtype for k, v in opt.state[model.b.weight].items()}
    _set_grads(model, STEPS - 1)
    opt.step()
    return _snapshot(model, opt), kinds


def test_dcp_save_4_resume_2(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save, 4, args=(path,), timeout=120)
    got, kinds = run_on_ranks(_resume, 2, args=(path,), timeout=120)[0]
    assert kinds["exp_avg_codes"] == torch.uint8 and kinds["exp_avg_absmax"] == torch.float32
    ref, _, _ = _train(1)  # uninterrupted, STEPS steps
    _assert_same(ref, got)
