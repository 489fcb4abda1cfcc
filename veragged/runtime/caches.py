"""Every module-level cache in veragged, in one registry that can empty them all.

[Note: module caches]
veragged keeps a few caches at module level so that per-op and per-step Python stays short:
DTensor specs, ragged layouts and boxes, norm specs, combined meshes, data-parallel meshes,
compiled plans. Some of them hold device meshes (and through them process groups), so a process
that tears its groups down and makes new ones (a test harness running job after job, a
notebook re-initialising `torch.distributed`) wants them all dropped at once. Each cache is
registered here where it is defined, under a name saying what it holds; `clear()` empties every
one. Caches keyed by `id(...)` check on a hit that the object is still the one they saw, so a
stale entry is never served even without `clear()`: clearing frees memory and objects, it is not
needed for correctness.
Not caches, so not registered: state whose loss would change behaviour. `fsdp/api.py`'s
`_MANAGED` (which parameters fully_shard manages, weak) and `_CLASS_CACHE` (the `FSDP<cls>` class
per module class: made twice, two modules of one class would not share a class); the
optimizers' process groups (`optim/pieces.py`, kept for the process's life: re-making a group
over the same ranks collides with the old one's rendezvous keys on torch 2.11); the routing of
torch's entry points (`checkpoint/torch_entry_points.py`); the default stream runtime
(`runtime/streams.py`); RaggedShard's interned unit tables (weak).

    _SPECS = caches.register("placement.tensor specs", {})

    @caches.register_function("placement.layout ragged layouts")
    @functools.lru_cache(maxsize=4096)
    def _ragged_layout(...): ...
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["clear", "names", "register", "register_function"]

_T = TypeVar("_T")
_CLEARS: dict[str, Callable[[], None]] = {}


def register(name: str, cache: _T) -> _T:
    """Register `cache` (anything with `clear()`: a dict, a WeakValueDictionary) under `name`
    and return it."""
    _add(name, cache.clear)
    return cache


def register_function(name: str) -> Callable[[_T], _T]:
    """A decorator registering an `functools.lru_cache`d function (its `cache_clear`)."""

    def decorate(fn: _T) -> _T:
        _add(name, fn.cache_clear)
        return fn

    return decorate


def _add(name: str, clear_fn: Callable[[], None]) -> None:
    if name in _CLEARS:
        raise ValueError(f"a cache named {name!r} is already registered")
    _CLEARS[name] = clear_fn


def names() -> list[str]:
    """The registered caches' names."""
    return list(_CLEARS)


def clear() -> None:
    """Empty every registered cache."""
    for clear_fn in _CLEARS.values():
        clear_fn()
