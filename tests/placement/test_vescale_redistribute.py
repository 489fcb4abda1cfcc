"""Port of veScale's `test/dtensor/ragged_shard/test_redistribute.py` (volcengine/veScale) to
veragged: RaggedShard -> Replicate forward/backward (the backward without communication),
RaggedShard -> Shard(d) against a direct `distribute_tensor`, RaggedShard -> RaggedShard over
random multinomial and one-hot ("Muon") `local_units`, and 2-D meshes with
`(StridedRaggedShard, Shard(0))` / `(RaggedShard, Shard(1))` then `full_tensor()`. Assertions are
exact (veScale's base class compares with atol = rtol = 0).

Adaptations (veScale runs world 8 on CUDA, we run 4 gloo ranks on CPU):
- `local_units` keep veScale's generators with its seeds: `np.random.default_rng(42).multinomial`
  (a fresh generator per call) in test_ragged_to_replicate_forward_backward, and
  `np.random.seed(42)` then a one-hot unit 1 time in 4 (`np.random.randint(1, 5) == 1`) else
  `np.random.multinomial(N, uniform)` elsewhere; only the number of ranks k drawn for is 4 (or the
  2-D mesh's ragged dim) instead of 8, so the draws differ from veScale's. The units are passed as
  drawn, i.e. as numpy integers.
- test_ragged_to_replicate_forward_backward: veScale's sizes `(world * 3 + {0, 1, 2}, 3)` and
  their transposes with world = 4.
- veScale's 10 random repetitions are kept (14 cases each per repetition in
  test_ragged_to_shard_forward and test_ragged_to_ragged_forward, 8 per mesh in
  test_ragged_shard_2d).
- test_ragged_shard_2d: meshes `(ragged, other)` = (1, 4), (2, 2), (4, 1) for veScale's (1, 8),
  (2, 4), (4, 2), (8, 1). veScale draws each dim as `randint(16, 128) * other`; on (1, 4) that
  gives 3-D tensors of up to 508^3 floats (the first draw here is 472x268x432, 220 MB per copy
  on each of 4 CPU ranks; one repetition per mesh took 3x the in-rank time of all ten below),
  so each draw is instead rounded up to a multiple of `other` (the divisibility the
  multiplication was for): sizes stay in 16..128 (the same randint calls are made).
- test_stride_ragged_to_replicate_forward_backward is not ported: veScale disables it (its first
  line is `return  # TODO(jiacheng) reenable`) and its body asserts a 1-D mesh on a 2-D one.
- API mapping: veScale's `_StridedRaggedShard(dims=, local_units=, split_factor=)` is
  `veragged.StridedRaggedShard(dims, local_units, split_factor)`; its raw
  `DTensor(local, DTensorSpec(mesh, placements, TensorMeta(...)), requires_grad=True)` is
  `veragged.DTensor.from_local(local.requires_grad_(), mesh, placements, shape=, stride=)`;
  `distribute_tensor` and `dt.redistribute` are veragged's (torch's for non-ragged placements).

All tests run in one spawn of 4 ranks (the 2-D meshes are built inside it); each case catches its
own exception and the parent asserts per case, one pytest test per veScale test.
"""

import math

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from veragged import RaggedShard, StridedRaggedShard
from tests.harness import get_mesh
from tests.harness.cases import assert_cases, check, error, run_cases, run_groups
from tests.harness.device import rank_device_type

WORLD = 4
REPEATS_1D = 10  # as veScale
REPEATS_2D = 10  # as veScale, per mesh
MESHES_2D = [(1, 4), (2, 2), (4, 1)]  # veScale: (1, 8), (2, 4), (4, 2), (8, 1)


def _units_rng42(N: int, k: int):
    """test_ragged_to_replicate_forward_backward's generator: k non-negative ints summing to N."""
    rng = np.random.default_rng(42)
    probs = np.full(k, 1.0 / k)
    return tuple(rng.multinomial(N, probs))


def _units_muon(N: int, k: int):
    """The other tests' generator: one-hot 1 time in 4 ("explicit test for Muon case"), else
    k non-negative ints summing to N; global np.random state."""
    if np.random.randint(1, 5) == 1:
        rt = np.random.randint(0, k)
        return tuple([1 if i == rt else 0 for i in range(k)])
    probs = np.full(k, 1.0 / k)
    return tuple(np.random.multinomial(N, probs))


def _seed42():
    np.random.seed(42)
    torch.manual_seed(42)


def _assert_ragged_1d(rank, dt, local_units, expected_tensor):
    """veScale's assert_ragged_1d: the local shard is this rank's slice of the flat tensor."""
    local_slice = dt._local_tensor
    local_length = expected_tensor.numel() // sum(local_units) * local_units[rank]
    offset = expected_tensor.numel() // sum(local_units) * sum(local_units[:rank])
    want = expected_tensor.reshape(-1)[offset : offset + local_length]
    check(
        local_slice.shape == (local_length,) and torch.equal(local_slice.view(-1), want),
        f"rank {rank}: local shard ({local_slice.numel()} elements) is not elements "
        f"[{offset}, {offset + local_length}) of the tensor",
    )


def _ragged_to_replicate(mesh):
    """veScale: test_ragged_to_replicate_forward_backward."""
    world = mesh.size()
    input_sizes = [
        (world * 3, 3), (world * 3 + 1, 3), (world * 3 + 2, 3),
        (3, world * 3), (3, world * 3 + 1), (3, world * 3 + 2),
    ]
    comm_mode = CommDebugMode()
    cases = []
    for input_size in input_sizes:
        def case(input_size=input_size):
            expected_tensor = torch.randn(input_size, requires_grad=True)
            dims = tuple(range(expected_tensor.ndim))
            local_units = _units_rng42(expected_tensor.numel(), mesh.size())
            shard_spec = [RaggedShard(dims, local_units)]
            dtensor = veragged.distribute_tensor(expected_tensor, mesh, shard_spec)
            with comm_mode:
                reshard_dtensor = dtensor.redistribute(mesh, [Replicate()])
            check(reshard_dtensor.size() == torch.Size(input_size),
                   f"size {tuple(reshard_dtensor.size())}")
            check(torch.equal(expected_tensor, reshard_dtensor.to_local()),
                   "replicated local tensor != the tensor")
            grad_output = torch.ones_like(reshard_dtensor)
            with comm_mode:
                reshard_dtensor.backward(grad_output)
            grad_input = dtensor.grad
            check(grad_input is not None, "dtensor.grad is None")
            check(tuple(grad_input.placements) == tuple(shard_spec),
                   f"grad placements {grad_input.placements}")
            check(torch.equal(grad_input.to_local(), torch.ones(dtensor.to_local().size())),
                   "grad local tensor is not all ones")
            check(comm_mode.get_total_counts() == 0,
                   f"backward ran {comm_mode.get_total_counts()} collectives, want 0")

        cases.append((f"{input_size}", case))
    return run_cases(cases)


def _ragged_to_shard(mesh):
    """veScale: test_ragged_to_shard_forward (REPEATS_1D repetitions)."""
    _seed42()
    out = []
    for rep in range(REPEATS_1D):
        nums = [np.random.randint(16, 128) for _ in range(3)]
        for input_size in [tuple(nums[:1]), tuple(nums[:2]), tuple(nums[:3])]:
            ndim = len(input_size)
            expected_tensor = torch.randn(input_size, requires_grad=True)
            for src_dim, dst_shard_dim in [(a, b) for a in range(ndim) for b in range(ndim)]:
                src_dims = tuple(range(src_dim + 1))
                src_local_units = _units_muon(
                    math.prod(expected_tensor.shape[: src_dim + 1]), mesh.size()
                )

                def case(src_dims=src_dims, src_local_units=src_local_units,
                         dst_shard_dim=dst_shard_dim, expected_tensor=expected_tensor):
                    src_shard_spec = [RaggedShard(src_dims, src_local_units)]
                    dst_shard_spec = [Shard(dst_shard_dim)]
                    src_dtensor = veragged.distribute_tensor(expected_tensor, mesh, src_shard_spec)
                    dst_dtensor = src_dtensor.redistribute(mesh, dst_shard_spec)
                    golden = veragged.distribute_tensor(expected_tensor, mesh, dst_shard_spec)
                    check(dst_dtensor.shape == golden.shape, f"shape {tuple(dst_dtensor.shape)}")
                    check(torch.equal(dst_dtensor._local_tensor, golden._local_tensor),
                           "local tensor != distribute_tensor(tensor, Shard) local tensor")

                name = (f"rep {rep} {list(input_size)} RaggedShard({src_dims}, "
                        f"{tuple(int(u) for u in src_local_units)}) -> Shard({dst_shard_dim})")
                out.extend(run_cases([(name, case)]))
    return out


def _ragged_to_ragged(mesh):
    """veScale: test_ragged_to_ragged_forward (REPEATS_1D repetitions)."""
    _seed42()
    rank = mesh.get_coordinate()[0]
    out = []
    for rep in range(REPEATS_1D):
        nums = [np.random.randint(16, 128) for _ in range(3)]
        for input_size in [tuple(nums[:1]), tuple(nums[:2]), tuple(nums[:3])]:
            ndim = len(input_size)
            expected_tensor = torch.randn(input_size, requires_grad=True)
            for src_dim, dst_dim in [(a, b) for a in range(ndim) for b in range(ndim)]:
                src_dims = tuple(range(src_dim + 1))
                dst_dims = tuple(range(dst_dim + 1))
                src_local_units = _units_muon(
                    math.prod(expected_tensor.shape[: src_dim + 1]), mesh.size()
                )
                dst_local_units = _units_muon(
                    math.prod(expected_tensor.shape[: dst_dim + 1]), mesh.size()
                )

                def case(src_dims=src_dims, dst_dims=dst_dims, src_local_units=src_local_units,
                         dst_local_units=dst_local_units, expected_tensor=expected_tensor):
                    src_shard_spec = [RaggedShard(src_dims, src_local_units)]
                    dst_shard_spec = [RaggedShard(dst_dims, dst_local_units)]
                    src_dtensor = veragged.distribute_tensor(expected_tensor, mesh, src_shard_spec)
                    _assert_ragged_1d(rank, src_dtensor, src_local_units, expected_tensor)
                    dst_dtensor = src_dtensor.redistribute(mesh, dst_shard_spec)
                    _assert_ragged_1d(rank, dst_dtensor, dst_local_units, expected_tensor)

                name = (f"rep {rep} {list(input_size)} RaggedShard({src_dims}, "
                        f"{tuple(int(u) for u in src_local_units)}) -> RaggedShard({dst_dims}, "
                        f"{tuple(int(u) for u in dst_local_units)})")
                out.extend(run_cases([(name, case)]))
    return out


def _ragged_shard0_2d(global_tensor, device_mesh, ragged_dim, shard_dim):
    """veScale's inner test_ragged_shard0_2d: ragged over the `ragged` mesh dim of each Shard
    piece over `other`, assembled as a 2-D DTensor by hand, then full_tensor()."""
    dt_shard = veragged.distribute_tensor(global_tensor, device_mesh["other"], [Shard(shard_dim)])
    shard_tensor = dt_shard._local_tensor
    check(shard_tensor.ndim == global_tensor.ndim, "Shard local tensor lost dims")
    ragged_dims = tuple(range(ragged_dim + 1))
    ragged_lst = _units_muon(
        math.prod(shard_tensor.shape[: ragged_dim + 1]), device_mesh["ragged"].size()
    )
    check(sum(ragged_lst) != 0, f"ragged_lst: {ragged_lst}")

    def run():
        dt_2d = veragged.distribute_tensor(
            shard_tensor, device_mesh["ragged"], [RaggedShard(ragged_dims, ragged_lst)]
        )
        if shard_dim == 0:
            placements = [
                StridedRaggedShard(ragged_dims, ragged_lst, device_mesh["other"].size()),
                Shard(shard_dim),
            ]
        else:
            placements = [RaggedShard(ragged_dims, ragged_lst), Shard(shard_dim)]
        dt_2d = veragged.DTensor.from_local(
            dt_2d._local_tensor.detach().requires_grad_(),
            device_mesh,
            placements,
            shape=dt_shard.size(),
            stride=dt_shard.stride(),
        )
        rank = device_mesh["ragged"].get_coordinate()[0]
        _assert_ragged_1d(rank, dt_2d, ragged_lst, shard_tensor)
        full_tensor = dt_2d.full_tensor()
        check(full_tensor.shape == global_tensor.shape, f"full shape {tuple(full_tensor.shape)}")
        check(torch.equal(full_tensor, global_tensor), "full_tensor() != the tensor")

    kind = "StridedRaggedShard" if shard_dim == 0 else "RaggedShard"
    return (f"{kind}({ragged_dims}, {tuple(int(u) for u in ragged_lst)}), Shard({shard_dim})", run)


def _ragged_shard_2d():
    """veScale: test_ragged_shard_2d (REPEATS_2D repetitions per mesh)."""
    _seed42()
    out = []
    for mesh_size in MESHES_2D:
        device_mesh = init_device_mesh(rank_device_type(), mesh_size, mesh_dim_names=["ragged", "other"])
        other = mesh_size[1]
        for rep in range(REPEATS_2D):
            # veScale: randint(16, 128) * other; rounded up to a multiple of other instead.
            nums = [-(-np.random.randint(16, 128) // other) * other for _ in range(3)]
            for input_size in [tuple(nums[:1]), tuple(nums[:2]), tuple(nums[:3])]:
                ndim = len(input_size)
                global_tensor = torch.randn(input_size, requires_grad=True)
                pairs = [(src_dim, 0) for src_dim in range(ndim)]  # [StridedRaggedShard, Shard(0)]
                if ndim > 1:
                    pairs.append((0, 1))  # [RaggedShard, Shard(1)]
                for ragged_dim, shard_dim in pairs:
                    try:  # draws the units: must run whatever the previous case did
                        name, run = _ragged_shard0_2d(
                            global_tensor, device_mesh, ragged_dim, shard_dim
                        )
                    except Exception as exc:  # noqa: BLE001
                        out.append((f"{mesh_size} rep {rep} {list(input_size)} setup",
                                    error(exc)))
                        continue
                    out.extend(
                        run_cases([(f"mesh {mesh_size} rep {rep} {list(input_size)} {name}", run)])
                    )
    return out


def _ranks():
    mesh = get_mesh()
    return {
        "test_ragged_to_replicate_forward_backward": _ragged_to_replicate(mesh),
        "test_ragged_to_shard_forward": _ragged_to_shard(mesh),
        "test_ragged_to_ragged_forward": _ragged_to_ragged(mesh),
        "test_ragged_shard_2d": _ragged_shard_2d(),
    }


@pytest.fixture(scope="module")
def results():
    return run_groups(_ranks, WORLD, timeout=240)


# veScale: RedistributeTest.test_ragged_to_replicate_forward_backward
def test_ragged_to_replicate_forward_backward(results):
    assert_cases(
        "ragged -> replicate fwd/bwd", results["test_ragged_to_replicate_forward_backward"]
    )


# veScale: RedistributeTest.test_ragged_to_shard_forward
def test_ragged_to_shard_forward(results):
    assert_cases("ragged -> shard", results["test_ragged_to_shard_forward"])


# veScale: RedistributeTest.test_ragged_to_ragged_forward
def test_ragged_to_ragged_forward(results):
    assert_cases("ragged -> ragged", results["test_ragged_to_ragged_forward"])


# veScale: RedistributeTest.test_ragged_shard_2d
def test_ragged_shard_2d(results):
    assert_cases("ragged shard 2d", results["test_ragged_shard_2d"])
