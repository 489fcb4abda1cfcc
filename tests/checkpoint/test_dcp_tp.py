"""DCP of FSDP x TP/EP state dicts: veragged placements on (dp, tp) and (replicate, dp, tp) meshes.

The parameters of a tensor-parallel model sharded by `veragged.fully_shard` are DTensors on the
mesh (dp, tp) (HSDP: (replicate, dp, tp)) with, by TP placement:
- `Shard(0)` (colwise weight and bias, fused experts over EP): `(StridedRaggedShard(dims, units,
  split_factor=tp), Shard(0))`;
- `Shard(1)` (rowwise weight): `(RaggedShard((0,), units), Shard(1))` (the LCM rule);
- `Replicate()` (norms, rowwise bias): `(RaggedShard(dims, units), Replicate())`;
- HSDP adds a leading `Replicate()`.
A TP dim that tp does not divide (9 rows over tp=2: torch.chunk pieces 5 and 4) takes local_units
with one nonzero entry: the whole TP piece on one dp rank.

Model- and optimizer-state-like dicts of such DTensors (and a plain `step` tensor) are saved and
loaded with `torch.distributed.checkpoint` unchanged: (dp 2, tp 2) -> (2, 2) with other units,
(4, 1), (1, 2) on two of the four ranks, plain tensors without a process group, and back; torch's
`fully_shard` + `parallelize_module` checkpoints into these layouts and back; HSDP x TP on 8
ranks. Every value is compared bitwise with the full tensor it was made from. The ranks are
rank pools (tests.harness.pool), one per world size, reused by every test here.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

import veragged
from veragged import RaggedShard, StridedRaggedShard
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TIMEOUT_S = 240

# fqn -> (shape, TP placement, ragged dims, {dp size: (local_units of variant 0, of variant 1)}).
# "even.*" / "uneven.*" mirror the parameters of `_TorchModel` (hidden 8 / 9, experts 4 / 3).
_ONE_HOT = {1: ((1,), (1,)), 2: ((0, 1), (1, 0)), 4: ((0, 0, 1, 0), (1, 0, 0, 0))}
MODEL = {
    "even.wq.weight": ((8, 6), Shard(0), (0, 1), {1: ((1,), (1,)), 2: ((1, 3), (3, 0)),
                                                  4: ((2, 0, 1, 1), (1, 1, 1, 1))}),
    "even.wq.bias": ((8,), Shard(0), (0,), {1: ((1,), (1,)), 2: ((1, 3), (1, 1)),
                                            4: ((1, 1, 0, 2), (0, 4, 0, 0))}),
    # dims (0, 1) cut the dim that Shard(1) shards: the LCM rule makes them (0,).
    "even.wo.weight": ((6, 8), Shard(1), (0, 1), {1: ((1,), (1,)), 2: ((1, 2), (2, 1)),
                                                  4: ((1, 0, 1, 1), (0, 2, 0, 1))}),
    "even.wo.bias": ((6,), Replicate(), (0,), {1: ((1,), (1,)), 2: ((1, 1), (2, 1)),
                                               4: ((1, 1, 1, 0), (3, 0, 0, 0))}),
    "even.experts": ((4, 3, 5), Shard(0), (0, 1), {1: ((1,), (1,)), 2: ((1, 2), (0, 1)),
                                                   4: ((1, 1, 1, 1), (2, 0, 0, 1))}),
    "norm.weight": ((6,), Replicate(), (0,), {1: ((1,), (1,)), 2: ((0, 1), (1, 1)),
                                              4: ((0, 1, 0, 2), (1, 1, 1, 3))}),
    "uneven.wq.weight": ((9, 6), Shard(0), (0,), _ONE_HOT),
    "uneven.wq.bias": ((9,), Shard(0), (0,), _ONE_HOT),
    "uneven.wo.weight": ((6, 9), Shard(1), (0,), _ONE_HOT),
    "uneven.wo.bias": ((6,), Replicate(), (0,), {1: ((1,), (1,)), 2: ((2, 1), (0, 3)),
                                                 4: ((1, 1, 1, 0), (0, 0, 0, 1))}),
    "uneven.experts": ((3, 2, 4), Shard(0), (0, 1, 2), _ONE_HOT),
    # One row over tp=2: torch.chunk gives TP rank 1 an empty piece.
    "tiny": ((1, 4), Shard(0), (0,), _ONE_HOT),
    # No elements at all: still an entry in the checkpoint (else loading raises "Missing key").
    "empty": ((0, 6), Shard(1), (0,), {1: ((1,), (1,)), 2: ((1, 1), (0, 1)),
                                       4: ((1, 1, 1, 1), (0, 0, 2, 0))}),
}
TORCH_PARAMS = [k for k in MODEL if k not in ("tiny", "empty")]  # those of `_TorchModel`


def _is_step(key: str) -> bool:
    return key.endswith("step")  # "optim.step", "optim.state.<fqn>.step": plain 0-dim tensors


def _spec(key: str):
    """The MODEL entry of a state-dict key: `model.<fqn>` or `optim.state.<fqn>.<state>`."""
    if key.startswith("model."):
        return MODEL[key[len("model."):]]
    return MODEL[key[len("optim.state."):].rsplit(".", 1)[0]]


def _keys(params=tuple(MODEL), trained=tuple(MODEL), states=("exp_avg", "exp_avg_sq"),
          steps=("optim.step",)) -> list[str]:
    return (
        [f"model.{k}" for k in params]
        + [f"optim.state.{k}.{s}" for k in trained for s in states]
        + list(steps)
    )


TORCH_KEYS = _keys(TORCH_PARAMS, TORCH_PARAMS, ("exp_avg", "exp_avg_sq", "step"), ())
ALL_KEYS = _keys() + [k for k in TORCH_KEYS if k not in _keys()]


def _full(key: str) -> torch.Tensor:
    if _is_step(key):
        return torch.tensor(7.0)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(_spec(key)[0], generator=g)


def _wanted(keys) -> dict[str, torch.Tensor]:
    return {k: _full(k) for k in keys}


def _mesh(shape: tuple[int, ...]) -> tuple[DeviceMesh, object]:
    """A (dp, tp) or (rep, dp, tp) mesh and the process group DCP runs on.

    (1, 2) is a mesh of ranks 0 and 1 only (ranks outside it get None back). Made per job: the
    pool destroys a job's process groups when it ends.
    """
    names = ("rep", "dp", "tp")[-len(shape):]
    if math.prod(shape) == dist.get_world_size():
        mesh, group = init_device_mesh(rank_device_type(), shape, mesh_dim_names=names), None
    else:  # every rank joins the process groups' creation; only members use them
        ranks = list(range(math.prod(shape)))
        mesh = DeviceMesh("cpu", torch.arange(len(ranks)).view(shape), mesh_dim_names=names)
        group = dist.new_group(ranks)
    if mesh.get_coordinate() is None:
        return None, None
    return mesh, group


def _placements(key: str, mesh: DeviceMesh, variant: int) -> list:
    _, tp_placement, dims, units = _spec(key)
    ragged = RaggedShard(dims, units[mesh.size(mesh.ndim - 2)][variant])
    return [Replicate()] * (mesh.ndim - 2) + [ragged, tp_placement]


def _expected_placements(key: str, mesh: DeviceMesh, variant: int) -> tuple:
    """The placements the task prescribes (what normalisation must produce)."""
    *rep, ragged, tp_placement = _placements(key, mesh, variant)
    tp = mesh.size(mesh.ndim - 1)
    if tp_placement == Shard(0) and tp > 1:
        ragged = StridedRaggedShard(ragged.dims, ragged.local_units, tp)
    elif tp_placement == Shard(1):
        ragged = RaggedShard((0,), ragged.local_units)
    return (*rep, ragged, tp_placement)


def _state(keys, mesh: DeviceMesh, variant: int, values=None) -> dict:
    """Flat state dict of veragged DTensors (values: the full tensors; None: NaN, to load into)."""
    state = {}
    for k in keys:
        full = _full(k) if values is None else values[k]
        if values is None:
            full = torch.full_like(full, float("nan"))
        if _is_step(k):
            state[k] = full.clone()
        else:
            state[k] = veragged.distribute_tensor(
                full, mesh, _placements(k, mesh, variant), src_data_rank=None
            )
    return state


def _diffs(state: dict, want: dict) -> list[str]:
    """Keys whose value is not bitwise the wanted full tensor (full_tensor is collective)."""
    bad = []
    for k, v in state.items():
        got = v.full_tensor() if isinstance(v, DTensor) else v
        if not torch.equal(got, want[k]):
            bad.append(k)
    return bad


def _save(state: dict, path: str, group) -> None:
    dcp.save(state, checkpoint_id=path, process_group=group)


def _load(state: dict, path: str, group) -> dict:
    dcp.load(state, checkpoint_id=path, process_group=group)
    return state


def _load_and_check(shape, variant, path, keys, want=None) -> list[str] | None:
    mesh, group = _mesh(shape)
    if mesh is None:
        return None
    state = _load(_state(keys, mesh, variant), path, group)
    return _diffs(state, _wanted(keys) if want is None else want)


# ---- veragged <-> veragged on (2, 2), (4, 1), (1, 2) and plain tensors ----------------------


def _save_2x2_and_reload(root: str) -> dict:
    mesh, group = _mesh((2, 2))
    keys = ALL_KEYS
    saved = _state(keys, mesh, 0, _wanted(keys))
    res = {
        "placements": [
            k for k in keys
            if not _is_step(k) and tuple(saved[k].placements) != _expected_placements(k, mesh, 0)
        ],
        "made": _diffs(saved, _wanted(keys)),
        "empty_pieces": [
            k for k, v in saved.items() if isinstance(v, DTensor) and v.to_local().numel() == 0
        ],
    }
    _save(saved, f"{root}/2x2", group)
    res["2x2->2x2"] = _load_and_check((2, 2), 1, f"{root}/2x2", keys)
    res["2x2->4x1"] = _load_and_check((4, 1), 0, f"{root}/2x2", keys)
    mesh41, group41 = _mesh((4, 1))
    _save(_state(keys, mesh41, 1, _wanted(keys)), f"{root}/4x1", group41)
    res["4x1->1x2"] = _load_and_check((1, 2), 0, f"{root}/4x1", keys)
    mesh12, group12 = _mesh((1, 2))
    if mesh12 is not None:
        _save(_state(keys, mesh12, 1, _wanted(keys)), f"{root}/1x2", group12)
    dist.barrier()  # ranks 2 and 3 wait for the checkpoint they read next
    res["1x2->2x2"] = _load_and_check((2, 2), 0, f"{root}/1x2", keys)
    res["plain->2x2"] = _load_and_check((2, 2), 1, f"{root}/plain", keys)
    return res


def test_veragged_checkpoints_across_dp_tp_splits_and_plain_tensors(tmp_path):
    root = str(tmp_path)
    keys = ALL_KEYS
    dcp.save(_wanted(keys), checkpoint_id=f"{root}/plain", no_dist=True)
    results = get_pool(4, TIMEOUT_S).run(_save_2x2_and_reload, root, timeout=TIMEOUT_S)
    # Ranks holding zero elements of a tensor: every rank for `empty`, dp rank 0 (ranks 0, 1)
    # for the one-hot (0, 1) layouts of uneven TP dims, and TP rank 1 of dp rank 1 for `tiny`.
    empty = [set(res.pop("empty_pieces")) for res in results]
    assert all("model.empty" in e for e in empty), empty
    assert [("model.uneven.wq.weight" in e, "model.tiny" in e) for e in empty] == [
        (True, True), (True, True), (False, False), (False, True)
    ], empty
    for rank, res in enumerate(results):
        for case, bad in res.items():
            if case == "4x1->1x2" and rank >= 2:
                assert bad is None  # not on the (1, 2) mesh
            else:
                assert bad == [], (rank, case, bad)
    for name in ("2x2", "4x1", "1x2"):  # no process group: DCP reads every saved box
        plain = {k: torch.full_like(v, float("nan")) for k, v in _wanted(keys).items()}
        dcp.load(plain, checkpoint_id=f"{root}/{name}", no_dist=True)
        assert [k for k in keys if not torch.equal(plain[k], _full(k))] == [], name


# ---- torch fully_shard + parallelize_module <-> veragged ------------------------------------


class _Block(nn.Module):
    def __init__(self, hidden: int, experts: tuple[int, ...]):
        super().__init__()
        self.wq = nn.Linear(6, hidden)
        self.wo = nn.Linear(hidden, 6)
        self.experts = nn.Parameter(torch.randn(experts))  # fused experts, Shard(0) over EP


class _TorchModel(nn.Module):
    """MODEL's parameters but `tiny` and `empty`; tp does not divide `uneven`'s hidden 9 and 3
    experts."""

    def __init__(self):
        super().__init__()
        self.even = _Block(8, (4, 3, 5))
        self.uneven = _Block(9, (3, 2, 4))
        self.norm = nn.LayerNorm(6, bias=False)


def _torch_model(mesh: DeviceMesh, seed: int):
    """torch's FSDP2 over TP: parallelize_module on mesh["tp"], then fully_shard on the dp dims,
    and AdamW after one step (so that its state exists)."""
    torch.manual_seed(seed)
    model = _TorchModel()
    tp_mesh = mesh["tp"]
    plan = {f"{b}.wq": ColwiseParallel() for b in ("even", "uneven")}
    plan |= {f"{b}.wo": RowwiseParallel() for b in ("even", "uneven")}
    parallelize_module(model, tp_mesh, plan)
    for block in (model.even, model.uneven):
        block.experts = nn.Parameter(
            torch_distribute_tensor(block.experts.detach(), tp_mesh, [Shard(0)])
        )
    torch_fully_shard(model, mesh=mesh["rep", "dp"] if mesh.ndim == 3 else mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    # Gradients set by hand, not by a forward: torch's TP forward infers a Shard(-1)
    # activation's global size as local x tp, which an uneven hidden size (9 over 2) breaks.
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 1.0
    optim.step()
    optim.zero_grad()
    return model, optim


def _torch_state(model, optim) -> tuple[dict, dict, dict]:
    """torch's sharded state dicts for DCP, their tensors flat under the keys of TORCH_KEYS, and
    the optimizer state dict (for set_state_dict)."""
    msd, osd = dsd.get_state_dict(model, optim)
    state = {"model": msd, "optim": {"state": osd["state"]}}  # the tensors (not param_groups)
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, states in osd["state"].items():
        flat |= {f"optim.state.{fqn}.{s}": v for s, v in states.items()}
    assert sorted(flat) == sorted(TORCH_KEYS), sorted(flat)
    return state, flat, osd


def _torch_loads(shape, path) -> list[str]:
    """A torch FSDP2 + TP model on `shape` loads `path`; its values must be `_wanted`."""
    mesh, group = _mesh(shape)
    model, optim = _torch_model(mesh, seed=5)
    state, _, osd = _torch_state(model, optim)
    dcp.load(state, checkpoint_id=path, process_group=group)
    dsd.set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=osd)
    return _diffs(_torch_state(model, optim)[1], _wanted(TORCH_KEYS))


def _torch_interop(root: str) -> dict:
    mesh, group = _mesh((2, 2))
    model, optim = _torch_model(mesh, seed=0)
    state, flat, _ = _torch_state(model, optim)
    res = {"torch_placements": sorted({str(v.placements) for v in flat.values()
                                       if isinstance(v, DTensor)})}
    dcp.save(state, checkpoint_id=f"{root}/torch2x2", process_group=group)
    reference = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()}
    for shape, variant in (((2, 2), 1), ((4, 1), 0), ((1, 2), 1)):
        res[f"torch2x2->{shape}"] = _load_and_check(
            shape, variant, f"{root}/torch2x2", TORCH_KEYS, reference
        )
    for shape in ((2, 2), (4, 1)):
        mesh_s, group_s = _mesh(shape)
        name = f"{root}/ours{shape[0]}x{shape[1]}"
        _save(_state(TORCH_KEYS, mesh_s, 0, _wanted(TORCH_KEYS)), name, group_s)
        for torch_shape in ((2, 2), (4, 1)):
            res[f"ours{shape}->torch{torch_shape}"] = _torch_loads(torch_shape, name)
    return res


def test_torch_fsdp2_tp_checkpoints_load_into_veragged_and_back(tmp_path):
    results = get_pool(4, TIMEOUT_S).run(_torch_interop, str(tmp_path), timeout=TIMEOUT_S)
    for rank, res in enumerate(results):
        # torch's own layouts: FSDP's _StridedShard over TP's Shard(0), Shard(0) x Shard(1), ...
        assert any("_StridedShard" in p for p in res.pop("torch_placements")), res
        for case, bad in res.items():
            if case == "torch2x2->(1, 2)" and rank >= 2:
                assert bad is None
            else:
                assert bad == [], (rank, case, bad)


# ---- every placement path of these layouts, uneven TP dims included ------------------------


def _paths_on_2x2() -> tuple[dict, dict]:
    """full_tensor, redistributions to and from Replicate, Shard, torch's FSDP2 layout and other
    units (each and back, bitwise), the norm, random init and the DCP boxes with their data."""
    mesh, _ = _mesh((2, 2))
    bad, boxes = {}, {}
    for fqn, (_, tp_placement, _, _) in MODEL.items():
        key = f"model.{fqn}"
        full = _full(key)
        dt = veragged.distribute_tensor(full, mesh, _placements(key, mesh, 0))
        torch_fsdp = _StridedShard(0, split_factor=2) if tp_placement == Shard(0) else Shard(0)
        targets = {
            "replicate_dp": [Replicate(), tp_placement],
            "replicate": [Replicate(), Replicate()],
            "shard0_dp": [Shard(0), tp_placement],
            "torch_fsdp2": [torch_fsdp, tp_placement],
            "other_units": _placements(key, mesh, 1),
        }
        bad[fqn] = [] if torch.equal(dt.full_tensor(), full) else ["full_tensor"]
        for name, target in targets.items():
            moved = veragged.redistribute(dt, mesh, target)
            back = veragged.redistribute(moved, mesh, dt.placements)
            if not (torch.equal(moved.full_tensor(), full) and torch.equal(back._local_tensor,
                                                                            dt._local_tensor)):
                bad[fqn].append(name)
        # What fully_shard's training touches: norms (clipping) and initialisation.
        norm = torch.linalg.vector_norm(dt).full_tensor()
        if not torch.allclose(norm, torch.linalg.vector_norm(full), rtol=1e-6):
            bad[fqn].append("vector_norm")
        torch.manual_seed(3)
        drawn = torch.nn.init.normal_(dt.detach().clone())
        torch.manual_seed(3)
        if not torch.equal(drawn.full_tensor(), torch.empty_like(full).normal_()):
            bad[fqn].append("normal_")
        boxes[fqn] = [
            (tuple(c.offsets), tuple(c.sizes),
             dt.__get_tensor_shard__(MetadataIndex(key, c.offsets)).clone())
            for c in dt.__create_chunk_list__()
        ]
    return bad, boxes


def test_placement_paths_and_boxes_with_uneven_tp_dims():
    results = get_pool(4, TIMEOUT_S).run(_paths_on_2x2, timeout=TIMEOUT_S)
    for rank, (bad, _) in enumerate(results):
        assert all(v == [] for v in bad.values()), (rank, bad)
    for fqn in MODEL:  # the distinct boxes of all ranks tile each tensor once, with its data
        full = _full(f"model.{fqn}")
        seen = torch.zeros(full.shape, dtype=torch.int64)
        distinct = {(o, s): d for _, boxes in results for o, s, d in boxes[fqn]}  # TP replicas
        for (offsets, sizes), data in distinct.items():
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            seen[index] += 1
        for _, boxes in results:
            for offsets, sizes, data in boxes[fqn]:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                assert torch.equal(full[index], data), fqn
        assert bool((seen == 1).all()), fqn
    # uneven.wq.weight, units (0, 1): dp rank 1 holds each TP piece (rows 0-4 and 5-8) whole;
    # dp rank 0 names the tensor with an empty box at its end (as torch's empty pieces).
    pieces = [b["uneven.wq.weight"] for _, b in results]
    assert [(o, s) for o, s, _ in pieces[0] + pieces[1]] == [((9, 0), (0, 6))] * 2
    assert [(o, s) for o, s, _ in pieces[2] + pieces[3]] == [((0, 0), (5, 6)), ((5, 0), (4, 6))]


# ---- bad input -------------------------------------------------------------------------------


def _error(fn) -> str | None:
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        return f"{type(e).__name__}: {e}"
    return None


def _bad_input(path: str) -> dict:
    mesh, _ = _mesh((2, 2))
    mesh41, _ = _mesh((4, 1))
    key = "model.uneven.wq.weight"
    full = _full(key)  # (9, 6): TP pieces of 5 and 4 rows
    dt = veragged.distribute_tensor(full, mesh, _placements(key, mesh, 0))
    dcp.save({key: dt}, checkpoint_id=path)
    empty = torch.zeros(0)
    wrong_shape = veragged.distribute_tensor(torch.zeros(9, 7), mesh, _placements(key, mesh, 0))
    cases = {
        "uneven_two_holders": lambda: veragged.distribute_tensor(
            full, mesh, [RaggedShard((0,), (1, 1)), Shard(0)]
        ),
        "redistribute_two_holders": lambda: veragged.redistribute(
            dt, mesh, [RaggedShard((0,), (2, 1)), Shard(0)]
        ),
        "units_vs_mesh": lambda: veragged.distribute_tensor(
            full, mesh, [RaggedShard((0,), (0, 0, 1, 0)), Shard(0)]
        ),
        "placements_vs_mesh": lambda: veragged.distribute_tensor(
            full, mesh, [Replicate(), RaggedShard((0,), (0, 1)), Shard(0)]
        ),
        "split_factor_vs_tp": lambda: veragged.DTensor.from_local(
            empty, mesh, [StridedRaggedShard((0,), (0, 1), 4), Shard(0)], shape=(9, 6)
        ),
        "tp_dim_out_of_range": lambda: veragged.distribute_tensor(
            torch.zeros(6), mesh, [RaggedShard((0,), (1, 1)), Shard(1)]
        ),
        "other_mesh": lambda: veragged.redistribute(dt, mesh41, [Replicate(), Replicate()]),
        "load_wrong_shape": lambda: dcp.load({key: wrong_shape}, checkpoint_id=path),
    }
    return {name: _error(fn) for name, fn in cases.items()}


def test_bad_input_raises_naming_the_values(tmp_path):
    expected = {
        "uneven_two_holders": "Shard(0) on mesh dim 1 next to a RaggedShard needs dim 0 (size 9) "
        "to be divisible by the mesh dim size 2, or local_units with exactly one nonzero entry "
        "(got StridedRaggedShard(dims=(0,), local_units=(1, 1), split_factor=2))",
        "redistribute_two_holders": "local_units=(2, 1)",
        "units_vs_mesh": "has 4 local_units but mesh dim 0 has 2 ranks",
        "placements_vs_mesh": "must have one entry per mesh dim (2)",
        "split_factor_vs_tp": "split_factor=2)",
        "tp_dim_out_of_range": "Shard(1) on mesh dim 1 does not fit a tensor of shape [6]",
        "other_mesh": "redistribute between meshes is not supported",
        "load_wrong_shape": "Size mismatch between saved torch.Size([9, 6]) and current: "
        "torch.Size([9, 7]) for model.uneven.wq.weight",
    }
    results = get_pool(4, TIMEOUT_S).run(_bad_input, str(tmp_path / "ckpt"), timeout=TIMEOUT_S)
    for rank, res in enumerate(results):
        for name, text in expected.items():
            assert res[name] is not None and text in res[name], (rank, name, res[name])
        assert res["uneven_two_holders"].startswith("ValueError"), res


# ---- HSDP x TP: (replicate 2, dp 2, tp 2) on 8 ranks ------------------------------------------


def _save_on(shape, variant, path) -> None:
    mesh, group = _mesh(shape)
    _save(_state(ALL_KEYS, mesh, variant, _wanted(ALL_KEYS)), path, group)


def _hsdp_tp(root: str) -> dict:
    mesh, group = _mesh((2, 2, 2))
    keys = ALL_KEYS
    saved = _state(keys, mesh, 0, _wanted(keys))
    res = {
        "placements": [
            k for k in keys
            if not _is_step(k) and tuple(saved[k].placements) != _expected_placements(k, mesh, 0)
        ],
        "made": _diffs(saved, _wanted(keys)),
    }
    _save(saved, f"{root}/ours3d", group)
    res["3d->3d"] = _load_and_check((2, 2, 2), 1, f"{root}/ours3d", keys)
    res["2x2->3d"] = _load_and_check((2, 2, 2), 1, f"{root}/2x2", keys)
    model, optim = _torch_model(mesh, seed=0)  # torch HSDP (rep, dp) over TP
    state, flat, _ = _torch_state(model, optim)
    dcp.save(state, checkpoint_id=f"{root}/torch3d", process_group=group)
    reference = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()}
    res["torch3d->3d"] = _load_and_check((2, 2, 2), 1, f"{root}/torch3d", TORCH_KEYS, reference)
    res["ours3d->torch3d"] = _torch_loads((2, 2, 2), f"{root}/ours3d")
    res["torch_placements"] = sorted({str(v.placements) for v in flat.values()
                                      if isinstance(v, DTensor)})
    res["reference"] = reference if dist.get_rank() == 0 else None
    return res


def _load_3d_checkpoints_on_2x2(root: str, reference: dict) -> dict:
    return {
        "ours3d->2x2": _load_and_check((2, 2), 0, f"{root}/ours3d", ALL_KEYS),
        "torch3d->2x2": _load_and_check((2, 2), 0, f"{root}/torch3d", TORCH_KEYS, reference),
    }


def test_hsdp_tp_on_8_ranks(tmp_path):
    root = str(tmp_path)
    pool4 = get_pool(4, TIMEOUT_S)
    pool4.run(_save_on, (2, 2), 0, f"{root}/2x2", timeout=TIMEOUT_S)
    pool8 = get_pool(8, TIMEOUT_S)
    try:
        results = pool8.run(_hsdp_tp, root, timeout=TIMEOUT_S)
    finally:
        pool8.shutdown()  # 8 idle processes are not kept for the rest of the session
    reference = results[0].pop("reference")
    for rank, res in enumerate(results):
        res.pop("reference", None)
        assert "Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)" in str(
            res.pop("torch_placements")
        ), rank
        assert all(v == [] for v in res.values()), (rank, res)
    for res in pool4.run(_load_3d_checkpoints_on_2x2, root, reference, timeout=TIMEOUT_S):
        assert all(v == [] for v in res.values()), res
    plain = {k: torch.full_like(v, float("nan")) for k, v in _wanted(ALL_KEYS).items()}
    dcp.load(plain, checkpoint_id=f"{root}/ours3d", no_dist=True)
    assert [k for k, v in plain.items() if not torch.equal(v, _full(k))] == []
