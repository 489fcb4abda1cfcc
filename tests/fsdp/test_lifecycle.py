"""Regression tests for the fully_shard lifecycle ([Note: fully_shard lifecycle]).

Each scenario runs the same script under torch's `fully_shard` and `veragged.fully_shard` on 2
gloo ranks (a persistent rank pool) and compares gradients and parameters; each failed on the
runtime before the lifecycle rewrite.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import _is_fully_sharded
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as TorchFSDPState
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import veragged
from tests.harness.pool import get_pool

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}

# What torch's fully_shard does differs across the supported versions (2.11 to 2.15); where the
# installed one lacks a behaviour, the torch side of a comparison works around it or is left out.
# torch 2.11 has no `set_reduce_scatter_unused_params` (ranks reaching different parameters issue
# different reduce-scatters and hang).
TORCH_HAS_UNUSED_PARAMS_MODE = hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params")
# torch 2.11 finds a module output's tensors for its pre-backward hook with pytree's tree_flatten,
# which does not look into dataclasses: a sharded block returning one keeps its parameters freed
# in backward ("setStorage: ... out of bounds for storage of size 0"); later versions use
# `_apply_to_tensors`, which does.
TORCH_HOOKS_DATACLASS_OUTPUTS = (
    "_apply_to_tensors" in TorchFSDPState._register_pre_backward_hook.__code__.co_names
)
# torch 2.11 accepts a parameter tied across two fully_shard groups; later versions raise at
# lazy init (`FSDPState._validate_no_duplicate_params`).
TORCH_REJECTS_TIED_ACROSS_GROUPS = hasattr(TorchFSDPState, "_validate_no_duplicate_params")


def _gather_every_group_once(model, impl, **forward_kwargs):
    """torch 2.11's FSDP2 reads `FSDPParam._unsharded_param` of every group when a backward with
    gradient sync off ends and `reduce_dtype` is set (`to_accumulated_grad_if_needed`), an
    AttributeError for a group never all-gathered (a module not reached yet); later versions
    check. On the torch side only: one forward without grad reaching every module gathers each
    group once first (no gradients, the same values)."""
    if impl == "torch":
        with torch.no_grad():
            model(_data(0), **forward_kwargs)


def _full(t):
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _grads(model):
    return {n: _full(p.grad) for n, p in model.named_parameters()}


def _params(model):
    return {n: _full(p) for n, p in model.named_parameters()}


def _same(a: dict, b: dict, atol=0.0):
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, (k, a[k], b[k])
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self, n=3, dim=8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.extra = Block(dim)  # used only when asked
        self.out = nn.Linear(dim, 2)

    def forward(self, x, use_extra=False, ckpt=False):
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if ckpt else b(h)
        if use_extra:
            h = self.extra(h)
        return self.out(h)


def _shard(model, impl, **kw):
    fs = IMPLS[impl]
    for b in [*model.blocks, model.extra]:
        fs(b, **kw)
    fs(model, **kw)
    return model


def _data(step, rank=None):
    g = torch.Generator().manual_seed(100 + step + (0 if rank is None else 7 * rank))
    return torch.randn(3, 4, generator=g)


def _run_both(fn, *args):
    results = {}
    for impl in IMPLS:
        results[impl] = get_pool(2).run(fn, impl, *args)
    return results


# --- frozen parameters -------------------------------------------------------------------------

def _frozen(impl):
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        b.norm.weight.requires_grad_(False)  # frozen weight inside a sharded block
    model.out.bias.requires_grad_(False)
    _shard(model, impl)
    model.inp.weight.requires_grad_(False)  # changed after fully_shard
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(3):
        model(_data(step, dist.get_rank())).sum().backward()
        grads = _grads(model)
        optim.step()
        optim.zero_grad()
    return grads, _params(model)


def test_frozen_parameters_match_torch():
    res = _run_both(_frozen)
    for rank in range(2):
        (g_t, p_t), (g_v, p_v) = res["torch"][rank], res["veragged"][rank]
        assert g_v["blocks.0.norm.weight"] is None and g_v["inp.weight"] is None
        assert g_v["out.bias"] is None
        _same(g_t, g_v, atol=1e-6)
        _same(p_t, p_v, atol=1e-5)


# --- a module used only from the second step on; ranks using different parameters -------------

def _late(impl):
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    out = []
    for step in range(3):
        model(_data(step, dist.get_rank()), use_extra=step >= 1).sum().backward()
        out.append(_grads(model))
        model.zero_grad(set_to_none=True)
    return out


def test_module_used_late_gets_gradients():
    res = _run_both(_late)
    for rank in range(2):
        for g_t, g_v in zip(res["torch"][rank], res["veragged"][rank]):
            _same(g_t, g_v, atol=1e-6)
        assert res["veragged"][rank][0]["extra.lin.weight"] is None
        assert res["veragged"][rank][1]["extra.lin.weight"] is not None


class Reused(Net):
    """One block run three times in one forward: three backwards of it, one step."""

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = self.blocks[0](h)
            with torch.no_grad():
                h += self.blocks[0](h)  # in place: h keeps its autograd history
        return self.out(h)


def _reused(impl, reshard):
    torch.manual_seed(0)
    model = _shard(Reused(), impl, reshard_after_forward=reshard)
    out = []
    for step in range(2):
        model(_data(step, dist.get_rank())).sum().backward()
        out.append(_grads(model))
        model.zero_grad(set_to_none=step == 0)
    return out


@pytest.mark.parametrize("reshard", [True, False])
def test_module_used_several_times_in_one_forward(reshard):
    res = _run_both(_reused, reshard)
    for rank in range(2):
        assert res["veragged"][rank][0]["blocks.0.lin.weight"] is not None
        for g_t, g_v in zip(res["torch"][rank], res["veragged"][rank]):
            _same(g_t, g_v, atol=1e-6)


class Experts(nn.Module):
    """Two experts in one sharded block; each rank routes to one of them only."""

    def __init__(self, dim=8):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, dim)

    def forward(self, x):
        return self.a(x) if dist.get_rank() == 0 else self.b(x)


def _moe(impl, unused_mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Experts(), nn.Linear(8, 2))
    fs = IMPLS[impl]
    fs(model[1])
    fs(model)
    if unused_mode:
        model.set_reduce_scatter_unused_params(True)
    for step in range(2):
        model(_data(step, dist.get_rank())).sum().backward()
    local = {n: None if p.grad is None else p.grad.to_local().clone()
             for n, p in model.named_parameters()}
    # full tensors only where every rank has a gradient (a collective per parameter)
    return (_grads(model) if unused_mode else None), local


def test_ranks_using_different_parameters():
    # The reduce-scatters are the same on every rank whatever each rank's data reached (torch's
    # differ and hang unless set_reduce_scatter_unused_params(True)). In that mode veragged
    # matches torch; in the default mode every rank holding part of a parameter some rank
    # reached gets the same gradient, and the parameter no rank reached keeps None
    # ([Note: unreached parameters]).
    torch_res = get_pool(2).run(_moe, "torch", True) if TORCH_HAS_UNUSED_PARAMS_MODE else None
    ours = get_pool(2).run(_moe, "veragged", False)
    ours_unused = get_pool(2).run(_moe, "veragged", True)
    for rank in range(2):
        (_, v), (vu_full, vu) = ours[rank], ours_unused[rank]
        if TORCH_HAS_UNUSED_PARAMS_MODE:
            t = torch_res[rank][0]
            _same(t, vu_full, atol=1e-6)
            assert torch.count_nonzero(t["1.unused.weight"]) == 0
        for name, g in v.items():
            if "unused" in name:
                assert g is None or g.numel() == 0, name
            elif g is not None and vu[name] is not None:
                torch.testing.assert_close(g, vu[name], atol=0, rtol=0, msg=name)
        held = [n for n, g in vu.items() if g is not None and g.numel() and "unused" not in n]
        assert all(v[n] is not None for n in held), (rank, held)


# --- activation checkpointing, two forwards before one backward, dataclass outputs -----------

def _checkpointed(impl):
    torch.manual_seed(0)
    model = _shard(Net(n=6), impl)
    peak = [0]
    if impl == "veragged":
        groups = [g for m in model.modules() if hasattr(m, "_veragged_state")
                  for g in m._veragged_state.groups]

        def count(*_):
            peak[0] = max(peak[0], sum(g.buffer.is_unsharded for g in groups))

        for b in model.blocks:
            b.lin.register_forward_hook(count)
    x1, x2 = _data(0, dist.get_rank()), _data(1, dist.get_rank())
    loss = model(x1, ckpt=True).sum() - 0.5 * model(x2, ckpt=True).sum()  # DPO-like
    loss.backward()
    return _grads(model), peak[0]


def test_checkpoint_and_two_forwards():
    res = _run_both(_checkpointed)
    for rank in range(2):
        (g_t, _), (g_v, peak) = res["torch"][rank], res["veragged"][rank]
        _same(g_t, g_v, atol=1e-6)
        assert peak <= 3, peak  # root + the block being recomputed (+ one prefetch)


@dataclasses.dataclass
class Out:
    h: torch.Tensor
    aux: torch.Tensor


class DataclassBlock(Block):
    def forward(self, x):
        h = super().forward(x)
        return Out(h, h.mean())


class DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 8), DataclassBlock(), nn.Linear(8, 2)

    def forward(self, x):
        o = self.block(self.inp(x))
        return self.out(o.h).sum() + o.aux


def _dataclass(impl):
    torch.manual_seed(0)
    model = DataclassNet()
    fs = IMPLS[impl]
    if impl != "torch" or TORCH_HOOKS_DATACLASS_OUTPUTS:
        fs(model.block)  # (else torch's reference shards the root only: the same gradients)
    fs(model)
    for step in range(2):
        model(_data(step, dist.get_rank())).backward()
    return _grads(model)


def test_dataclass_outputs():
    res = _run_both(_dataclass)
    for rank in range(2):
        _same(res["torch"][rank], res["veragged"][rank], atol=1e-6)


# --- tied parameters -----------------------------------------------------------------------------

def _tied(impl):
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    fs = IMPLS[impl]
    fs(emb)
    fs(head)
    fs(model)
    try:  # torch raises at lazy init, the first forward
        model(torch.randint(0, 10, (2, 3)))
        return "no error"
    except ValueError as e:
        return str(e)


def _tied_grouped(impl):
    torch.manual_seed(0)
    emb, mid, head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, mid, head)
    fs = IMPLS[impl]
    fs([emb, head])
    fs(model)
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids).sum().backward()
    return _grads(model), model[0].weight is model[2].weight


def test_tied_parameters():
    for impl in IMPLS if TORCH_REJECTS_TIED_ACROSS_GROUPS else ["veragged"]:
        msg = get_pool(2).run(_tied, impl)[0]
        assert "already managed by another" in msg, (impl, msg)
    assert "'weight'" in msg, msg  # veragged names the parameter
    res = _run_both(_tied_grouped)
    for rank in range(2):
        (g_t, tied_t), (g_v, tied_v) = res["torch"][rank], res["veragged"][rank]
        assert tied_t and tied_v
        _same(g_t, g_v, atol=1e-6)


# --- mixed precision accumulation ----------------------------------------------------------------

def _bf16_accumulation(impl):
    torch.manual_seed(0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard(Net(), impl, mp_policy=policy)
    _gather_every_group_once(model, impl, use_extra=True)
    for micro in range(4):
        model.set_requires_gradient_sync(micro == 3)
        model(_data(micro, dist.get_rank())).float().sum().backward()
    return _grads(model)


def test_no_sync_accumulates_in_reduce_dtype():
    res = _run_both(_bf16_accumulation)
    for rank in range(2):
        _same(res["torch"][rank], res["veragged"][rank], atol=1e-5)


def _bf16_unset_reduce_dtype(impl):
    torch.manual_seed(0)
    model = _shard(Net(), impl, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        model(_data(micro, dist.get_rank())).float().sum().backward()
    grads = _grads(model)
    return grads, {k: v.dtype for k, v in grads.items() if v is not None}


def test_unset_reduce_dtype_follows_torch():
    """MixedPrecisionPolicy(param_dtype=bf16) alone: torch 2.15 computes, reduces and keeps
    the gradients in fp32 (the parameters' dtype), torch 2.11 reduces in bf16; ours does what
    the torch it runs with does, to the bit on two ranks."""
    res = _run_both(_bf16_unset_reduce_dtype)
    from veragged.fsdp.api import _UNSET_REDUCE_DTYPE_IS_ORIG as orig_dtype_reduce
    for rank in range(2):
        (g_t, d_t), (g_v, d_v) = res["torch"][rank], res["veragged"][rank]
        assert d_t == d_v, (d_t, d_v)
        if orig_dtype_reduce:
            _same(g_t, g_v, atol=0)
        else:  # torch 2.11 reduces bf16 with ReduceOp.AVG, which gloo computes its own way
            # (ours: SUM of gradients pre-scaled by 1/2): a bf16 rounding of the summands
            # apart, so up to one bf16 ulp of the largest element
            for k in g_t:
                if g_t[k] is None or g_v[k] is None:
                    assert g_t[k] is None and g_v[k] is None, k
                    continue
                tol = 2**-7 * float(g_t[k].abs().max())
                torch.testing.assert_close(g_t[k], g_v[k], rtol=0, atol=tol, msg=k)


# --- interop and arguments -----------------------------------------------------------------------

def _interop(impl):
    torch.manual_seed(0)
    model = _shard(Net(), impl, reshard_after_forward=None)
    out = {"isinstance": isinstance(model, TorchFSDPModule),
           "one_class": type(model.blocks[0]) is type(model.blocks[1]),
           # what `replicate` asks to leave FSDP's parameters alone
           "composable_registry": _is_fully_sharded(model.blocks[0])}
    model(_data(0))
    # root keeps its parameters after forward (None: the root does not reshard)
    out["root_unsharded"] = not isinstance(model.inp.weight, DTensor)
    out["block_sharded"] = isinstance(model.blocks[0].lin.weight, DTensor)
    out["state_dict_sharded"] = all(isinstance(v, DTensor) for v in model.state_dict().values())
    return out


def test_interop_and_reshard_none():
    res = get_pool(2).run(_interop, "veragged")
    ref = get_pool(2).run(_interop, "torch")
    assert res == ref, (res, ref)
    assert all(res[0].values()), res


def _bad_inputs():
    errors = {}
    cases = {
        "non_module": lambda: veragged.fully_shard("model"),
        "twice": lambda: veragged.fully_shard(veragged.fully_shard(nn.Linear(2, 2))),
        "torch_sharded": lambda: veragged.fully_shard(torch_fully_shard(nn.Linear(2, 2))),
        "zero_dim": lambda: veragged.fully_shard(_ZeroDim()),
        "mesh": lambda: veragged.fully_shard(nn.Linear(2, 2), mesh="cpu"),
        "container": lambda: veragged.fully_shard(nn.ModuleList([nn.Linear(2, 2)])),
        "reshard_int": lambda: veragged.fully_shard(nn.Linear(2, 2), reshard_after_forward=3),
        "channels_last": lambda: veragged.fully_shard(
            nn.Conv2d(2, 2, 3).to(memory_format=torch.channels_last)
        ),
    }
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = None
        except (ValueError, NotImplementedError, AssertionError) as e:
            errors[name] = str(e)
    return errors


class _ZeroDim(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))


def test_bad_inputs_name_the_value():
    errors = get_pool(2).run(_bad_inputs)[0]
    assert "'model'" in errors["non_module"]
    assert "already applied" in errors["twice"]
    assert "torch.distributed.fsdp" in errors["torch_sharded"]
    assert "Change scale to a 1D tensor" in errors["zero_dim"]  # torch's wording
    assert "non-contiguous" in errors["channels_last"]
    assert "'cpu'" in errors["mesh"]
    assert "ModuleList" in errors["container"]
    assert "factor of 2, not 3" in errors["reshard_int"]  # torch's wording


# --- mixed dtypes, world of one ------------------------------------------------------------------

class WithInts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin64 = nn.Linear(4, 4).double()
        self.steps = nn.Parameter(torch.arange(6), requires_grad=False)

    def forward(self, x):
        return self.lin(x).double().sum() + self.lin64(x.double()).sum() + self.steps.sum()


def _dtypes(impl):
    torch.manual_seed(0)
    model = WithInts()
    veragged.fully_shard(model)
    model(_data(0)[:, :4]).backward()
    state = model._veragged_state
    return (len(state.groups), {n: _full(p.grad) for n, p in model.named_parameters()},
            _full(model.steps))


def test_one_dbuffer_per_dtype():
    n, grads, steps = get_pool(2).run(_dtypes, "veragged")[0]
    assert n == 3 and grads["steps"] is None and torch.equal(steps, torch.arange(6))
    assert grads["lin64.weight"].dtype == torch.float64


def _world_one():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [dist.get_rank()])
    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    _shard(model, "veragged", mesh=mesh)
    calls = []
    originals = {n: getattr(dist, n) for n in
                 ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}
    for n, f in originals.items():
        setattr(dist, n, lambda *a, _n=n, _f=f, **k: calls.append(_n) or _f(*a, **k))
    try:
        x = _data(0)
        model(x).sum().backward()
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    ref(x).sum().backward()
    return calls, _grads(model), _grads(ref)


def test_world_of_one_issues_no_collectives():
    calls, got, ref = get_pool(2).run(_world_one)[0]
    assert calls == []
    _same(ref, got)


@pytest.mark.parametrize("cast", ["double", "to_float64"])
def test_module_to_dtype_after_fully_shard(cast):
    res = _run_both(_cast_after, cast)
    for rank in range(2):
        _same(res["torch"][rank], res["veragged"][rank], atol=1e-10)


def _cast_after(impl, cast):
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    model = model.double() if cast == "double" else model.to(torch.float64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_data(step, dist.get_rank()).double()).sum().backward()
        optim.step()
        optim.zero_grad()
    return _params(model)


def _meta_init(impl):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    _shard(model, impl)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.reset_parameters()
    torch.manual_seed(1)
    ref = Net()
    torch.manual_seed(1)
    for m in ref.modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.reset_parameters()
    model(_data(0)).sum().backward()
    return _params(model), _params(ref)


def test_meta_device_init():
    got, ref = get_pool(2).run(_meta_init, "veragged")[0]
    _same(ref, got)  # random init of sharded parameters equals one process's, bitwise


# --- reshard_after_forward=k: parameters kept sharded over k ranks between forward and backward

def _reshard_to_k(impl, k):
    torch.manual_seed(0)
    model = _shard(Net(), impl, reshard_after_forward=k)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    out, kept = [], []
    for step in range(3):
        if step == 1:  # a step between a forward (no backward) and the next forward
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            with torch.no_grad():
                model(_data(9, dist.get_rank()))
            optim.step()
        loss = model(_data(step, dist.get_rank())).sum()
        if impl == "veragged":  # blocks keep 1/k of their parameters until backward
            kept.append(all(b._veragged_state.groups[0].buffer._post_forward is not None
                            for b in model.blocks))
        loss.backward()
        out.append(_grads(model))
        optim.step()
        optim.zero_grad()
    return out, _params(model), kept


def test_reshard_after_forward_to_a_smaller_world():
    # torch's reshard_after_forward=2 all-gathers its post-forward shards after that step,
    # values from before it (torch 2.15); veragged gathers them again from the updated shards,
    # so it is compared with torch's reshard_after_forward=True, which k must not change.
    ref = get_pool(4).run(_reshard_to_k, "torch", True)
    res = get_pool(4).run(_reshard_to_k, "veragged", 2)
    for rank in range(4):
        (g_t, p_t, _), (g_v, p_v, kept) = ref[rank], res[rank]
        assert kept == [True, True, True]
        for a, b in zip(g_t, g_v):
            _same(a, b, atol=1e-5)
        _same(p_t, p_v, atol=1e-5)


# --- a grouped fully_shard([norm, head]) whose head runs on its own (chunked loss) -------------

class ChunkedHead(nn.Module):
    def __init__(self, dim=16, vocab=40):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, skip_head=False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_head(impl, grouped, reshard):
    fs = IMPLS[impl]
    torch.manual_seed(0)
    m = ChunkedHead()
    fs(m.embed, reshard_after_forward=reshard)
    fs(m.body, reshard_after_forward=reshard)
    if grouped:
        fs([m.norm, m.head], reshard_after_forward=reshard)
    else:
        fs(m.norm, reshard_after_forward=reshard)
        fs(m.head, reshard_after_forward=reshard)
    fs(m, reshard_after_forward=reshard)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for i in range(3):  # gradient accumulation: sync on the last micro-batch only
        m.set_requires_gradient_sync(i == 2)
        m.set_is_last_backward(i == 2)
        h = m(torch.randint(0, 40, (2, 8), generator=g), skip_head=True)
        grads = []
        for chunk in torch.chunk(h.detach(), 2, dim=1):  # the head runs on its own per chunk
            chunk = chunk.contiguous().requires_grad_(True)
            m.head(chunk).sum().backward()
            grads.append(chunk.grad)
        h.backward(torch.cat(grads, dim=1))
    return _grads(m)


@pytest.mark.parametrize("reshard", [True, False])
def test_chunked_head_grouped_matches_torch(reshard):
    ref = get_pool(2).run(_chunked_head, "torch", False, reshard)
    for grouped in (False, True):
        res = get_pool(2).run(_chunked_head, "veragged", grouped, reshard)
        for rank in range(2):
            assert res[rank]["head.weight"] is not None
            _same(ref[rank], res[rank], atol=1e-5)


# --- a module the sync backward does not reach; a prefetch kept across backwards ---------------

def _unreached_in_sync_backward(impl):
    """Micro-batch 0 (no gradient sync) uses `extra`, micro-batch 1 (sync) does not: torch's
    end-of-backward callback runs post-backward on `extra`'s group too and reduces the gradients
    micro-batch 0 left in it."""
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    out = []
    for step in range(2):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x = _data(2 * step + micro, dist.get_rank())
            model(x, use_extra=micro == 0).sum().backward()
        out.append(_grads(model))
        optim.step()
        optim.zero_grad()
    return out, _params(model)


def test_no_sync_gradients_of_a_module_the_sync_backward_skips():
    res = _run_both(_unreached_in_sync_backward)
    for rank in range(2):
        (g_t, p_t), (g_v, p_v) = res["torch"][rank], res["veragged"][rank]
        assert g_v[0]["extra.lin.weight"] is not None
        for a, b in zip(g_t, g_v):
            _same(a, b, atol=1e-6)
        _same(p_t, p_v, atol=1e-6)


class Split(nn.Module):
    """A shared first layer, then two heads whose losses go through separate backwards."""

    def __init__(self, dim=8):
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.first(x)
        return self.a(h), self.b(h)


def _prefetch_across_step(scale):
    """Micro-batch 0's backward goes through `b` only; `b`'s pre-backward prefetches `a` (the
    module before it in forward), which that backward does not use, and a non-last backward
    keeps the prefetch (as torch keeps it). Between micro-batches the user scales `a`'s weight
    in place: the next forward must all-gather again, not use the kept prefetch."""
    torch.manual_seed(0)
    model = Split()
    for m in (model.first, model.a, model.b, model):
        veragged.fully_shard(m)
    outs = []
    for micro in range(2):
        model.set_is_last_backward(micro == 1)
        out_a, out_b = model(_data(micro, dist.get_rank()).repeat(1, 2))
        outs.append(out_a.detach().clone())
        (out_b if micro == 0 else out_a).square().sum().backward()
        with torch.no_grad():
            model.a.weight.mul_(scale)
    return outs, _grads(model)


def _prefetch_reference(rank, scale):
    """The same micro-batches without FSDP on one process: the gradient is the mean over both
    ranks' losses."""
    torch.manual_seed(0)
    model = Split()
    outs = []
    for micro in range(2):
        loss = 0
        for r in range(2):
            out_a, out_b = model(_data(micro, r).repeat(1, 2))
            if r == rank:
                outs.append(out_a.detach().clone())
            loss = loss + (out_b if micro == 0 else out_a).square().sum() / 2
        loss.backward()
        with torch.no_grad():
            model.a.weight.mul_(scale)
    return outs, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_prefetch_kept_across_a_backward(scale):
    res = get_pool(2).run(_prefetch_across_step, scale)
    for rank in range(2):
        (outs, grads), (ref_outs, ref_grads) = res[rank], _prefetch_reference(rank, scale)
        for got, want in zip(outs, ref_outs):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        _same(grads, ref_grads, atol=1e-5)


# --- set_keep_unsharded_storage ----------------------------------------------------------------

def _keep_storage(impl):
    """Training with the unsharded memory kept across reshards: the same numbers as without,
    the same data pointers every iteration (torch 2.11 has no such method: its side runs
    without it, which gives the same numbers)."""
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    if hasattr(model, "set_keep_unsharded_storage"):
        model.set_keep_unsharded_storage(True)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    ptrs, kept = [], []
    for step in range(3):
        model(_data(step, dist.get_rank()), use_extra=True).sum().backward()
        optim.step()
        optim.zero_grad()
        if impl == "veragged":
            groups = model._groups(recurse=True)
            kept.append(all(not g.is_unsharded and g.buffer._unsharded.untyped_storage().size()
                            for g in groups))
            ptrs.append([g.buffer._unsharded.data_ptr() for g in groups])
    if impl == "veragged":  # off again: the memory goes at once
        model.set_keep_unsharded_storage(False)
        kept.append(all(g.buffer._unsharded.untyped_storage().size() == 0
                        for g in model._groups(recurse=True)))
    return _params(model), kept, all(p == ptrs[0] for p in ptrs)


def test_keep_unsharded_storage():
    res = _run_both(_keep_storage)
    for rank in range(2):
        (p_t, _, _), (p_v, kept, same_ptrs) = res["torch"][rank], res["veragged"][rank]
        _same(p_t, p_v, atol=1e-6)
        assert all(kept) and same_ptrs


# --- manual backward finalization (torch 2.15; torch's pipelining stages use it) ---------------

TORCH_HAS_MANUAL_FINALIZATION = hasattr(TorchFSDPModule, "finalize_backward")


def _manual_finalization(impl):
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    out, errors = [], []
    for step in range(3):
        manual = step < 2
        model.set_manual_backward_finalization(manual)
        for micro in range(2):
            model.set_requires_gradient_sync(not manual or micro == 1)
            x = _data(2 * step + micro, dist.get_rank())
            model(x, use_extra=micro == 0).sum().backward()
        if manual:
            model.set_requires_gradient_sync(True)
            handle = model.finalize_backward(async_op=step == 1)
            if handle is not None:
                try:
                    model(_data(0))
                except RuntimeError as e:
                    errors.append(str(e))
                handle.wait()
        out.append(_grads(model))
        optim.step()
        optim.zero_grad()
    model.set_manual_backward_finalization(False)
    try:
        model.finalize_backward()
    except RuntimeError as e:
        errors.append(str(e))
    return out, _params(model), errors


@pytest.mark.skipif(not TORCH_HAS_MANUAL_FINALIZATION, reason="torch 2.15's FSDP2 API")
def test_manual_backward_finalization():
    res = _run_both(_manual_finalization)
    for rank in range(2):
        (g_t, p_t, e_t), (g_v, p_v, e_v) = res["torch"][rank], res["veragged"][rank]
        for a, b in zip(g_t, g_v):
            _same(a, b, atol=1e-6)
        _same(p_t, p_v, atol=1e-6)
        assert e_v == e_t and len(e_v) == 2, (e_t, e_v)


def _kept_grads(impl):
    """A reference kept to a `.grad` across `zero_grad(set_to_none=True)` and the next backward
    keeps its values (torch's FSDP2 writes each backward's gradients into new memory)."""
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    model(_data(0, dist.get_rank())).sum().backward()
    kept = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    before = {n: _full(g) for n, g in kept.items()}
    model.zero_grad(set_to_none=True)
    model(_data(1, dist.get_rank())).sum().backward()
    return all(torch.equal(_full(g), before[n]) for n, g in kept.items())


def test_kept_gradient_references_keep_their_values():
    res = _run_both(_kept_grads)
    assert all(res["torch"]) and all(res["veragged"])
