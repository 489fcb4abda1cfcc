"""WriteCounter: known op sequences give known byte counts; FSDPPaths attributes them (a stand-in
FSDP module in one process, then torch's and veragged's fully_shard on 2 gloo ranks)."""

import _fake_fsdp
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import veragged
from veragged.tools.write_counter import FSDPPaths, WriteCounter
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

F32 = 4


def _by_op(counter):
    out = {}
    for (_, op, _), n in counter.ops.items():
        out[op] = out.get(op, 0) + n
    return out


def test_known_op_sequence():
    a, b = torch.randn(100), torch.randn(100)
    half = torch.randn(100, dtype=torch.bfloat16)
    with WriteCounter() as c:
        x = a + b  # functional: 400
        x.mul_(2)  # in place: 400
        torch.add(a, b, out=x)  # out=: 400
        v = x.view(10, 10)  # a view: 0
        torch.ops.aten._unsafe_view(x, [10, 10])  # shares x's storage: 0
        x[:50].zero_()  # writes the view: 200
        torch.empty(1000)  # an allocation: 0
        torch.ops.veragged.cast_scale_(x, half, 2.0)  # 400 (fp32 destination)
        torch.ops.veragged.accumulate_(x, b, 1.0)  # 400
        torch.ops.veragged.land_(x, [b], [0, 0, 0, 100, 1], 0.5)  # one piece, all of x: 400
        torch.ops.veragged.zero_ranges_(x, [0, 10, 20, 25])  # its ranges only: 15 elements
        torch._foreach_add_([a, b], [x, v.view(-1)])  # both destinations: 800
        torch.zeros(10, dtype=torch.float64)  # 80
    assert _by_op(c) == {
        "aten.add.Tensor": 400,
        "aten.mul_.Tensor": 400,
        "aten.add.out": 400,
        "aten.zero_.default": 200,
        "veragged.cast_scale_.default": 400,
        "veragged.accumulate_.default": 400,
        "veragged.land_.default": 400,
        "veragged.zero_ranges_.default": 60,
        "aten._foreach_add_.List": 800,
        "aten.zeros.default": 80,
    }
    assert c.bytes == 3540 and c.buckets == {"rest": 3540}


def test_backward_is_seen_with_accumulation_into_an_existing_grad():
    w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 3)
    with WriteCounter() as first:  # .grad is None: AccumulateGrad steals the new gradient
        (x @ w).sum().backward()
    with WriteCounter() as second:  # .grad exists: AccumulateGrad adds into it in place
        (x @ w).sum().backward()
    # forward mm 2x4, sum, ones_like; backward mm 3x4 (expand and t are views)
    model_own = {"aten.mm.default": (8 + 12) * F32, "aten.sum.default": F32,
                 "aten.ones_like.default": F32}
    assert _by_op(first) == model_own
    assert _by_op(second) == {**model_own, "aten.add_.Tensor": 12 * F32}


def test_phase_tags_every_write_inside():
    t = torch.zeros(10)
    with WriteCounter() as c:
        t.add_(1)
        with c.phase("mine"):
            t.mul_(2)
            t.clone()
    assert c.buckets == {"rest": 40, "mine": 80}


def test_fsdp_paths_follow_function_names_and_fsdp_owned_gradient_storage():
    paths = FSDPPaths(extra_fsdp_code=(_fake_fsdp.__file__,))
    w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 3)
    with WriteCounter(attribute=paths) as c:
        buf = _fake_fsdp.alloc_grads(20)  # grad path: 80 bytes, the storage is FSDP's now
        w.grad = buf[4:16].view(3, 4)  # bound as .grad, as a DBuffer binds its views
        (x @ w).sum().backward()  # AccumulateGrad adds into FSDP's storage: grad path, 48
        buf.mul_(2)  # outside backward, outside FSDP: rest, 80
        _fake_fsdp.unshard(x)  # parameter path: 24
        _fake_fsdp.setup(x)  # FSDP code matching no rule: 24
    assert c.buckets == {"grad": 80 + 48, "param": 24, "fsdp_other": 24,
                         "rest": (8 + 12) * F32 + 2 * F32 + 80}
    sites = {(b, op, site) for (b, op, site) in c.ops}
    assert ("grad", "aten.add_.Tensor", "autograd torch::autograd::AccumulateGrad") in sites
    assert ("param", "aten.clone.default", "unshard") in sites


# --- two gloo ranks -------------------------------------------------------------------------


def _collectives():
    mesh = init_device_mesh(rank_device_type(), (2,))
    full = torch.randn(16, 4)
    d = torch.distributed.tensor.distribute_tensor(full, mesh, [torch.distributed.tensor.Shard(0)])
    res = {}
    with WriteCounter() as c:
        d.mul_(2)  # this rank's 8 x 4 elements, not the global 16 x 4
    res["dtensor"] = c.bytes
    inp = torch.randn(8)
    with WriteCounter() as c:
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, inp)
        gathered = torch.empty(8)
        dist.all_gather_into_tensor(gathered, out)
        dist.all_reduce(out)
    res["collectives"] = (c.bytes, c.collective_copies, dict(c.collectives))
    return res


def test_collectives_excluded_and_dtensors_count_local_bytes():
    for res in get_pool(2).run(_collectives):
        assert res["dtensor"] == 8 * 4 * F32
        written, copies, calls = res["collectives"]
        assert written == 0
        assert copies == 4 * F32  # gloo's reduce-scatter copies its result out in wait()
        assert calls == {"c10d._reduce_scatter_base_.default": 1,
                         "c10d._allgather_base_.default": 1, "c10d.allreduce_.default": 1}


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin(self.norm(x))


def _attribution(kind, mp):
    mesh = init_device_mesh(rank_device_type(), (2,))
    torch.manual_seed(0)
    model = nn.Sequential(_Block(8), _Block(8))
    x = torch.randn(4, 8)
    with WriteCounter() as plain:  # the model's own writes (its gradients are stolen: no add)
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    shard = veragged.fully_shard if kind == "veragged" else torch_fully_shard
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mp else {}
    for block in model:
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    model(x).sum().backward()  # lazy init
    model.zero_grad(set_to_none=True)
    with WriteCounter() as step:
        model(x).sum().backward()
    slots = None
    if kind == "veragged":
        slots = [g.buffer.shard_size for m in model.modules()
                 if isinstance(m, veragged.FSDPModule) for g in m._veragged_state.groups]
    return {"plain": plain.bytes, "buckets": dict(step.buckets), "slots": slots,
            "calls": dict(step.collectives),
            "grad_sites": sorted({site for (b, _, site) in step.ops if b == "grad"})}


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16_params"])
def test_fully_shard_writes_split_into_parameter_and_gradient_paths(mp):
    pool = get_pool(2)
    theirs = pool.run(_attribution, "torch", mp)
    ours = pool.run(_attribution, "veragged", mp)
    block = 2 * 8 + 8 * 8 + 8  # LayerNorm weight and bias, Linear weight and bias: 88
    itemsize = 2 if mp else F32
    for t, v in zip(theirs, ours):
        # The model's own writes land in `rest`, the same with either FSDP (and, in fp32, as
        # without one); the root's cast of its 4 x 8 input to bf16 is neither path.
        assert t["buckets"]["rest"] == v["buckets"]["rest"]
        if mp:
            assert t["buckets"]["fsdp_other"] == v["buckets"]["fsdp_other"] == 4 * 8 * 2
        else:
            assert t["buckets"]["rest"] == t["plain"] == v["plain"]
            assert "fsdp_other" not in t["buckets"] and "fsdp_other" not in v["buckets"]
        # Each block is all-gathered twice (forward, then backward after resharding).
        calls = {"c10d._allgather_base_.default": 4, "c10d._reduce_scatter_base_.default": 2}
        assert t["calls"] == calls and v["calls"] == calls
        # torch: copy-in of this rank's half (cast to bf16 on the way if mp) and copy-out of
        # the whole block per all-gather (dim-0 sizes are even: no padding) ...
        param = 2 * 2 * (block // 2 + block) * itemsize
        if mp:
            param += 2 * 2 * (block // 2) * itemsize  # FSDP2 casts the shard before copy-in
        assert t["buckets"]["param"] == param
        # ... and one copy of every unsharded gradient into the reduce-scatter input, in fp32
        # (torch 2.15 reduces in the gradients' accumulation dtype when reduce_dtype is None).
        assert t["buckets"]["grad"] == 2 * block * F32
        # veragged: nothing copied in fp32; with bf16 params only the cast of the shard into
        # its slot of the all-gather output, twice per block.
        assert v["buckets"].get("param", 0) == (sum(2 * s * 2 for s in v["slots"]) if mp else 0)
        assert v["buckets"]["grad"] >= 2 * block * itemsize  # every gradient lands once
        assert None not in v["grad_sites"] and "autograd" not in " ".join(v["grad_sites"])
