"""Port of veScale's `test/dtensor/ragged_shard/test_norm.py` (volcengine/veScale, with its helper
`test/dtensor/ragged_shard/utils.py::make_strided_shard`) to veragged.

Each veScale case: `torch.linalg.vector_norm(dtensor, ord=2, dim=...)` of a RaggedShard (or
strided RaggedShard) DTensor of a float32 arange, then `.full_tensor()`, must match the
single-process norm of the whole tensor with atol = rtol = 1e-6 (veScale's tolerances; shape and
dtype must match too).

Adaptations (veScale runs world 8 on CUDA, we run 4 gloo ranks on CPU):
- 1-D mesh of 4: veScale's 8-entry units are its first four entries; the last four were zeros,
  so `(0, 1, 5, 2, 0, 0, 0, 0)` -> `(0, 1, 5, 2)` (uneven, rank 0 empty),
  `(0, 1, 0, 0, 0, 0, 0, 0)` -> `(0, 1, 0, 0)` (one-hot on rank 1) and
  `(455, 1000, 2000, 641, 0, 0, 0, 0)` -> `(455, 1000, 2000, 641)` (sums unchanged).
- Strided cases: veScale's `(fsdp=4, ep=2)` mesh becomes `(fsdp=2, ep=2)`; its 4-entry units
  become 2 entries by merging adjacent fsdp ranks (rank i holds what ranks 2i, 2i+1 held, sums
  unchanged): `(0, 1, 5, 2)` -> `(1, 7)`, `(455, 1000, 2000, 641)` -> `(1455, 2641)`; the
  one-hot `(0, 1, 0, 0)` -> `(0, 1)` (kept one-hot off rank 0, rank 0 empty).
- API mapping: veScale's `_StridedRaggedShard(dims, local_units, split_factor=2)` is
  `veragged.StridedRaggedShard(dims, local_units, 2)`; its raw
  `DTensor(local, DTensorSpec(mesh, placements, TensorMeta(...)))` is
  `veragged.DTensor.from_local(local, mesh, placements, shape=..., stride=...)`.

All eight veScale tests run in one spawn of 4 ranks (the 2x2 mesh is built inside it); each case
catches its own exception and the parent asserts per case, one pytest test per veScale test.
"""

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh
from tests.harness.cases import (
    assert_cases,
    make_strided_shard,
    run_cases,
    run_groups,
    shape_units_cases,
)
from tests.harness.device import rank_device_type

WORLD = 4

# (shape, dims, local_units) of veScale's TestNorm.test_ragged_shard_norm_*: 32x128, then 16x4x64.
RAGGED_CASES = [
    ((32, 128), (0,), (0, 1, 5, 2)),
    ((32, 128), (0, 1), (0, 1, 5, 2)),
    ((32, 128), (0,), (0, 1, 0, 0)),
    ((32, 128), (0, 1), (455, 1000, 2000, 641)),
    ((16, 4, 64), (0,), (0, 1, 5, 2)),
    ((16, 4, 64), (0, 1), (0, 1, 5, 2)),
    ((16, 4, 64), (0,), (0, 1, 0, 0)),
]
# test_ragged_shard_norm_dim2: only the 16x4x64 view.
RAGGED_DIM2_CASES = RAGGED_CASES[4:]
# veScale's test_strided_ragged_shard_norm_*: 64x128, then 16x8x64, fsdp units merged (above).
STRIDED_CASES = [
    ((64, 128), (0,), (1, 7)),
    ((64, 128), (0, 1), (1, 7)),
    ((64, 128), (0,), (0, 1)),
    ((64, 128), (0, 1), (1455, 2641)),
    ((16, 8, 64), (0,), (1, 7)),
    ((16, 8, 64), (0, 1), (1, 7)),
    ((16, 8, 64), (0,), (0, 1)),
]
STRIDED_DIM2_CASES = STRIDED_CASES[4:]


def _run_norm(dtensor, local_tensor, *, norm_ord, norm_dim):
    """veScale's _run_norm: the DTensor norm, gathered, against the norm of the whole tensor."""
    full_norm = torch.linalg.vector_norm(local_tensor, ord=norm_ord, dim=norm_dim)
    dtensor_partial_norm = torch.linalg.vector_norm(dtensor, ord=norm_ord, dim=norm_dim)
    dtensor_full_norm = dtensor_partial_norm.full_tensor()
    torch.testing.assert_close(dtensor_full_norm, full_norm, atol=1e-06, rtol=1e-06)


# veScale's TestNorm tests, one pytest case each: (name, label, strided, cases, norm dim).
NORM_TESTS = [
    ("test_ragged_shard_norm_no_dim", "norm ragged no dim", False, RAGGED_CASES, None),
    ("test_ragged_shard_norm_dim0", "norm ragged dim0", False, RAGGED_CASES, 0),
    ("test_ragged_shard_norm_dim1", "norm ragged dim1", False, RAGGED_CASES, 1),
    ("test_ragged_shard_norm_dim2", "norm ragged dim2", False, RAGGED_DIM2_CASES, 2),
    ("test_strided_ragged_shard_norm_no_dim", "norm strided no dim", True, STRIDED_CASES, None),
    ("test_strided_ragged_shard_norm_dim0", "norm strided dim0", True, STRIDED_CASES, 0),
    ("test_strided_ragged_shard_norm_dim1", "norm strided dim1", True, STRIDED_CASES, 1),
    ("test_strided_ragged_shard_norm_dim2", "norm strided dim2", True, STRIDED_DIM2_CASES, 2),
]


def _ranks():
    mesh = get_mesh()
    mesh2 = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("fsdp", "ep"))

    def ragged(norm_dim, shape, dims, units):
        tensor = torch.arange(0, 32 * 128, dtype=torch.float32).view(shape)
        dtensor = veragged.distribute_tensor(tensor, mesh, (RaggedShard(dims, units),))
        _run_norm(dtensor, tensor, norm_ord=2, norm_dim=norm_dim)

    def strided(norm_dim, shape, dims, units):
        tensor = torch.arange(0, 64 * 128, dtype=torch.float32).view(shape)
        dtensor = make_strided_shard(tensor, mesh2, dims, units)
        _run_norm(dtensor, tensor, norm_ord=2, norm_dim=norm_dim)

    groups = {
        name: shape_units_cases(
            cases,
            functools.partial(strided if is_strided else ragged, norm_dim),
            strided=is_strided,
            suffix=f" dim={norm_dim}",
        )
        for name, _, is_strided, cases, norm_dim in NORM_TESTS
    }
    return {name: run_cases(cases) for name, cases in groups.items()}


@pytest.fixture(scope="module")
def results():
    return run_groups(_ranks, WORLD, timeout=180)


# veScale: TestNorm.<name> for each name of NORM_TESTS.
@pytest.mark.parametrize(
    "name, label", [t[:2] for t in NORM_TESTS], ids=[t[0] for t in NORM_TESTS]
)
def test_norm(results, name, label):
    assert_cases(label, results[name])
