"""Rank pools for the client tests, kept apart from the shared ones of tests.harness.pool.

The client jobs import transformers, PEFT, accelerate or torchtitan into their ranks (seconds
each) and leave module-level state behind (torchtitan's CPU device choice, stand-in modules it
bound, accelerate's singleton state), so they run in pools of their own, reused by every client
test of a session and shut down at exit. Each job leaves only what its package keeps once
imported; torchtitan's CPU patches touch torchtitan's own modules (see _titan.py).
"""

from __future__ import annotations

import atexit

from tests.harness.pool import RankPool

_POOLS: dict[int, RankPool] = {}


def client_pool(world_size: int, timeout_s: float = 600.0) -> RankPool:
    """The session's pool of `world_size` ranks for client jobs (created on first use)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size, timeout_s, device="cpu")  # clients run on CPU
    return _POOLS[world_size]


@atexit.register
def shutdown_client_pools() -> None:
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()


def compare(name: str, ref: list[float], res: list[float], rtol: float = 0.0) -> None:
    """Assert two loss curves are equal (bitwise at rtol=0), naming the first differing step."""
    assert len(ref) == len(res) and ref, f"{name}: {len(ref)} torch vs {len(res)} veragged steps"
    for step, (a, b) in enumerate(zip(ref, res)):
        if rtol == 0.0:
            ok = a == b
        else:
            ok = abs(a - b) <= rtol * abs(a)
        assert ok, (f"{name}: step {step}: torch {a!r} vs veragged {b!r} "
                    f"(diff {abs(a - b):.3g}, rtol {rtol}); torch {ref}, veragged {res}")


def assert_same(want, got, path: str = "") -> None:
    """Assert two nested containers of tensors and plain values are equal, tensors bitwise."""
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: tensor vs {type(got).__name__}"
        assert want.shape == got.shape and want.dtype == got.dtype, \
            f"{path}: {tuple(want.shape)} {want.dtype} vs {tuple(got.shape)} {got.dtype}"
        assert torch.equal(want, got), \
            f"{path}: differs (max |diff| {float((want - got).abs().max()):.3g})"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys(), \
            f"{path}: keys {sorted(map(str, want))} vs {sorted(map(str, got or {}))}"
        for k in want:
            assert_same(want[k], got[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(want) == len(got), f"{path}: length"
        for i, (a, b) in enumerate(zip(want, got)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert want == got, f"{path}: {want!r} vs {got!r}"
