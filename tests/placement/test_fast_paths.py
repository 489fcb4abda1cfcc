"""torch's fast paths on `veragged.fully_shard` parameters (issue 11, deliverable 1).

- Optimizers: `torch.optim.AdamW`/`Adam`/`SGD` with default arguments take their foreach path
  (`_multi_tensor_*`, asserted by patching) and with `fused=True` their fused path; the
  parameters after three steps equal torch's `fully_shard` with the same optimizer to fp32
  round-off (the gradients come out of different reduce-scatter layouts).
- Clipping: `clip_grad_norm_` and `get_total_norm` issue one all-reduce for all parameters (per
  mesh dim that shards: one on a 1-D mesh and on HSDP), counted by `CommDebugMode`, and no host
  sync (`aten._local_scalar_dense`, `Tensor.tolist`), as torch's `fully_shard` (checked in the
  same runs); also with plain `Shard(1)` DTensor parameters next to RaggedShard ones.
- The ops fast path ([Note: the ops fast path]) is taken by the optimizer step and clipping
  (the general path's unwrap patched to raise), and gives what the general path gives.
"""

from __future__ import annotations

import math
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import veragged
from veragged import RaggedShard
from veragged.placement import ops
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}
MESHES = {"1d": (2,), "hsdp": (2, 2)}


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Net(nn.Module):
    def __init__(self, n=2, dim=8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _dim1_for_matrices(p):
    return Shard(1) if p.ndim == 2 else Shard(0)


def _model(impl, mesh_shape, mixed):
    torch.manual_seed(0)
    model = Net()
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh(rank_device_type(), mesh_shape, mesh_dim_names=names)
    kw = {"mesh": mesh}
    if mixed:  # 2-D weights as torch's plain Shard(1) DTensors, the rest RaggedShard
        kw["shard_placement_fn"] = _dim1_for_matrices
    for b in model.blocks:
        IMPLS[impl](b, **kw)
    IMPLS[impl](model, **kw)
    return model


def _data(step):
    g = torch.Generator().manual_seed(100 + step + 7 * dist.get_rank())
    return torch.randn(3, 4, generator=g)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


# --- optimizers ---------------------------------------------------------------------------------

# (optimizer, keyword arguments, module, the function its arguments must select)
OPTIMIZERS = {
    "AdamW": ({}, "adam", "_multi_tensor_adam"),
    "Adam": ({}, "adam", "_multi_tensor_adam"),
    "SGD": ({}, "sgd", "_multi_tensor_sgd"),
    "AdamW-fused": ({"fused": True}, "adam", "_fused_adam"),
    "Adam-fused": ({"fused": True}, "adam", "_fused_adam"),
    "SGD-fused": ({"fused": True}, "sgd", "_fused_sgd"),
}
_PATHS = {
    "adam": ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"),
    "sgd": ("_single_tensor_sgd", "_multi_tensor_sgd", "_fused_sgd"),
}


def _foreach_on_cpu():
    """torch's foreach default is for devices with foreach kernels (cuda, ...), not cpu, for any
    tensor type; this makes cpu one, so the default depends on the parameter types only, as on
    CUDA."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices as devices

    return mock.patch(
        "torch.optim.optimizer._get_foreach_kernels_supported_devices",
        lambda: [*devices(), "cpu"],
    )


def _optimize(impl, mixed):
    import importlib

    types = {type(p).__name__ for p in _model(impl, (2,), mixed).parameters()}
    res = {"types": types}
    for name, (kw, module, _) in OPTIMIZERS.items():
        model = _model(impl, (2,), mixed)
        cls = getattr(torch.optim, name.split("-")[0])
        opt = cls(model.parameters(), lr=0.05, **kw)
        mod = importlib.import_module(f"torch.optim.{module}")
        calls = Counter()
        try:
            with _foreach_on_cpu(), mock.patch.multiple(mod, **{
                f: mock.Mock(wraps=getattr(mod, f)) for f in _PATHS[module]
            }):
                mocks = {f: getattr(mod, f) for f in _PATHS[module]}
                for step in range(3):
                    model(_data(step)).sum().backward()
                    opt.step()
                    opt.zero_grad()
            calls.update({f: m.call_count for f, m in mocks.items()})
            res[name] = (dict(calls), {n: _full(p) for n, p in model.named_parameters()})
        except NotImplementedError as e:
            res[name] = ("raised", str(e))
    return res


@pytest.mark.parametrize("mixed", [False, True], ids=["ragged", "ragged+shard1"])
def test_optimizers_take_foreach_and_fused_paths(mixed):
    got = get_pool(2).run(_optimize, "veragged", mixed)
    want = get_pool(2).run(_optimize, "torch", mixed)
    for rank in range(2):
        g, w = got[rank], want[rank]
        assert "RaggedDTensor" in g["types"] and ("DTensor" in g["types"]) == mixed, g["types"]
        for name, (_, module, path) in OPTIMIZERS.items():
            if name == "SGD-fused" and mixed:
                # torch's DTensor has no sharding strategy for aten._fused_sgd_: the Shard(1)
                # parameters raise torch's error, under either fully_shard.
                for res in (g[name], w[name]):
                    assert res[0] == "raised" and "_fused_sgd_" in res[1], res
                continue
            assert g[name][0] != "raised", (name, g[name])
            calls, params = g[name]
            assert calls[path] == 3 and sum(calls.values()) == 3, (name, calls)
            # torch's fully_shard with its fused SGD raises (above); its foreach SGD is the peer.
            ref = w["SGD" if name == "SGD-fused" else name]
            assert ref[0] != "raised", (name, ref)
            if name != "SGD-fused":
                assert ref[0][path] == 3, (name, ref[0])
            for k in params:
                torch.testing.assert_close(params[k], ref[1][k], rtol=1e-5, atol=1e-6, msg=k)


def _defaults():
    """`_default_to_fused_or_foreach` on our parameters decides as on torch's DTensors."""
    from torch.optim.optimizer import _default_to_fused_or_foreach as decide

    ragged = list(_model("veragged", (2,), False).parameters())
    plain = list(_model("torch", (2,), False).parameters())
    res = {}
    for label, patch in (("cpu", None), ("foreach-device", _foreach_on_cpu())):
        if patch is not None:
            patch.start()
        try:
            res[label] = (decide(ragged, False, use_fused=False), decide(plain, False, False),
                          decide(ragged, False, use_fused=True))
        finally:
            if patch is not None:
                patch.stop()
    return res


def test_default_foreach_decision_matches_torch_dtensor():
    res = get_pool(2).run(_defaults)[0]
    # On cpu torch defaults to the per-tensor loop for every tensor type (and to fused when
    # asked); on a foreach device to foreach; our parameters decide as torch's DTensors.
    assert res["cpu"] == ((False, False), (False, False), (True, False)), res
    assert res["foreach-device"] == ((False, True), (False, True), (True, False)), res


# --- clipping -----------------------------------------------------------------------------------


class _HostSyncs(TorchDispatchMode):
    """Counts `aten._local_scalar_dense` (`.item()`, `bool(t)`, `float(t)`) and `Tensor.tolist`."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._tolist = mock.patch.object(torch.Tensor, "tolist", self._counted(torch.Tensor.tolist))

    def _counted(self, fn):
        def tolist(t, *a, **k):
            self.count += 1
            return fn(t, *a, **k)

        return tolist

    def __enter__(self):
        self._tolist.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._tolist.stop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _counts(comm: CommDebugMode) -> dict:
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def _clip(impl, mesh_shape, mixed):
    model = _model(impl, mesh_shape, mixed)
    model(_data(0)).sum().backward()
    params = list(model.parameters())
    res = {"placements": sorted({str(p.placements) for p in params})}
    with CommDebugMode() as comm, _HostSyncs() as syncs:
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
    res["total"] = (_full(total), _counts(comm), syncs.count)
    with CommDebugMode() as comm, _HostSyncs() as syncs:
        clipped = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    res["clip"] = (_full(clipped), _counts(comm), syncs.count)
    res["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
    return res


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("mixed", [False, True], ids=["ragged", "ragged+shard1"])
def test_clip_grad_norm_one_all_reduce_no_host_sync(mesh, mixed):
    """The norm and clipped gradients equal torch's fully_shard to fp32 round-off, not bitwise:
    each rank holds other elements (RaggedShard rows vs torch's dim-0 chunks), so the partial
    sums of squares and the order of the final sum differ."""
    world = math.prod(MESHES[mesh])
    got = get_pool(world).run(_clip, "veragged", MESHES[mesh], mixed)
    want = get_pool(world).run(_clip, "torch", MESHES[mesh], mixed)
    all_reduce = str(torch.ops.c10d_functional.all_reduce)
    for rank in range(world):
        g, w = got[rank], want[rank]
        assert any("RaggedShard" in p for p in g["placements"]), g["placements"]
        assert any("Shard(dim=1)" in p for p in g["placements"]) == mixed, g["placements"]
        for key in ("total", "clip"):
            value, comms, syncs = g[key]
            # One all-reduce for all parameters (the shard mesh dim; HSDP's replicate dim holds
            # the same values), and no host sync: as torch's fully_shard.
            assert comms == {all_reduce: 1} and syncs == 0, (key, comms, syncs)
            assert (w[key][1], w[key][2]) == (comms, syncs), (key, w[key])
            torch.testing.assert_close(value, w[key][0], rtol=1e-6, atol=0)
        for k, grad in g["grads"].items():
            torch.testing.assert_close(grad, w["grads"][k], rtol=1e-5, atol=1e-7, msg=k)


# --- the ops fast path --------------------------------------------------------------------------


def _no_general_path():
    """A step of AdamW (foreach and fused), SGD and clipping on a veragged model, with the
    general path's unwrap raising: every op on a RaggedShard DTensor took the fast path."""
    model = _model("veragged", (2,), False)
    results = {}
    for name, kw in (("adamw", {"foreach": True}), ("fused", {"fused": True}),
                     ("sgd", {"foreach": False, "momentum": 0.9})):
        opt = (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(
            model.parameters(), lr=0.01, **kw
        )
        model(_data(0)).sum().backward()
        opt.step()  # the first step creates the state (zeros_like: the general path)
        model(_data(1)).sum().backward()
        with mock.patch.object(ops, "_unwrap", side_effect=AssertionError("general path")), \
             mock.patch.object(DTensor, "from_local", side_effect=AssertionError("from_local")):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            opt.zero_grad()
        results[name] = True
    return results


def test_optimizer_step_and_clipping_take_the_fast_path():
    for res in get_pool(2).run(_no_general_path):
        assert res == {"adamw": True, "fused": True, "sgd": True}, res


def _fast_matches_general():
    """The same ops through the fast path and through the general path (the fast path off)."""
    from veragged.placement import fastpath

    mesh = init_device_mesh(rank_device_type(), (2,))
    g = torch.Generator().manual_seed(3)
    fulls = [torch.randn(s, generator=g) for s in ((6, 4), (5,), (3, 3))]
    places = [RaggedShard((0,), (1, 2)), RaggedShard((), (0, 1)), RaggedShard((0, 1), (4, 5))]

    def make(fs):  # new placement objects each time: equal layouts, different specs
        return [veragged.distribute_tensor(f.clone(), mesh, [type(p)(p.dims, p.local_units)])
                for f, p in zip(fs, places)]

    rep = DTensor.from_local(torch.tensor(0.5), mesh, [Replicate()])

    def program(xs, ys):
        out = []
        for x, y in zip(xs, ys):
            z = x.abs() + 1
            out += [x / 2, 2 / z, x * rep, z ** 0.5, 2 ** x, torch.sqrt(z), x - y, -x]
            w = x.clone()
            w += y
            w.addcdiv_(y, z, value=0.1).lerp_(y, 0.25).mul_(torch.tensor(3.0))
            out += [w, torch.add(x, y, alpha=2, out=torch.empty_like(x))]
            out.append(torch.zeros_like(x, dtype=torch.float64).add_(x))
        zs = [x.abs() + 1 for x in xs]
        torch._foreach_add_(xs, ys, alpha=0.5)
        torch._foreach_lerp_(xs, ys, 0.1)
        steps = [torch.tensor(float(i + 1)) for i in range(len(xs))]  # 0-dim plain (Adam's)
        torch._foreach_add_(xs, steps)
        out += xs + list(torch._foreach_sqrt(zs)) + list(torch._foreach_mul(xs, [1.0, 2.0, 3.0]))
        out += list(torch._foreach_norm(xs))
        return [_full(o) for o in out], [type(o) for o in out]

    fast = program(make(fulls), make([f * 2 for f in fulls]))
    with mock.patch.object(fastpath, "elementwise", return_value=fastpath.SLOW), \
         mock.patch.object(fastpath, "per_position", return_value=fastpath.SLOW):
        general = program(make(fulls), make([f * 2 for f in fulls]))
    return fast[1] == general[1] and all(torch.equal(a, b) for a, b in zip(fast[0], general[0]))


def test_fast_path_matches_the_general_path():
    assert all(get_pool(2).run(_fast_matches_general))
