"""RaggedShard composed with TP/EP Shard on a 2x2 mesh, DCP of such layouts, and bad input."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import veragged
from veragged import RaggedShard, StridedRaggedShard
from veragged.placement import normalize_placements
from tests.harness import get_mesh, run_on_ranks
from tests.harness.device import rank_device_type


def _full(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _block_slice(block, placement, coordinate):
    numel, offset = placement.local_numel_and_offset(block.shape, coordinate)
    return block.reshape(-1)[offset : offset + numel]


def _compositions(path):
    mesh = get_mesh()
    dp, tp = mesh.get_coordinate()
    res = {}
    # (RaggedShard, Shard(0)): FSDP over EP/TP. Normalised to StridedRaggedShard; each tp piece of
    # dim 0 is ragged-sharded over dp.
    full = _full((8, 3), 1)
    dt = veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (1, 3)), Shard(0)])
    res["strided_spelling"] = dt.placements == (StridedRaggedShard((0,), (1, 3), 2), Shard(0))
    res["strided_local"] = torch.equal(
        dt.to_local(), _block_slice(full[tp * 4 : tp * 4 + 4], dt.placements[0], dp)
    )
    res["strided_full"] = torch.equal(dt.full_tensor(), full)
    res["strided_gather_dp"] = torch.equal(
        dt.redistribute(mesh, [Replicate(), Shard(0)]).to_local(), full[tp * 4 : tp * 4 + 4]
    )
    moved = dt.redistribute(mesh, [StridedRaggedShard((0,), (4, 0), 2), Shard(0)])
    res["strided_to_root"] = torch.equal(
        moved.full_tensor(), full
    ) and moved.to_local().numel() == (12 if dp == 0 else 0)
    # (RaggedShard, Shard(1)): the LCM rule keeps the ragged rows whole across dim 1.
    full2 = _full((4, 6), 2)
    dt2 = veragged.distribute_tensor(full2, mesh, [RaggedShard((0, 1), (1, 1)), Shard(1)])
    res["lcm_dims"] = dt2.placements == (RaggedShard((0,), (1, 1)), Shard(1))
    res["lcm_local"] = torch.equal(
        dt2.to_local(), full2[dp * 2 : dp * 2 + 2, tp * 3 : tp * 3 + 3].reshape(-1)
    )
    res["lcm_full"] = torch.equal(dt2.full_tensor(), full2)
    # (Shard(0), RaggedShard) and HSDP-style (Replicate, RaggedShard).
    full3 = _full((6, 5), 3)
    dt3 = veragged.distribute_tensor(full3, mesh, [Shard(0), RaggedShard((0, 1), (4, 11))])
    res["shard_then_ragged"] = torch.equal(dt3.full_tensor(), full3)
    dt4 = veragged.distribute_tensor(full3, mesh, [Replicate(), RaggedShard((0,), (0, 1))])
    res["hsdp"] = torch.equal(dt4.full_tensor(), full3) and torch.equal(
        dt4.to_local(), full3.reshape(-1) if tp == 1 else full3.reshape(-1)[:0]
    )
    partial = DTensor.from_local(full3, mesh, [Partial(), Replicate()])
    res["partial_then_ragged"] = torch.allclose(
        veragged.redistribute(
            partial, mesh, [Replicate(), RaggedShard((0,), (1, 1))]
        ).full_tensor(),
        2 * full3,
    )
    # from_local with the explicit StridedRaggedShard, and the norm over both mesh dims.
    again = veragged.DTensor.from_local(
        dt.to_local(), mesh, dt.placements, shape=full.shape, stride=full.stride()
    )
    res["from_local"] = torch.equal(again.full_tensor(), full)
    res["norm"] = torch.allclose(
        torch.linalg.vector_norm(dt).full_tensor(), torch.linalg.vector_norm(full)
    )
    # Backward through the 2-step gather.
    x = veragged.distribute_tensor(
        full.clone().requires_grad_(), mesh, [RaggedShard((0,), (1, 3)), Shard(0)]
    )
    (x.full_tensor() * full).sum().backward()
    res["backward"] = torch.equal(x.grad.to_local(), dt.to_local())
    dcp.save({"strided": dt, "lcm": dt2, "shard_ragged": dt3, "hsdp": dt4}, checkpoint_id=path)
    return res


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_compositions_on_2x2_mesh(tmp_path):
    path = str(tmp_path / "ckpt")
    for res in run_on_ranks(
        _compositions, 4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), args=(path,), timeout=180
    ):
        assert all(res.values()), res
    plain = {
        "strided": torch.empty(8, 3),
        "lcm": torch.empty(4, 6),
        "shard_ragged": torch.empty(6, 5),
        "hsdp": torch.empty(6, 5),
    }
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert torch.equal(plain["strided"], _full((8, 3), 1))
    assert torch.equal(plain["lcm"], _full((4, 6), 2))
    assert torch.equal(plain["shard_ragged"], _full((6, 5), 3)) and torch.equal(
        plain["hsdp"], _full((6, 5), 3)
    )


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _bad_input():
    mesh = get_mesh()
    full = _full((6, 4))
    other_mesh = init_device_mesh(rank_device_type(), (2, 2))
    dt = veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (1, 1, 1, 3))])
    wrong_numel = full.reshape(-1)[:5] if dist.get_rank() == 1 else dt.to_local()
    return {
        "units_length": _error(
            lambda: veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (1, 1, 1))])
        ),
        "not_dividing": _error(
            lambda: veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (1, 1, 1, 1))])
        ),
        "mesh_mismatch": _error(
            lambda: veragged.redistribute(dt, other_mesh, [Replicate(), Replicate()])
        ),
        "from_local_numel": _error(
            lambda: veragged.DTensor.from_local(
                wrong_numel, mesh, [RaggedShard((0,), (1, 1, 1, 3))], shape=(6, 4), run_check=True
            )
        ),
        "from_local_shape": _error(
            lambda: veragged.DTensor.from_local(full, mesh, [RaggedShard((0,), (1, 1, 1, 3))])
        ),
        "two_ragged": _error(
            lambda: veragged.distribute_tensor(
                full, other_mesh, [RaggedShard((0,), (1, 1)), RaggedShard((0,), (1, 1))]
            )
        ),
        "strided_needed": _error(
            lambda: veragged.DTensor.from_local(
                full, other_mesh, [RaggedShard((0,), (1, 1)), Shard(0)], shape=(6, 4)
            )
        ),
        "uneven_shard": _error(
            lambda: veragged.distribute_tensor(
                _full((5, 4)), other_mesh, [RaggedShard((0,), (1, 1)), Shard(0)]
            )
        ),
    }


def test_bad_input_raises_value_error_on_every_rank():
    expected = {
        "units_length": "has 3 local_units but mesh dim 0 has 4 ranks",
        "not_dividing": "sum(local_units) = 4 does not divide the 6 rows",
        "mesh_mismatch": "redistribute between meshes is not supported",
        "from_local_shape": "needs the global shape=",
        "two_ragged": "at most one RaggedShard",
        "strided_needed": "StridedRaggedShard((0,), local_units, split_factor=2)",
        "uneven_shard": "dim 0 (size 5) to be divisible by the mesh dim size 2",
    }
    for rank, res in enumerate(run_on_ranks(_bad_input, 4, timeout=120)):
        for key, text in expected.items():
            assert res[key] is not None and text in res[key], (rank, key, res[key])
        text = (
            "rank 1 holds 5 elements but"
            if rank == 1
            else "another rank's local tensor has the wrong number"
        )
        assert text in res["from_local_numel"], res["from_local_numel"]


def _lcm_rule():
    mesh = get_mesh()
    full = torch.arange(16.0).reshape(2, 8)  # TP blocks (2, 4): 8 element rows, 2 whole rows

    def normalized(units):
        return normalize_placements((2, 8), mesh, [RaggedShard((0, 1), units), Shard(1)])[0]

    exact = normalized((1, 1))  # boundary at element 4 of 8: a whole row of 4, units kept
    inexact = normalized((3, 5))  # boundary at element 3: inside a row, dims stay (0, 1)
    dt = veragged.distribute_tensor(full, mesh, [RaggedShard((0, 1), (3, 5)), Shard(1)])
    block = full.chunk(2, dim=1)[mesh.get_coordinate()[1]].reshape(-1)
    mine = block[:3] if mesh.get_coordinate()[0] == 0 else block[3:]
    return (exact == RaggedShard((0,), (1, 1)), inexact == RaggedShard((0, 1), (3, 5)),
            normalized((4, 4)) == RaggedShard((0,), (1, 1)),  # 8 does not divide 2 rows
            torch.equal(dt.to_local(), mine), torch.equal(dt.full_tensor(), full))


def test_lcm_rule_recomputes_units_or_keeps_the_rows_of_the_block():
    """(RaggedShard, Shard(1)): units counted in rows that cut dim 1 become units of whole
    rows when every boundary falls on one; otherwise the ragged split stays on the TP block's
    finer rows (veScale's reading) and the data is right either way."""
    for result in run_on_ranks(_lcm_rule, 4, mesh_shape=(2, 2), timeout=120):
        assert all(result), result
