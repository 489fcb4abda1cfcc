"""Port of veScale's `test/dtensor/ragged_shard/test_elementwise.py` (volcengine/veScale, with its
helper `test/dtensor/ragged_shard/utils.py::make_strided_shard`) to veragged.

Each veScale case: a zero int64 RaggedShard DTensor, `dtensor.add_(arange)` with the arange a
*plain* tensor under `implicit_replication()`, then `full_tensor()` must equal the arange exactly
(veScale's base class compares with atol = rtol = 0).

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

All cases run in one spawn of 4 ranks; each case catches its own exception (they raise before
any collective or inside the final gather, on every rank alike) and the parent asserts per case.
"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import implicit_replication

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh
from tests.harness.cases import (
    assert_cases,
    check,
    make_strided_shard,
    run_cases,
    run_groups,
    shape_units_cases,
)
from tests.harness.device import rank_device_type

WORLD = 4

# (dims, local_units) of veScale's test_ragged_shard_element_add, on 32x128 then 16x4x64.
RAGGED_CASES = [
    ((32, 128), (0,), (0, 1, 5, 2)),
    ((32, 128), (0, 1), (0, 1, 5, 2)),
    ((32, 128), (0,), (0, 1, 0, 0)),
    ((32, 128), (0, 1), (455, 1000, 2000, 641)),
    ((16, 4, 64), (0,), (0, 1, 5, 2)),
    ((16, 4, 64), (0, 1), (0, 1, 5, 2)),
    ((16, 4, 64), (0,), (0, 1, 0, 0)),
]
# veScale's test_strided_ragged_shard_element_add, on 64x128 then 16x8x64, fsdp units merged.
STRIDED_CASES = [
    ((64, 128), (0,), (1, 7)),
    ((64, 128), (0, 1), (1, 7)),
    ((64, 128), (0,), (0, 1)),
    ((64, 128), (0, 1), (1455, 2641)),
    ((16, 8, 64), (0,), (1, 7)),
    ((16, 8, 64), (0, 1), (1, 7)),
    ((16, 8, 64), (0,), (0, 1)),
]


def _run_add(dtensor):
    """veScale's _run_add: in-place add of a plain arange under implicit_replication."""
    add_tensor = torch.arange(0, dtensor.numel()).view(dtensor.shape)
    with implicit_replication():
        dtensor.add_(add_tensor)
    result = dtensor.full_tensor()
    check(result.shape == add_tensor.shape, f"full_tensor shape {tuple(result.shape)}")
    check(result.dtype == add_tensor.dtype, f"full_tensor dtype {result.dtype}")
    check(torch.equal(result, add_tensor), "full_tensor() != arange (exact)")


def _ranks():
    mesh = get_mesh()
    mesh2 = init_device_mesh(rank_device_type(), (2, 2), mesh_dim_names=("fsdp", "ep"))

    def ragged(shape, dims, units):
        tensor = torch.zeros(32, 128, dtype=torch.int64).view(shape)
        _run_add(veragged.distribute_tensor(tensor.clone(), mesh, (RaggedShard(dims, units),)))

    def strided(shape, dims, units):
        tensor = torch.zeros(64, 128, dtype=torch.int64).view(shape)
        _run_add(make_strided_shard(tensor.clone(), mesh2, dims, units))

    return {
        "test_ragged_shard_element_add": run_cases(shape_units_cases(RAGGED_CASES, ragged)),
        "test_strided_ragged_shard_element_add": run_cases(
            shape_units_cases(STRIDED_CASES, strided, strided=True)
        ),
    }


@pytest.fixture(scope="module")
def results():
    return run_groups(_ranks, WORLD, timeout=180)


# veScale: TestElementwise.test_ragged_shard_element_add
def test_ragged_shard_element_add(results):
    assert_cases("elementwise ragged", results["test_ragged_shard_element_add"])


# veScale: TestElementwise.test_strided_ragged_shard_element_add
def test_strided_ragged_shard_element_add(results):
    assert_cases("elementwise strided", results["test_strided_ragged_shard_element_add"])
