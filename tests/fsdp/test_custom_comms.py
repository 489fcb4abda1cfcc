"""Collectives through comm objects ([Note: custom comms] in veragged/dbuffer/comms.py):
`set_custom_all_gather`, `set_custom_reduce_scatter`,
`set_allocate_memory_from_process_group_for_comm`, `set_symm_mem_for_comm` (its errors only: it
needs CUDA and NCCL) and `set_separate_reduce_scatter_group`, on 2 gloo ranks (4 for HSDP and
`reshard_after_forward=2`).

The same model trains under torch's fully_shard and veragged's with the same recording comms
(wrapping `dist.all_gather_into_tensor` / `dist.reduce_scatter_tensor`): every gradient element is
the same sum of two terms on both (HSDP 2 x 2: two pairs), so losses, gradients and parameters are
compared bitwise (`reshard_after_forward=2` needs 4 shard ranks, whose sums each implementation
adds in its own order: bitwise against veragged's default path, to round-off against torch's),
and the comms must have been called as often as torch calls them (per DBuffer: twice where
veragged splits a call's parameters in two), each time on tensors from their own `allocate` (the
all-gather in place, its input a slot of its output). veragged's verdict flags
([Note: unreached parameters]) must travel through a custom reduce-scatter: ranks reaching
different parameters get the gradients (and Nones) of the default path, bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
)
from torch.distributed.tensor import DTensor, Shard

import veragged
from tests.fsdp._reference import Block
from veragged.dbuffer import comms as dbuffer_comms
from veragged.fsdp import comm_settings as fsdp_comms
from tests.harness import get_mesh, run_on_ranks
from tests.harness.device import rank_device_type

# torch 2.11 has no set_separate_reduce_scatter_group (its side then runs on the shared group:
# the same sums) and no ShardPlacementResult (the two-mesh errors are then not compared).
TORCH_HAS_SEPARATE_RS = hasattr(TorchFSDPModule, "set_separate_reduce_scatter_group")

IMPLS = {"torch": torch_fully_shard, "veragged": veragged.fully_shard}
STEPS, BLOCKS = 3, 2


class _Recording:
    """Records `allocate` and the calls; checks each call's tensors came from `allocate` since
    the previous call."""

    def __init__(self, sync: bool = False):
        self.sync = sync  # call the collective synchronously and return None
        self.allocs: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.calls: list[dict] = []
        self._fresh: list[torch.Tensor] = []

    def allocate(self, size, *, dtype, device):
        t = torch.empty(*size, dtype=dtype, device=device)
        self.allocs.append((tuple(int(s) for s in size), dtype))
        self._fresh.append(t)
        return t

    def _from_allocate(self, t: torch.Tensor) -> bool:
        return any(t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                   for f in self._fresh)

    def _record(self, output_tensor, input_tensor, group, **extra) -> None:
        self.calls.append(dict(
            out=output_tensor.numel(), inp=input_tensor.numel(), dtype=output_tensor.dtype,
            out_allocated=self._from_allocate(output_tensor),
            in_allocated=self._from_allocate(input_tensor),
            group=id(group), ranks=tuple(dist.get_process_group_ranks(group)), **extra,
        ))
        self._fresh = []


class RecordingAllGather(_Recording, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n, j = input_tensor.numel(), group.rank()
        in_place = (input_tensor.data_ptr()
                    == output_tensor.data_ptr() + j * n * output_tensor.element_size())
        self._record(output_tensor, input_tensor, group, in_place=in_place)
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op and not self.sync)
        return None if self.sync else work


class RecordingReduceScatter(_Recording, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self._record(output_tensor, input_tensor, group, op=str(op))
        work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op and not self.sync)
        return None if self.sync else work


def _full(t):
    return None if t is None else (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _data(step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, 16, generator=g)


def _shard(impl: str, variant: str):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(16, 4))
    kw: dict = {"mesh": get_mesh()}
    if variant == "mixed_precision":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if variant == "reshard_after_forward_2":  # backward gathers within pairs of ranks
        kw["reshard_after_forward"] = 2
    if variant == "chunked":  # torch's Shard(1) chunks: [Note: chunked parameters]
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else None
    for block in model[:BLOCKS]:
        IMPLS[impl](block, **kw)
    IMPLS[impl](model, **kw)
    if variant == "bitfit":  # frozen after fully_shard: veragged's compacted gradient slots
        for n, p in model.named_parameters():  # differ per rank, the comm's are padded
            p.requires_grad_(n.endswith("bias"))
    return model


def _train(impl: str, variant: str, custom: bool = True):
    """Losses, gradients and parameters of STEPS AdamW steps, and what the comms saw."""
    model = _shard(impl, variant)
    ag = RecordingAllGather(sync=variant == "sync_comms")
    rs = RecordingReduceScatter(sync=variant == "sync_comms")
    for m in model.modules():
        if isinstance(m, TorchFSDPModule) and custom:
            if variant == "process_group_alloc":
                m.set_allocate_memory_from_process_group_for_comm(True)
            else:
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
    if variant.endswith("separate_reduce_scatter_group") and (
            impl == "veragged" or TORCH_HAS_SEPARATE_RS):
        model.set_separate_reduce_scatter_group()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        if variant == "no_sync":
            model.set_requires_gradient_sync(False)
            model(_data(step, 0)).pow(2).mean().backward()
            model.set_requires_gradient_sync(True)
        loss = model(_data(step)).pow(2).mean()
        loss.backward()
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append((loss.detach(), grads))
    params = {n: _full(p) for n, p in model.named_parameters()}
    groups = None
    if impl == "veragged":
        # ([Note: compacted gradients]: a comm's reduce-scatter slots are the largest rank's)
        layouts = [(g.buffer, g.buffer.grads.layout)
                   for m in model.modules() if hasattr(m, "_veragged_state")
                   for g in m._veragged_state.groups]
        groups = [(b.world * b.shard_size, b.world * (max(lay.sizes) + lay.flags),
                   max(lay.sizes) + lay.flags, lay.uniform) for b, lay in layouts]
    return out, params, ag.allocs, ag.calls, rs.allocs, rs.calls, groups


VARIANTS = ["plain", "sync_comms", "no_sync", "mixed_precision", "chunked", "bitfit",
            "separate_reduce_scatter_group", "process_group_alloc",
            "hsdp_separate_reduce_scatter_group", "reshard_after_forward_2"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_comms_match_torch_bitwise(variant):
    # HSDP 2 x 2: each replica's shard pair makes its own reduce-scatter group (local
    # synchronization); the replicas' all-reduce stays torch's own collective.
    kw = (dict(mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard"))
          if variant.startswith("hsdp") else {})
    world = 4 if kw or variant == "reshard_after_forward_2" else 2
    theirs = run_on_ranks(_train, world, args=("torch", variant), timeout=180, **kw)
    ours = run_on_ranks(_train, world, args=("veragged", variant), timeout=180, **kw)
    if world == 4 and not kw:  # sums of 4 terms, in each implementation's order: round-off;
        same = run_on_ranks(_train, 4, args=("veragged", variant, False), timeout=180)
        _compare(same, ours, torch.equal)  # bitwise: veragged's default path, same order
        _compare(theirs, ours, lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    else:  # sums of 2 terms (HSDP: pairs, then the replicas' pair): the same bits
        _compare(theirs, ours, torch.equal)
    for (_, _, *t_comms), (_, _, *v_comms) in zip(theirs, ours):
        _check_comms(variant, t_comms, v_comms)


def _compare(ref, res, same) -> None:
    for (r_out, r_params, *_), (out, params, *_) in zip(ref, res):
        for (r_loss, r_grads), (loss, grads) in zip(r_out, out):
            assert same(r_loss, loss)
            for n, g in r_grads.items():
                assert (g is None) == (grads[n] is None), n  # frozen: None on both
                assert g is None or same(g, grads[n]), n
        for n, p in r_params.items():
            assert same(p, params[n]), n


def _check_comms(variant, t_comms, v_comms) -> None:
    (t_ag_allocs, t_ag, t_rs_allocs, t_rs, _) = t_comms
    (v_ag_allocs, v_ag, v_rs_allocs, v_rs, groups) = v_comms
    if variant == "process_group_alloc":  # no recording comms: parity only (gloo has no
        return  # allocator; staging from one: test_allocate_memory_from_process_group)
    states = BLOCKS + 1
    per_state = len(groups) // states  # veragged: one DBuffer per state, or two (chunked)
    # Per step: every state gathers in forward, the blocks again in backward (the root keeps
    # its parameters: reshard_after_forward None; with 2, the root too, within pairs); every
    # state reduce-scatters once.
    micro = 2 if variant == "no_sync" else 1
    again = states if variant == "reshard_after_forward_2" else BLOCKS
    gathers, reduces = STEPS * micro * (states + again), STEPS * states
    assert len(t_ag) == gathers and len(t_rs) == reduces
    assert len(v_ag) == gathers * per_state and len(v_rs) == reduces * per_state
    for calls, allocs, n in ((t_ag, t_ag_allocs, 1), (t_rs, t_rs_allocs, 2),
                             (v_ag, v_ag_allocs, 1), (v_rs, v_rs_allocs, 2)):
        assert len(allocs) == n * len(calls)  # one staging buffer per all-gather, two per RS
        assert all(c["out_allocated"] and c["in_allocated"] for c in calls), calls
    assert all(c["in_place"] and c["out"] == len(c["ranks"]) * c["inp"] for c in t_ag + v_ag)
    assert all(c["op"] == str(dist.ReduceOp.SUM) for c in v_rs)
    # veragged: the all-gather in the param dtype over the whole unsharded buffer, the
    # reduce-scatter over the whole gradient buffer, verdict flags included
    gather_numels = {g[0] for g in groups}
    assert {c["out"] for c in v_ag} == gather_numels
    assert {(c["inp"], c["out"]) for c in v_rs} == {(g[1], g[2]) for g in groups}
    if variant == "bitfit":  # some rank's share of the biases is larger than another's
        assert not all(g[3] for g in groups), groups
    compute = torch.bfloat16 if variant == "mixed_precision" else torch.float32
    assert {c["dtype"] for c in v_ag} == {c["dtype"] for c in t_ag} == {compute}
    assert {c["dtype"] for c in v_rs} == {c["dtype"] for c in t_rs} == {torch.float32}
    for calls in (t_rs, v_rs):  # the reduce-scatter on its own group over the same ranks
        ag_groups = {c["group"] for c in (t_ag if calls is t_rs else v_ag)}
        rs_groups = {c["group"] for c in calls}
        ag_ranks = {c["ranks"] for c in (t_ag if calls is t_rs else v_ag)}
        shard_ranks = max(ag_ranks, key=len)  # (with 2: the pairs' gathers besides)
        assert len(rs_groups) == 1 and {c["ranks"] for c in calls} == {shard_ranks}
        pairs = variant == "reshard_after_forward_2"
        assert {len(r) for r in ag_ranks} == ({4, 2} if pairs else {2})
        assert len(shard_ranks) == (4 if pairs else 2)
        separate = variant.endswith("separate_reduce_scatter_group") and (
            calls is v_rs or TORCH_HAS_SEPARATE_RS)
        assert rs_groups.isdisjoint(ag_groups) == separate


class Routed(nn.Module):
    """Rank 0 reaches `a`, rank 1 `a` and `b`, no rank `c`."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        return y + self.b(x) if dist.get_rank() == 1 else y


def _train_routed(custom: bool):
    torch.manual_seed(0)
    model = Routed()
    veragged.fully_shard(model, mesh=get_mesh())
    rs = RecordingReduceScatter()
    if custom:
        model.set_custom_reduce_scatter(rs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(2):
        g = torch.Generator().manual_seed(step + dist.get_rank())
        model(torch.randn(3, 8, generator=g)).pow(2).sum().backward()
        out.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    flags = model._veragged_state.groups[0].buffer.grads.layout.flags
    return out, {n: _full(p) for n, p in model.named_parameters()}, len(rs.calls), flags


def test_verdict_flags_travel_through_a_custom_reduce_scatter():
    ref = run_on_ranks(_train_routed, 2, args=(False,), timeout=120)
    res = run_on_ranks(_train_routed, 2, args=(True,), timeout=120)
    for (r_grads, r_params, _, _), (grads, params, calls, flags) in zip(ref, res):
        assert calls == 2 and flags > 0
        for rg, g in zip(r_grads, grads):
            assert rg["c.weight"] is None and g["c.weight"] is None
            assert rg["b.weight"] is not None
            for n in rg:
                assert (rg[n] is None) == (g[n] is None), n
                assert rg[n] is None or torch.equal(rg[n], g[n]), n
        for n in r_params:
            assert torch.equal(r_params[n], params[n]), n


class _AllocatingBackend:
    """Stands in for a process group whose backend has an allocator (NCCL's, with
    multicast): records the tensors it allocates."""

    def __init__(self):
        self.sizes: list[tuple[int, torch.dtype]] = []

    def _get_backend(self, device):
        return self

    def supports_tensor_alloc(self, device) -> bool:
        return True

    def allocate_tensor(self, numel, *, dtype, device):
        self.sizes.append((numel, dtype))
        return torch.empty(numel, dtype=dtype, device=device)


def _process_group_alloc(mode: str):
    """Two steps with `set_allocate_memory_from_process_group_for_comm` (mode "gloo": as is;
    "allocator": a backend with an allocator; "off": enabled then disabled); returns the
    parameters, whether the collectives were staged, and what the allocator was asked for."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(16, 4))
    veragged.fully_shard(model, mesh=get_mesh())
    model.set_allocate_memory_from_process_group_for_comm(True)
    buffer = model._veragged_state.groups[0].buffer
    assert isinstance(buffer.all_gather_comm, ProcessGroupAllocAllGather)
    assert isinstance(buffer.reduce_scatter_comm, ProcessGroupAllocReduceScatter)
    alloc = _AllocatingBackend()
    if mode == "allocator":  # the comms' allocator only; the collectives run on the group
        buffer.all_gather_comm._group = buffer.reduce_scatter_comm._group = alloc
    if mode == "off":
        model.set_allocate_memory_from_process_group_for_comm(False)
        assert buffer.all_gather_comm is None and buffer.reduce_scatter_comm is None
    staged = [dbuffer_comms.stages(c, torch.device("cpu"))
              for c in (buffer.all_gather_comm, buffer.reduce_scatter_comm)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_data(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    layout = buffer.grads.layout  # [Note: compacted gradients]
    expected = [(buffer.world * buffer.shard_size, torch.float32),  # all-gather
                (buffer.world * (layout.slot + layout.flags), torch.float32),  # RS in
                (layout.slot + layout.flags, torch.float32)]  # and out
    return {n: _full(p) for n, p in model.named_parameters()}, staged, alloc.sizes, expected


def test_allocate_memory_from_process_group():
    results = {mode: run_on_ranks(_process_group_alloc, 2, args=(mode,), timeout=120)
               for mode in ("gloo", "allocator", "off")}
    for rank in range(2):
        params = {mode: r[rank][0] for mode, r in results.items()}
        for n in params["off"]:
            assert torch.equal(params["gloo"][n], params["off"][n]), n
            assert torch.equal(params["allocator"][n], params["off"][n]), n
        _, staged, sizes, expected = results["gloo"][rank]
        assert staged == [False, False] and sizes == []  # gloo: no allocator, no staging
        _, staged, sizes, expected = results["allocator"][rank]
        # the root's group: one all-gather per forward (it keeps its parameters after
        # forward), one reduce-scatter per backward, each staged in the allocator's memory
        assert staged == [True, True] and sizes == expected * 2
        assert results["off"][rank][1] == [False, False]


class _BadAllocate(RecordingAllGather):
    def allocate(self, size, *, dtype, device):
        return torch.empty(1, dtype=dtype, device=device)


def _errors(impl: str):
    """What each misuse raises: (exception type name, message) per case."""
    fs = IMPLS[impl]
    seen = {}

    def record(name, fn):
        try:
            fn()
            seen[name] = None
        except Exception as e:  # the type is what is compared
            seen[name] = (type(e).__name__, str(e))

    model = fs(nn.Linear(16, 16), mesh=get_mesh())
    model.set_custom_reduce_scatter(RecordingReduceScatter())
    record("alloc_after_custom_rs",
           lambda: model.set_allocate_memory_from_process_group_for_comm(True))
    model = fs(nn.Linear(16, 16), mesh=get_mesh())
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_custom_all_gather(RecordingAllGather())  # overrides it (torch's test)
    record("alloc_after_custom_ag",
           lambda: model.set_allocate_memory_from_process_group_for_comm(False))
    # parameters on two meshes in one call: which mesh's comm would it be?
    world = dist.get_world_size()
    dense = init_device_mesh(rank_device_type(), (world,))
    other = init_device_mesh(rank_device_type(), (world, 1), mesh_dim_names=("a", "b"))["b"]
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )
    except ImportError:  # torch 2.11: no per-parameter meshes
        ShardPlacementResult = None
    if ShardPlacementResult is not None:
        two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        second = set(two[1].parameters())
        infos = FSDPMeshInfo(dense, shard_mesh_dim=0), FSDPMeshInfo(other, shard_mesh_dim=0)
        fs(two, mesh=dense, shard_placement_fn=lambda p: ShardPlacementResult(
            placement=Shard(0), mesh_info=infos[p in second]))
        record("two_meshes_ag", lambda: two.set_custom_all_gather(RecordingAllGather()))
        record("two_meshes_rs", lambda: two.set_custom_reduce_scatter(RecordingReduceScatter()))
    if impl == "veragged":  # torch checks none of these
        model = fs(nn.Linear(16, 16), mesh=get_mesh())
        record("not_a_comm", lambda: model.set_custom_all_gather(object()))
        record("symm_mem_gloo", lambda: model.set_symm_mem_for_comm())
        record("symm_mem_backend", lambda: model.set_symm_mem_for_comm("MPI"))
        record("separate_not_bool", lambda: model.set_separate_reduce_scatter_group("yes"))
        model.set_custom_all_gather(_BadAllocate())
        record("bad_allocate", lambda: model.unshard())  # every rank fails before gathering
    return seen


def test_errors():
    theirs = run_on_ranks(_errors, 2, args=("torch",), timeout=120)[0]
    ours = run_on_ranks(_errors, 2, args=("veragged",), timeout=120)[0]
    for case in ("alloc_after_custom_rs", "alloc_after_custom_ag"):
        assert theirs[case][0] == ours[case][0] == "AssertionError", (theirs, ours)
        assert "cannot call set_allocate_memory_from_process_group" in ours[case][1]
    assert "reduce scatter comm is custom: RecordingReduceScatter" in (
        ours["alloc_after_custom_rs"][1])
    for case in ("two_meshes_ag", "two_meshes_rs") if "two_meshes_ag" in theirs else ():
        assert theirs[case][0] == ours[case][0] == "ValueError", (theirs, ours)
        assert "multiple param groups" in ours[case][1]
    assert ours["not_a_comm"][0] == "TypeError" and "object" in ours["not_a_comm"][1]
    name, msg = ours["symm_mem_gloo"]
    if fsdp_comms.SymmMemAllGather is None:  # torch 2.11: no symmetric-memory comms at all
        assert name == "NotImplementedError" and "set_symm_mem_for_comm" in msg
    else:
        assert name == "RuntimeError" and "set_symm_mem_for_comm" in msg and "gloo" in msg
    name, msg = ours["symm_mem_backend"]
    assert name == "ValueError" and "'MPI'" in msg
    assert ours["separate_not_bool"][0] == "ValueError" and "'yes'" in ours["separate_not_bool"][1]
    name, msg = ours["bad_allocate"]
    assert name == "ValueError" and "_BadAllocate.allocate" in msg and "shape [1]" in msg
