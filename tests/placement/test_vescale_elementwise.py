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

import itertools
import os
import traceback

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import implicit_replication

import veragged
from veragged import RaggedShard, StridedRaggedShard
from veragged.testing import get_mesh, run_on_ranks

WORLD = 4
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def _error(exc: BaseException) -> str:
    """First line of the error and the innermost veragged source line that raised."""
    first = (str(exc).strip().splitlines() or [""])[0]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/veragged/" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f" [at {os.path.relpath(f.filename, _ROOT)}:{f.lineno}: {f.line}]"
    return f"{type(exc).__name__}: {first}{where}"


def _run_cases(cases):
    """[(name, None | error text)] for each (name, fn) case; fn raises AssertionError to fail."""
    out = []
    for name, fn in cases:
        try:
            fn()
            out.append((name, None))
        except Exception as exc:  # noqa: BLE001 - every failure is reported per case
            out.append((name, _error(exc)))
    return out


def _assert_cases(label, per_rank):
    """Fail with 'label: n of m cases pass' and one line per failing case (first rank's text)."""
    names = [name for name, _ in per_rank[0]]
    failed = []
    for i, name in enumerate(names):
        errs = {r: res[i][1] for r, res in enumerate(per_rank) if res[i][1] is not None}
        if errs:
            r = min(errs)
            failed.append(f"  {name}: rank {r} (of ranks {sorted(errs)}): {errs[r]}")
    msg = f"{label}: {len(names) - len(failed)} of {len(names)} cases pass"
    if failed:
        pytest.fail("\n".join([msg, *failed]), pytrace=False)


def _check(cond, what):
    if not cond:
        raise AssertionError(what)


def _make_strided_shard(tensor, device_mesh, dims, local_units):
    """veScale's make_strided_shard: ragged over fsdp of each ep piece of dim 0, built from the
    local slice by hand (veScale's raw DTensor constructor -> veragged.DTensor.from_local)."""
    fsdp_rank = device_mesh["fsdp"].get_local_rank()
    ep_rank = device_mesh["ep"].get_local_rank()
    placements = (StridedRaggedShard(dims, local_units, 2), Shard(0))
    accum = (0, *itertools.accumulate(local_units))
    factor = tensor.shape[0] // device_mesh["ep"].size()
    local = tensor[factor * ep_rank : factor * (ep_rank + 1)].flatten()
    ratio = local.numel() // sum(local_units)
    local = local[accum[fsdp_rank] * ratio : accum[fsdp_rank + 1] * ratio]
    return veragged.DTensor.from_local(
        local.clone(), device_mesh, placements, shape=tensor.shape, stride=tensor.stride()
    )


def _run_add(dtensor):
    """veScale's _run_add: in-place add of a plain arange under implicit_replication."""
    add_tensor = torch.arange(0, dtensor.numel()).view(dtensor.shape)
    with implicit_replication():
        dtensor.add_(add_tensor)
    result = dtensor.full_tensor()
    _check(result.shape == add_tensor.shape, f"full_tensor shape {tuple(result.shape)}")
    _check(result.dtype == add_tensor.dtype, f"full_tensor dtype {result.dtype}")
    _check(torch.equal(result, add_tensor), "full_tensor() != arange (exact)")


def _ranks():
    mesh = get_mesh()
    ragged = []
    for shape, dims, units in RAGGED_CASES:
        def case(shape=shape, dims=dims, units=units):
            tensor = torch.zeros(32, 128, dtype=torch.int64).view(shape)
            dtensor = veragged.distribute_tensor(tensor.clone(), mesh, (RaggedShard(dims, units),))
            _run_add(dtensor)

        ragged.append((f"{list(shape)} RaggedShard({dims}, {units})", case))

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
    strided = []
    for shape, dims, units in STRIDED_CASES:
        def case(shape=shape, dims=dims, units=units):
            tensor = torch.zeros(64, 128, dtype=torch.int64).view(shape)
            _run_add(_make_strided_shard(tensor.clone(), mesh2, dims, units))

        strided.append(
            (f"{list(shape)} (StridedRaggedShard({dims}, {units}, 2), Shard(0)) on 2x2", case)
        )
    return {
        "test_ragged_shard_element_add": _run_cases(ragged),
        "test_strided_ragged_shard_element_add": _run_cases(strided),
    }


@pytest.fixture(scope="module")
def results():
    per_rank = run_on_ranks(_ranks, WORLD, timeout=180)
    return {k: [r[k] for r in per_rank] for k in per_rank[0]}


# veScale: TestElementwise.test_ragged_shard_element_add
def test_ragged_shard_element_add(results):
    _assert_cases("elementwise ragged", results["test_ragged_shard_element_add"])


# veScale: TestElementwise.test_strided_ragged_shard_element_add
def test_strided_ragged_shard_element_add(results):
    _assert_cases("elementwise strided", results["test_strided_ragged_shard_element_add"])
