"""Port of veScale's `test/dtensor/checkpoint/test_ragged_shard_sl.py` (volcengine/veScale) to
veragged: a parameter saved with torch.distributed.checkpoint (DCP) under one layout and loaded
under another must come back exactly (veScale's base class compares with atol = rtol = 0).

veScale's configs are kept as they are: nine explicit ones (ragged -> ragged with other dims and
units, ragged <-> plain tensor, `dims=()` root-only) and the brute-force chain over every set of
4 distinct non-negative units summing to 12 for shape (2, 3, 2, 7), ragged dims (0, 1, 2)
(consecutive sets saved then loaded; built in veScale's order, so the units are veScale's).
Its three test classes:
- TestRaggedShardSaveLoad: world 4, 1-D mesh: the configs' 4-entry units as they are.
- TestRaggedShardShard0SaveLoad / TestRaggedShardShard1SaveLoad: veScale's (fsdp=4, tp=2) mesh
  with `(RaggedShard, Shard(0))` / `(RaggedShard, Shard(1))`, the tp dim doubled in the shape,
  become a (fsdp=2, tp=2) mesh of our 4 ranks (same tp, same doubled shapes); the 4-entry fsdp
  units become 2 entries by merging adjacent fsdp ranks (rank i holds what ranks 2i, 2i+1
  held, sums unchanged): e.g. (3, 7, 4, 1) -> (10, 5), one-hot (0, 1, 0, 0) -> (1, 0),
  (21, 21, 22, 0) -> (42, 22); the 8 brute-force pairs merge to (1, 11), (2, 10) and (3, 9)
  only, so they overlap there (a (4, 1) mesh, which keeps the units, would leave tp trivial).
API mapping: veScale's `dt.redistribute(mesh, (RaggedShard(...), Shard(d)))` on the
`(Replicate(), Shard(d))` DTensor is `veragged.redistribute(dt, mesh, ...)` (torch's own
`DTensor.redistribute` does not know RaggedShard); `distribute_tensor` is veragged's.

All cases run in one spawn of 4 ranks (the 2x2 mesh is built inside it), each in its own
checkpoint directory; each case catches its own exception (DCP raises on every rank alike) and the
parent asserts per case, one pytest test per veScale test class.
"""

import itertools
import math
import os
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh
from tests.harness.cases import assert_cases, check, run_cases, run_groups
from tests.harness.device import rank_device_type

WORLD = 4

Config = namedtuple("Config", ["shape", "s_dims", "s_local_units", "l_dims", "l_local_units"])


def _k_sum_distinct_sets(n: int, k: int):
    """Every set of k distinct non-negative ints that sum to n, inserted in lexicographic order
    (the order veScale's backtracking inserts them, so the set iterates as veScale's does)."""
    res = set()
    for combo in itertools.combinations(range(n + 1), k):
        if sum(combo) == n:
            res.add(frozenset(combo))
    return res


def _brute_force_configs(shape, ragged_dims, world_size):
    """veScale's make_brute_force_config: save with one set of units, load with the next."""
    assert ragged_dims[-1] == len(ragged_dims) - 1
    ragged_length = math.prod(shape[d] for d in ragged_dims)
    combinations = sorted(_k_sum_distinct_sets(ragged_length, world_size))
    return [
        Config(shape, ragged_dims, tuple(combinations[i]), ragged_dims, tuple(combinations[i + 1]))
        for i in range(len(combinations) - 1)
    ]


CONFIGS = [
    Config((2, 64), (), (0, 1, 0, 0), None, None),
    Config((2, 64), (), (0, 1, 0, 0), (0, 1), (21, 21, 22, 0)),
    Config((2, 64), (0, 1), (1, 1, 1, 1), (), (0, 0, 0, 1)),
    Config((2, 64), (0, 1), (1, 1, 1, 1), (0, 1), (21, 21, 22, 0)),
    Config((2, 64), (0,), (1, 1, 0, 0), (0, 1), (21, 21, 22, 0)),
    Config((5, 3, 6, 7), (0, 1), (3, 7, 4, 1), (0, 1, 2), (43, 23, 7, 17)),
    Config((5, 3, 6, 7), (0, 1), (3, 7, 4, 1), None, None),
    Config((5, 3, 6, 7), None, None, (0, 1, 2, 3), (17, 13, 31, 2)),
    Config((5, 3, 6, 7), (0, 1), (5, 3, 7, 0), (0, 1, 2, 3), (17, 13, 31, 2)),
    *_brute_force_configs(shape=(2, 3, 2, 7), ragged_dims=(0, 1, 2), world_size=4),
]


def _merge_pairs(units):
    """4 fsdp ranks -> 2: rank i holds what ranks 2i and 2i+1 held."""
    return None if units is None else tuple(units[i] + units[i + 1] for i in range(0, 4, 2))


class SimpleModel(nn.Module):
    def __init__(self, shape) -> None:
        super().__init__()
        self.param = nn.Parameter(
            torch.arange(0, math.prod(shape), dtype=torch.float32).view(shape)
        )


def _distribute(param, mesh, dims, units, tp_placement):
    """The parameter's layout: RaggedShard on a 1-D mesh, or (Replicate, Shard(d)) redistributed
    to (RaggedShard, Shard(d)) on the 2x2 mesh, as veScale does."""
    if tp_placement is None:
        return veragged.distribute_tensor(param, mesh, (RaggedShard(dims, units),))
    dt = veragged.distribute_tensor(param, mesh, (Replicate(), tp_placement))
    return veragged.redistribute(dt, mesh, (RaggedShard(dims, units), tp_placement))


def _save_load(path, mesh, config, shape, tp_placement):
    """veScale's test_save_load_ragged_shard body for one config."""
    _, s_dims, s_local_units, l_dims, l_local_units = config
    simple_model = SimpleModel(shape)
    if s_dims is not None:
        rs_dtensor = _distribute(simple_model.param, mesh, s_dims, s_local_units, tp_placement)
        simple_model.param = nn.Parameter(rs_dtensor)
    state = {"model": simple_model.state_dict()}
    dcp.save(state, checkpoint_id=path)
    dist.barrier()

    meta_simple_model = SimpleModel(shape)
    golden = meta_simple_model.param.detach().clone()
    if l_dims is not None:
        rs_dtensor = _distribute(meta_simple_model.param, mesh, l_dims, l_local_units, tp_placement)
        meta_simple_model.param = nn.Parameter(rs_dtensor)
        meta_simple_model.param._local_tensor.data.fill_(0)
    else:
        meta_simple_model.param.data.fill_(0)
    ckpt = {"model": meta_simple_model.state_dict()}
    dcp.load(ckpt, checkpoint_id=path)
    if l_dims is not None:
        result = meta_simple_model.param.full_tensor()
    else:
        result = meta_simple_model.param.data
    check(result.shape == golden.shape, f"loaded shape {tuple(result.shape)}")
    check(torch.equal(result.detach(), golden), "loaded tensor != saved tensor (exact)")


def _name(config, shape):
    return (f"shape {list(shape)} save {config.s_dims} {config.s_local_units} -> "
            f"load {config.l_dims} {config.l_local_units}")


def _ranks(root):
    mesh = get_mesh()
    mesh2 = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("fsdp", "tp"))
    groups = {}
    # TestRaggedShardSaveLoad: world 4, 1-D mesh, units as they are.
    cases = []
    for i, config in enumerate(CONFIGS):
        path = os.path.join(root, "TestRaggedShardSaveLoad", str(i))
        cases.append((f"{i}: {_name(config, config.shape)}",
                      lambda path=path, config=config: _save_load(
                          path, mesh, config, config.shape, None)))
    groups["TestRaggedShardSaveLoad"] = run_cases(cases)
    # TestRaggedShardShard0SaveLoad / Shard1: (fsdp=2, tp=2), units merged, tp dim doubled.
    for cls, d in (("TestRaggedShardShard0SaveLoad", 0), ("TestRaggedShardShard1SaveLoad", 1)):
        cases = []
        for i, config in enumerate(CONFIGS):
            shape = list(config.shape)
            shape[d] *= 2
            merged = config._replace(
                s_local_units=_merge_pairs(config.s_local_units),
                l_local_units=_merge_pairs(config.l_local_units),
            )
            path = os.path.join(root, cls, str(i))
            cases.append((f"{i}: {_name(merged, shape)} with Shard({d}) on 2x2",
                          lambda path=path, config=merged, shape=tuple(shape), d=d: _save_load(
                              path, mesh2, config, shape, Shard(d))))
        groups[cls] = run_cases(cases)
    return groups


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("vescale_dcp"))
    return run_groups(_ranks, WORLD, timeout=240, args=(root,))


# veScale: TestRaggedShardSaveLoad.test_save_load_ragged_shard (every config)
def test_save_load_ragged_shard(results):
    assert_cases("DCP ragged 1-D", results["TestRaggedShardSaveLoad"])


# veScale: TestRaggedShardShard0SaveLoad.test_save_load_ragged_shard (every config)
def test_save_load_ragged_shard_shard0(results):
    assert_cases("DCP (ragged, Shard(0)) 2x2", results["TestRaggedShardShard0SaveLoad"])


# veScale: TestRaggedShardShard1SaveLoad.test_save_load_ragged_shard (every config)
def test_save_load_ragged_shard_shard1(results):
    assert_cases("DCP (ragged, Shard(1)) 2x2", results["TestRaggedShardShard1SaveLoad"])
