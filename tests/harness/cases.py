"""Per-case runners for tests that check many cases in one spawn of ranks and report them all.

Each case is `(name, fn)`; `run_cases` runs them on a rank and keeps `(name, None | error text)`,
`run_groups` runs a function returning `{group: [(name, error)]}` on every rank and regroups the
results per group, and `assert_cases` fails a test with one line per failing case.
"""

from __future__ import annotations

import functools
import itertools
import os
import traceback
from typing import Any, Callable, Iterable, Optional, Sequence

from torch.distributed.tensor import Shard

import veragged
from tests.harness.multiprocess import run_on_ranks

__all__ = [
    "assert_cases",
    "check",
    "error",
    "make_strided_shard",
    "run_cases",
    "run_groups",
    "shape_units_cases",
]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Results = list[tuple[str, Optional[str]]]


def error(exc: BaseException) -> str:
    """First line of the error and the innermost veragged source line that raised."""
    first = (str(exc).strip().splitlines() or [""])[0]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/veragged/" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f" [at {os.path.relpath(f.filename, _ROOT)}:{f.lineno}: {f.line}]"
    return f"{type(exc).__name__}: {first}{where}"


def run_cases(cases: Iterable[tuple[str, Callable[[], Any]]]) -> Results:
    """[(name, None | error text)] for each (name, fn) case; fn raises AssertionError to fail."""
    out = []
    for name, fn in cases:
        try:
            fn()
            out.append((name, None))
        except Exception as exc:  # noqa: BLE001 - every failure is reported per case
            out.append((name, error(exc)))
    return out


def assert_cases(label: str, per_rank: Sequence[Results]) -> None:
    """Fail with 'label: n of m cases pass' and one line per failing case (first rank's text)."""
    import pytest  # a test dependency only: imported when a test asserts

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


def check(cond: Any, what: str) -> None:
    """Raise AssertionError(what) unless cond holds."""
    if not cond:
        raise AssertionError(what)


def run_groups(
    fn: Callable[..., dict[str, Results]], world_size: int, **kwargs: Any
) -> dict[str, list[Results]]:
    """`run_on_ranks(fn, world_size, **kwargs)` with fn returning {group: results}, regrouped as
    {group: [results of rank 0, rank 1, ...]} for `assert_cases`."""
    per_rank = run_on_ranks(fn, world_size, **kwargs)
    return {k: [r[k] for r in per_rank] for k in per_rank[0]}


def shape_units_cases(
    cases: Iterable[tuple[Sequence[int], tuple[int, ...], tuple[int, ...]]],
    fn: Callable[[Sequence[int], tuple[int, ...], tuple[int, ...]], Any],
    *,
    strided: bool = False,
    suffix: str = "",
) -> list[tuple[str, Callable[[], Any]]]:
    """(name, case) for each (shape, dims, local_units) of veScale's lists, case() calling
    fn(shape, dims, local_units); named after the RaggedShard layout, or with strided=True the
    (StridedRaggedShard(dims, local_units, 2), Shard(0)) layout on 2x2 of `make_strided_shard`."""
    out = []
    for shape, dims, units in cases:
        if strided:
            name = f"{list(shape)} (StridedRaggedShard({dims}, {units}, 2), Shard(0)) on 2x2"
        else:
            name = f"{list(shape)} RaggedShard({dims}, {units})"
        out.append((name + suffix, functools.partial(fn, shape, dims, units)))
    return out


def make_strided_shard(tensor, device_mesh, dims, local_units):
    """veScale's make_strided_shard: ragged over fsdp of each ep piece of dim 0, built from the
    local slice by hand (veScale's raw DTensor constructor -> veragged.DTensor.from_local)."""
    fsdp_rank = device_mesh["fsdp"].get_local_rank()
    ep_rank = device_mesh["ep"].get_local_rank()
    placements = (veragged.StridedRaggedShard(dims, local_units, 2), Shard(0))
    accum = (0, *itertools.accumulate(local_units))
    factor = tensor.shape[0] // device_mesh["ep"].size()
    local = tensor[factor * ep_rank : factor * (ep_rank + 1)].flatten()
    ratio = local.numel() // sum(local_units)
    local = local[accum[fsdp_rank] * ratio : accum[fsdp_rank + 1] * ratio]
    return veragged.DTensor.from_local(
        local.clone(), device_mesh, placements, shape=tensor.shape, stride=tensor.stride()
    )
