"""What torch's own code reads off a DTensor, answered by a RaggedDTensor as by torch's DTensor.

[Note: a RaggedDTensor has no storage] (veragged/placement/tensor.py): `data_ptr()` 0 and the
wrapper's `untyped_storage()` (DCP's stager tells wrappers from plain tensors by them), pickling
as torch's wrapper subclasses (local shard and spec, `torch.load(weights_only=True)` included),
and `copy.deepcopy` with `.grad` and `__dict__`. Each is checked beside torch's DTensor on the
same ranks, with a local shard at a nonzero storage offset (as a DBuffer's are) among ours.
"""

from __future__ import annotations

import copy
import io

import torch
from torch.distributed.tensor import Shard, distribute_tensor

import veragged
from tests.harness import get_mesh, run_on_ranks
from veragged import RaggedDTensor, RaggedShard

FULL = torch.arange(24.0).reshape(6, 4)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 (the type is what is compared)
        return ("raises", type(e).__name__)


def _tensors():
    mesh = get_mesh()
    ours = veragged.distribute_tensor(FULL, mesh, [RaggedShard((0,), (1, 2))])
    local = ours._local_tensor
    base = torch.full((local.numel() + 8,), float("nan"))
    base[8:].copy_(local)
    at_offset = veragged.DTensor.from_local(base[8:], mesh, ours.placements, shape=FULL.shape,
                                            stride=FULL.stride())
    theirs = distribute_tensor(FULL, mesh, [Shard(0)])
    return ours, at_offset, theirs


def _storage() -> dict:
    ours, at_offset, theirs = _tensors()
    out = {}
    for name, x in (("ours", ours), ("at_offset", at_offset), ("theirs", theirs)):
        out[name] = {
            "data_ptr": x.data_ptr(),
            "storage nbytes": x.untyped_storage().nbytes(),
            "storage data_ptr": _outcome(lambda x=x: x.untyped_storage().data_ptr()),
        }
    out["offset of the local"] = at_offset._local_tensor.storage_offset()
    return out


def test_data_ptr_and_storage_as_torch_dtensor():
    for res in run_on_ranks(_storage, 2, timeout=120):
        assert res["offset of the local"] == 8
        assert res["ours"] == res["theirs"], res
        # the wrapper's (empty) storage spans the local offset too, as a torch DTensor's would
        assert {k: v for k, v in res["at_offset"].items() if k != "storage nbytes"} == {
            k: v for k, v in res["theirs"].items() if k != "storage nbytes"}, res
        assert res["ours"]["data_ptr"] == 0


def _grad_accumulates(x: torch.Tensor) -> bool:
    """Two backward passes through the local shard add up in `x.grad`, which stays ragged."""
    for _ in range(2):
        (x.to_local() * 3).sum().backward()
    return type(x.grad) is RaggedDTensor and torch.equal(
        x.grad.to_local(), torch.full_like(x.to_local(), 6.0))


def _pickle_and_copy() -> dict:
    ours, at_offset, _ = _tensors()
    out = {}
    for weights_only in (True, False):
        buf = io.BytesIO()
        param = torch.nn.Parameter(at_offset.detach().clone())
        param.tag = "kept"
        torch.save({"value": at_offset, "param": param}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=weights_only)
        value, p = loaded["value"], loaded["param"]
        out[f"weights_only={weights_only}"] = {
            "type": type(value) is RaggedDTensor and type(p) is RaggedDTensor,
            "spec": value._spec == at_offset._spec and value.placements == ours.placements,
            "local": torch.equal(value._local_tensor, ours._local_tensor),
            "full": torch.equal(value.full_tensor(), FULL),
            "attribute": getattr(p, "tag", None) == "kept",
            "accumulates": p.requires_grad and _grad_accumulates(p),
        }
    param = torch.nn.Parameter(ours.detach().clone())
    param.grad = ours.detach().clone() * 2
    param.tag = ["kept"]
    twin = copy.deepcopy(param)
    out["deepcopy"] = {
        "parameter": isinstance(twin, torch.nn.Parameter) and type(twin.data) is RaggedDTensor,
        "local": torch.equal(twin.to_local(), param.to_local())
        and twin._local_tensor.data_ptr() != param._local_tensor.data_ptr(),
        "grad": twin.grad is not param.grad and torch.equal(twin.grad.to_local(),
                                                             param.grad.to_local()),
        "attribute": twin.tag == ["kept"] and twin.tag is not param.tag,
    }
    twin.grad = None
    out["deepcopy"]["accumulates"] = _grad_accumulates(twin)
    return out


def test_pickle_and_deepcopy_as_torch_dtensor():
    for res in run_on_ranks(_pickle_and_copy, 2, timeout=120):
        for what, checks in res.items():
            assert all(checks.values()), (what, checks)


def _grad_attribute() -> dict:
    """`.grad` on our DTensor and torch's, side by side: what reading, writing and deleting it
    do, and that a read of it or of other attributes never enters `__torch_function__`
    ([Note: tensor attributes without __torch_function__])."""
    ours, _, theirs = _tensors()
    out = {}
    for name, x in (("ours", ours), ("theirs", theirs)):
        leaf = x.detach().requires_grad_()
        g = leaf.detach() * 2
        res = {"unset": leaf.grad is None}
        leaf.grad = g
        res["set is read back"] = leaf.grad is g
        res["wrong shape"] = _outcome(lambda leaf=leaf: setattr(
            leaf, "grad", torch.zeros(3)))
        res["still set"] = leaf.grad is g
        del leaf.grad
        res["deleted"] = leaf.grad is None
        leaf.grad = g
        leaf.grad = None
        res["set to None"] = leaf.grad is None
        res["requires_grad"] = (x.requires_grad, leaf.requires_grad)
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            local = leaf.to_local() * 1  # a non-leaf DTensor made from a non-leaf shard
            nonleaf = type(x).from_local(local, x.device_mesh, x.placements, shape=x.shape,
                                         stride=x.stride())
            res["non-leaf"] = nonleaf.grad is None and nonleaf.requires_grad
        res["non-leaf warnings"] = len([w for w in caught if ".grad" in str(w.message)])
        leaf.requires_grad = False
        res["requires_grad set"] = leaf.requires_grad
        out[name] = res
    calls = []
    hook = type(ours).__torch_function__

    class Spy(type(ours)):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return hook.__func__(cls, func, types, args, kwargs)

    spied = ours.detach().requires_grad_()
    spied.grad = ours.detach() * 2
    spied.__class__ = Spy
    for _ in range(3):
        spied.grad, spied.requires_grad, spied.shape, spied.device, spied.dtype
        spied._post_accumulate_grad_hooks, spied.is_leaf
    out["torch_function calls for 3 reads"] = len(calls)
    out["attributes"] = {n: (str(getattr(ours, n)), str(getattr(theirs, n)))
                         for n in ("shape", "dtype", "device", "is_leaf", "ndim", "layout",
                                   "itemsize", "nbytes", "is_cpu", "_base")}
    # A TorchFunctionMode sees the reads, as it sees torch's DTensor's.
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    calls.clear()
    with Seen():
        ours.grad, theirs.grad, ours.requires_grad, theirs.requires_grad
    out["mode saw"] = [getattr(f, "__name__", str(f)) for f in calls]
    return out


def test_grad_attribute_as_torch_dtensor():
    for res in run_on_ranks(_grad_attribute, 2, timeout=120):
        ours, theirs = res["ours"], res["theirs"]
        assert ours["wrong shape"][0] == "raises", ours
        assert ours == theirs, res
        assert all(v for k, v in ours.items() if isinstance(v, bool) and k != "requires_grad set")
        assert ours["requires_grad"] == (False, True) and ours["requires_grad set"] is False
        assert ours["non-leaf warnings"] == 1
        assert res["torch_function calls for 3 reads"] == 0
        assert res["mode saw"] == ["__get__"] * 4, res["mode saw"]
        for name, (a, b) in res["attributes"].items():
            assert a == b, (name, a, b)
