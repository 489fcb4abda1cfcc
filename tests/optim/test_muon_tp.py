"""veragged.optim.Muon on FSDP x TP parameters ((dp, tp) and HSDP (replicate, dp, tp) meshes on
gloo ranks) against Muon on the full tensors in one process, bitwise.

Each TP-split matrix is gathered to one host rank of its domain (dp x tp), orthogonalised there
and scattered back ([Note: Muon matrix exchange], [Note: optimizer pieces on N-D meshes]); the
placements are those of tp_cases (TP Shard(0) / Shard(1) / Replicate, uneven TP, element-wise
FSDP cuts, a TP-only matrix, a replicated one), with fused-QKV `split_sizes` cut by TP and FSDP.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from veragged import RaggedShard
from veragged.optim import Muon
from veragged.optim.pieces import matrix_layout
from tests.harness.pool import get_pool

import tp_cases
from tp_cases import srs

SPLIT = (5, 4, 3)
# name, shape, (dp placement, tp placement), param group
CASES = [
    ("col", (8, 6), (srs((0,), (1, 3)), Shard(0)), "muon"),
    ("row", (6, 8), (RaggedShard((0,), (2, 1)), Shard(1)), "muon"),
    ("rep", (5, 7), (RaggedShard((0, 1), (1, 4)), Replicate()), "muon"),
    ("col_elements", (4, 10), (srs((0, 1), (3, 2)), Shard(0)), "muon"),
    ("uneven_col", (9, 4), (srs((0,), (0, 1)), Shard(0)), "muon"),
    ("uneven_row", (4, 9), (RaggedShard((0,), (1, 0)), Shard(1)), "muon"),
    ("tp_only", (5, 6), (Replicate(), Shard(1)), "muon"),
    ("whole", (3, 4), (Replicate(), Replicate()), "muon"),
    ("qkv_col", (12, 4), (srs((0,), (1, 1)), Shard(0)), "qkv"),
    ("qkv_row", (12, 6), (RaggedShard((0,), (1, 2)), Shard(1)), "qkv"),
    ("bias", (8,), (srs((0,), (1, 1)), Shard(0)), "adamw"),
    ("norm", (6,), (RaggedShard((0,), (1, 2)), Replicate()), "adamw"),
    ("experts", (4, 3, 5), (srs((0,), (1, 1)), Shard(0)), "adamw"),
]
OPTS = dict(lr=0.02, weight_decay=0.1, betas=(0.9, 0.95))


def _groups(params):
    kinds = {kind: [p for p, (_, _, _, k) in zip(params, CASES) if k == kind]
             for kind in ("muon", "qkv", "adamw")}
    return [
        {"params": kinds["muon"]},
        {"params": kinds["qkv"], "split_sizes": SPLIT},
        {"params": kinds["adamw"], "use_muon": False, "lr": 1e-2},
    ]


def _fulls():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen) for _, shape, _, _ in CASES]


def _train(mesh_kind, owners, pattern, steps):
    mesh = tp_cases.mesh_of(mesh_kind)
    fulls = _fulls()
    params = [tp_cases.place(f, mesh, pl) for f, (_, _, pl, _) in zip(fulls, CASES)]
    refs = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon(_groups(params), owners=owners, grad_agreement="mesh", **OPTS)
    ref = Muon(_groups(refs), **OPTS)
    present = tp_cases.pattern(pattern)
    calls = {"all_to_all": 0, "all_gather": 0, "agreement": []}
    a2a, ag, ar = dist.all_to_all_single, dist.all_gather_into_tensor, dist.all_reduce

    def agreement(*args, group=None, **kwargs):
        calls["agreement"].append(dist.get_world_size(group))
        return ar(*args, group=group, **kwargs)

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for step in range(steps):
        for q, g in zip(refs, tp_cases.set_grads(params, step, present)):
            q.grad = g
        with mock.patch.object(dist, "all_to_all_single", count("all_to_all", a2a)), \
                mock.patch.object(dist, "all_gather_into_tensor", count("all_gather", ag)), \
                mock.patch.object(dist, "all_reduce", agreement):
            opt.step()
        ref.step()
    got = tp_cases.full_tensors(params)
    equal = {name: bool(torch.equal(a, b.detach()))
             for (name, *_), a, b in zip(CASES, got, refs)}
    plans = [(pl.world, pl.owners, pl.groups) for pl in opt.owner_plans]
    worlds = {name: matrix_layout(p).world for (name, *_), p in zip(CASES, params)}
    return equal, plans, calls, worlds


@pytest.mark.parametrize(
    "owners,pattern",
    [("lpt", "all"), ("lpt", "cycle"), ("alpha", "cycle"), ("naive", "all"),
     ("replicated", "cycle")],
)
def test_fsdp_x_tp_equals_one_process_bitwise(owners, pattern):
    """6 steps on a 2x2 (dp, tp) mesh. Matrices cut by dp and tp have one host rank among the 4
    (an owner plan over the 4-rank domain); TP-replicated ones a domain of 2 (dp), the TP-only
    one a domain of 2 (tp), the replicated one none."""
    results = get_pool(4).run(_train, "2d", owners, pattern, 6)
    for equal, plans, calls, worlds in results:
        assert all(equal.values()), equal
        # grad presence: one all-reduce per step over the whole 2x2 mesh
        assert calls["agreement"] == [4] * 6, calls
        assert plans == results[0][1] or owners == "replicated"
        assert worlds["col"] == worlds["row"] == worlds["uneven_col"] == 4, worlds
        assert worlds["rep"] == worlds["tp_only"] == 2 and worlds["whole"] == 1, worlds
    if owners != "replicated":
        equal, plans, calls, _ = results[0]
        assert any(world == 4 for world, _, _ in plans), plans
        # one all-to-all per micro-group and direction, no all-gather of matrices
        assert calls["all_gather"] == 0, calls
        assert calls["all_to_all"] > 0, calls


def test_hsdp_x_tp_equals_one_process_bitwise():
    """A 2x2x2 (replicate, dp, tp) mesh on 8 ranks: each replica's dp x tp ranks exchange among
    themselves."""
    results = get_pool(8).run(_train, "3d", "lpt", "cycle", 4, timeout=300)
    for equal, plans, calls, worlds in results:
        assert all(equal.values()), equal
        assert calls["agreement"] == [8] * 4, calls  # replicas, dp and tp agree at once
        assert worlds["col"] == 4 and worlds["rep"] == 2, worlds


def _plan_counts(steps):
    """Micro-groups and all-to-alls per step with every gradient present."""
    mesh = tp_cases.mesh_of("2d")
    params = [tp_cases.place(f, mesh, pl) for f, (_, _, pl, _) in zip(_fulls(), CASES)]
    opt = Muon(_groups(params), owners="lpt", capacity=10**9, grad_agreement="local", **OPTS)
    calls = []
    a2a = dist.all_to_all_single

    def wrapped(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return a2a(*args, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", wrapped):
        for step in range(steps):
            tp_cases.set_grads(params, step, tp_cases.pattern("all"))
            opt.step()
    return len(calls), [len(pl.groups) for pl in opt.owner_plans]


def test_one_fused_all_to_all_per_micro_group_and_direction():
    """With an unbounded capacity each domain is one micro-group: two all-to-alls per domain with
    an owner plan (dp x tp, dp, tp) per step, whatever the number of matrices in it."""
    for n, groups in get_pool(4).run(_plan_counts, 2):
        assert groups == [1, 1, 1], groups
        assert n == 2 * 2 * len(groups), n


def _bad_inputs():
    mesh = tp_cases.mesh_of("2d")
    from torch.distributed.tensor import distribute_tensor

    strided = distribute_tensor(torch.randn(8, 4), mesh, [_StridedShard(0, split_factor=2),
                                                          Shard(0)])
    two_dims = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)])
    res = {}
    res["strided"] = tp_cases.raises(lambda: Muon([nn.Parameter(strided)]), NotImplementedError,
                                     "_StridedShard", "[8, 4]")
    res["two_dims"] = tp_cases.raises(lambda: Muon([nn.Parameter(two_dims)]),
                                      NotImplementedError, "tensor dims 0 and 1", "[4, 4]")
    return res


def test_unsupported_placements_raise_naming_them():
    for res in get_pool(4).run(_bad_inputs):
        assert all(v is True for v in res.values()), res
