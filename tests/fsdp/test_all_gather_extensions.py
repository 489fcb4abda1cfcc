"""All-gather extensions ([Note: all-gather extensions]) against torch's `fully_shard`.

Each scenario trains the same model under torch's `fully_shard` and `veragged.fully_shard` on
gloo ranks, the weights given `fsdp_pre_all_gather` / `fsdp_post_all_gather` hooks (by a tensor
subclass, or set on the sharded local tensors after `fully_shard` as torch's tests do), and
compares losses, gradients and parameters bitwise, and how often each hook ran. The hooks round
the weights (bf16, or int8 with a per-rank scale), so a run that skipped them would differ.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from tests.fsdp.test_lifecycle import IMPLS, _full
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

CALLS = {"pre": 0, "post": 0, "post_out": 0}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._data if isinstance(t, _Wrapped) else t


# --- the hooks (shared by the subclasses and the hooks set on local tensors) --------------------

def _bf16_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    """bf16 on the wire, padded to torch's chunk as an uneven parameter must be."""
    CALLS["pre"] += 1
    data = _plain(self)
    rows = math.ceil(outer_size[0] / mesh.size())
    padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=data.device)
    padded[: data.size(0)].copy_(data)
    return (padded,), None


def _bf16_post(self, outputs, metadata, param_dtype, *, out=None):
    (t,) = outputs
    assert metadata is None and t.dtype == torch.bfloat16
    if out is not None:
        CALLS["post_out"] += 1
        with torch.no_grad(), _unsafe_preserve_version_counter(out):
            out.copy_(t[: out.size(0)])  # `out` has the parameter's rows, `t` the padded ones
        return None
    CALLS["post"] += 1
    up = t.to(param_dtype)
    return up, (t, up)


def _int8_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    """int8 on the wire with this rank's scale as a second input (two dtypes in one gather)."""
    CALLS["pre"] += 1
    data = _plain(self)
    scale = (data.abs().amax() / 127).clamp(min=1e-8).reshape(1)
    q = torch.round(data / scale).clamp(-127, 127).to(torch.int8)
    return (q, scale), ("int8", tuple(outer_size))


def _int8_post(self, outputs, metadata, param_dtype, *, out=None):
    q, scales = outputs
    assert metadata[0] == "int8" and q.dtype == torch.int8 and q.shape[0] == metadata[1][0]
    deq = (q.view(scales.numel(), -1).float() * scales.view(-1, 1)).view(q.shape).to(param_dtype)
    if out is not None:
        CALLS["post_out"] += 1
        with torch.no_grad(), _unsafe_preserve_version_counter(out):
            out.copy_(deq)
        return None
    CALLS["post"] += 1
    return deq, (deq,)


class _Wrapped(torch.Tensor):
    """A wrapper subclass holding `_data`; every op runs on the data and re-wraps."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*pytree.tree_map_only(cls, lambda x: x._data, args),
                   **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, outer_size, outer_stride):
        return inner["_data"]

    def __repr__(self):
        return f"{type(self).__name__}({self._data})"


class BF16Weight(_Wrapped):
    fsdp_pre_all_gather = _bf16_pre
    fsdp_post_all_gather = _bf16_post


class Int8Weight(_Wrapped):
    fsdp_pre_all_gather = _int8_pre
    fsdp_post_all_gather = _int8_post


HOOKS = {"bf16": (BF16Weight, _bf16_pre, _bf16_post), "int8": (Int8Weight, _int8_pre, _int8_post)}


# --- the scenario ------------------------------------------------------------------------------

def _model(dims: tuple[int, ...]) -> nn.Sequential:
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*[nn.Sequential(*layers[i : i + 2]) for i in range(0, len(layers), 2)])


def _train(impl, kind, how, dims, mesh_shape, mixed, no_sync):
    CALLS.update(pre=0, post=0, post_out=0)
    torch.manual_seed(0)
    model = _model(dims)
    cls, pre, post = HOOKS[kind]
    if how == "type":
        for block in model:
            block[0].weight = nn.Parameter(cls(block[0].weight.detach().clone()))
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh(rank_device_type(), mesh_shape, mesh_dim_names=names)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mixed else None)
    fs = IMPLS[impl]
    for block in model:
        fs(block, mesh=mesh, mp_policy=mp)
    fs(model, mesh=mesh, mp_policy=mp)
    if how == "local":  # set on the sharded local tensors after fully_shard, as torch's tests do
        for block in model:
            local = block[0].weight._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    losses, grads = [], []
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        if no_sync:
            model.set_requires_gradient_sync(False)
            model(torch.randn(4, dims[0])).sum().backward()
            model.set_requires_gradient_sync(True)
        loss = model(torch.randn(4, dims[0])).sum()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    weights = {}  # the hooked weights: torch's Shard(0) chunks on both, compared per rank
    for n, p in model.named_parameters():
        if n.endswith("0.weight"):
            assert isinstance(p, DTensor) and p.placements[-1] == Shard(0), (n, p.placements)
            weights[n] = _plain(p.to_local()).detach().clone()
    biases = {n: _full(p) for n, p in model.named_parameters() if not n.endswith("0.weight")}
    return losses, grads, weights, biases, dict(CALLS)


CASES = {  # kind, how, dims (uneven rows for bf16), mesh, mixed precision, no-sync micro-batch
    "bf16-type": ("bf16", "type", (8, 5, 7, 3), (2,), False, False),
    "bf16-type-mp-no-sync": ("bf16", "type", (8, 5, 7, 3), (2,), True, True),
    "int8-type": ("int8", "type", (8, 8, 6, 4), (2,), False, False),
    "bf16-local": ("bf16", "local", (8, 5, 7, 3), (2,), False, False),
    "int8-local-hsdp": ("int8", "local", (8, 8, 6, 4), (2, 2), False, False),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_bitwise(case):
    kind, how, dims, mesh_shape, mixed, no_sync = CASES[case]
    world = math.prod(mesh_shape)
    pool = get_pool(world)
    ref = pool.run(_train, "torch", kind, how, dims, mesh_shape, mixed, no_sync, timeout=240)
    res = pool.run(_train, "veragged", kind, how, dims, mesh_shape, mixed, no_sync, timeout=240)
    for rank in range(world):
        (l_t, g_t, w_t, b_t, c_t), (l_v, g_v, w_v, b_v, c_v) = ref[rank], res[rank]
        for a, b in zip(l_t, l_v):
            assert torch.equal(a, b), (rank, l_t, l_v)
        for a, b in zip(g_t, g_v):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), (rank, k)
        for a, b in ((w_t, w_v), (b_t, b_v)):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), (rank, k)
        assert c_v["pre"] > 0 and c_v["post_out"] > 0
        assert c_v == c_t  # the same hook calls as torch's


def _late_hooks():
    torch.manual_seed(0)
    model = _model((8, 4, 2))
    for block in model:
        IMPLS["veragged"](block)
    IMPLS["veragged"](model)
    model(torch.randn(2, 8)).sum().backward()
    local = model[0][0].weight._local_tensor
    local.fsdp_pre_all_gather = _bf16_pre.__get__(local)
    local.fsdp_post_all_gather = _bf16_post.__get__(local)
    with pytest.raises(RuntimeError, match=r"'0\.weight'.*fsdp_pre_all_gather"):
        model(torch.randn(2, 8))
    return True


def _half_pair():
    class PreOnly(_Wrapped):
        fsdp_pre_all_gather = _bf16_pre

    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(PreOnly(lin.weight.detach().clone()))
    with pytest.raises(ValueError, match="'weight'.*fsdp_post_all_gather"):
        IMPLS["veragged"](lin)
    return True


@pytest.mark.timeout(120)
def test_bad_hooks_raise_naming_the_parameter():
    pool = get_pool(2)
    assert all(pool.run(_late_hooks, timeout=60))
    assert all(pool.run(_half_pair, timeout=60))


def _state_dict_round_trip(assign: bool):
    CALLS.update(pre=0, post=0, post_out=0)
    torch.manual_seed(0)
    model = _model((8, 5, 3))
    for block in model:
        block[0].weight = nn.Parameter(BF16Weight(block[0].weight.detach().clone()))
        IMPLS["veragged"](block)
    IMPLS["veragged"](model)
    params = list(model.parameters())
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = {k: _plain(v.to_local()).clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in params:
            p.fill_(3.0)
    model.load_state_dict(sd, assign=assign)
    after = {k: _plain(v.to_local()) for k, v in model.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(a is b for a, b in zip(params, model.parameters()))  # the objects stay
    model(torch.randn(2, 8)).sum().backward()  # still gathered through the hooks
    assert CALLS["pre"] > 0 and all(p.grad is not None for p in model.parameters())
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("assign", [False, True])
def test_state_dict_round_trip(assign):
    assert all(get_pool(2).run(_state_dict_round_trip, assign, timeout=60))
