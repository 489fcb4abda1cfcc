"""Run a function on several ranks, as real processes sharing a gloo process group, for tests."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import math
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence
from unittest import mock

from tests.harness._procs import (
    _KILL_WAIT_S,
    _THREAD_VARS,
    MultiRankError,
    _collect,
    _die_with_parent,
    _dump_stacks,
    _join_all,
    _raise_failures,
    _report_cpp_crashes,
    _shutdown,
)
from tests.harness.device import backend_for, check_devices, enter_rank, rank_device_type, test_device
from tests.harness.pool import get_pool

if TYPE_CHECKING:  # torch is imported lazily so that importing this module stays cheap.
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MultiRankError", "get_mesh", "run_on_ranks"]

_MESH: Optional["DeviceMesh"] = None
_STACK_FILE = None  # kept open in children: faulthandler writes to its file descriptor


def get_mesh() -> "DeviceMesh":
    """Return the device mesh of the current rank.

    Returns:
        The CPU `DeviceMesh` built by `run_on_ranks` from its `mesh_shape` and `mesh_dim_names`.

    Raises:
        RuntimeError: if called outside a function run by `run_on_ranks`.
    """
    if _MESH is None:
        raise RuntimeError("get_mesh() is only available inside a function run by run_on_ranks()")
    return _MESH


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    mesh_shape: Optional[Sequence[int]] = None,
    mesh_dim_names: Optional[Sequence[str]] = None,
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    kwargs: Optional[dict[str, Any]] = None,
    backend: str = "gloo",
    fresh: bool = False,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks (processes) and collect the results.

    Each rank runs in its own process with `torch.distributed` initialised, a device mesh
    available through `get_mesh()` (CPU; CUDA under `VERAGGED_TEST_DEVICE=cuda`, see
    tests.harness.device), one intra-op thread, and `torch.manual_seed(0)` applied
    identically on every rank so that tests can build the same data everywhere. As soon as a
    rank fails, the others (usually blocked in a collective) are killed after a short grace
    period; every wait is bounded by `timeout`.

    The ranks are those of the session's pool of `world_size` ranks (`get_pool`, see
    tests.harness.pool), started once and reused: a fresh rank costs seconds of CPU
    (interpreter start, `import torch`), far more than most test jobs. So `fn` follows the
    pool's contract: it keeps no mesh or process group for a later call (the pool destroys the
    groups each call made) and leaves no process-wide setting changed. `fresh=True`, or a
    `backend` other than gloo, spawns new processes for this call only (rendezvous through a
    `FileStore` in a fresh temporary directory, so no port is ever fixed), for code that needs
    a pristine interpreter.

    Args:
        fn: function to run; it must be picklable, i.e. defined at module level of a module
            that the spawned ranks can import (a test module or a script file, not `-c`/stdin).
        world_size: number of ranks (processes), at least 1.
        mesh_shape: shape of the device mesh (1-D or 2-D); defaults to `(world_size,)`.
        mesh_dim_names: optional names of the mesh dimensions, one per dimension.
        timeout: limit in seconds of the call (with `fresh`, process start-up included).
        args: positional arguments for `fn`; must be picklable.
        kwargs: keyword arguments for `fn`; must be picklable.
        backend: `torch.distributed` backend; the default `"gloo"` is the one that works on CPU.
        fresh: spawn new processes for this call instead of using the rank pool.

    Returns:
        The return values of `fn`, indexed by rank (each must be picklable).

    Raises:
        ValueError: if `world_size`, `mesh_shape` or `mesh_dim_names` are inconsistent.
        TypeError: if `fn`, `args` or `kwargs` cannot be pickled.
        MultiRankError: (an `AssertionError`) if any rank raised, died or did not finish within
            `timeout`; its message holds the traceback, exit code or stack dump of each such rank.
    """
    mesh_shape = _check_mesh(world_size, mesh_shape, mesh_dim_names)
    names = tuple(mesh_dim_names) if mesh_dim_names else None
    args, kwargs = tuple(args), dict(kwargs or {})
    try:
        job = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"run_on_ranks: fn and its arguments must be picklable "
                        f"(define fn at module level): {exc!r}") from exc
    label = f"run_on_ranks({getattr(fn, '__qualname__', fn)!s}, world_size={world_size})"
    device = test_device()
    if fresh or backend != "gloo":
        check_devices(device, world_size)
        if device != "cpu" and backend == "gloo":
            backend = backend_for(device)
        config = (world_size, mesh_shape, names, backend, float(timeout), os.getpid(), device)
        return _spawn_ranks(label, config, job, timeout)
    return get_pool(world_size)._run(_on_mesh, (fn, mesh_shape, names, args, kwargs), {},
                                     float(timeout), label)


def _on_mesh(fn: Callable[..., Any], mesh_shape: tuple[int, ...],
             mesh_dim_names: Optional[tuple[str, ...]], args: tuple, kwargs: dict) -> Any:
    """A `run_on_ranks` call as one job of a pool rank: `fn` with its mesh, seeded as fresh."""
    global _MESH
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    _MESH = init_device_mesh(rank_device_type(), mesh_shape, mesh_dim_names=mesh_dim_names)
    try:
        torch.manual_seed(0)  # identical on every rank on purpose: same data everywhere
        return fn(*args, **kwargs)
    finally:
        _MESH = None  # the pool destroys the mesh's groups after the job


def _spawn_ranks(label: str, config: tuple, job: bytes, timeout: float) -> list[Any]:
    """`run_on_ranks` on processes spawned for this call (see `_child_main`)."""
    world_size = config[0]
    tmpdir = tempfile.mkdtemp(prefix="veragged_ranks_")
    ctx = get_context("spawn")
    procs, readers = [], {}
    try:
        with mock.patch.dict(os.environ, dict.fromkeys(_THREAD_VARS, "1")):  # children copy it
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                readers[reader] = rank
                procs.append(ctx.Process(target=_child_main, name=f"rank{rank}",
                                         args=(rank, config, job, tmpdir, writer)))
                procs[-1].start()
                writer.close()  # the child holds the only write end now: EOF means it is gone
        reports, pending = _collect(readers, time.monotonic() + timeout)
        all_ok = all(kind == "ok" for _, kind, _ in reports)
        if all_ok and not pending:
            _join_all(procs, _KILL_WAIT_S)  # let the finished ranks exit on their own
            results = {rank: payload for rank, _, payload in reports}
            return [results[rank] for rank in range(world_size)]
        if all_ok:  # timed out: have the hung ranks write down where they are
            _dump_stacks(procs, pending)
        _shutdown(procs)
        _raise_failures(label, reports, pending, procs, tmpdir, timeout)
    finally:
        _shutdown(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _check_mesh(world_size, mesh_shape, mesh_dim_names) -> tuple[int, ...]:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    shape = (world_size,) if mesh_shape is None else tuple(int(s) for s in mesh_shape)
    if len(shape) not in (1, 2) or any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape must have 1 or 2 positive dimensions, got {shape}")
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh_shape {shape} has {math.prod(shape)} ranks "
                         f"but world_size is {world_size}")
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise ValueError(f"mesh_dim_names {tuple(mesh_dim_names)} must name each of the "
                         f"{len(shape)} dimensions of mesh_shape {shape}")
    return shape


def _child_main(rank: int, config: tuple, job: bytes, tmpdir: str, writer) -> None:
    """Entry point of each spawned rank: set up, run the job, send one report, tear down."""
    global _MESH, _STACK_FILE
    world_size, mesh_shape, mesh_dim_names, backend, timeout, parent_pid, device = config
    _die_with_parent(parent_pid)
    _STACK_FILE = open(os.path.join(tmpdir, f"rank{rank}.stack"), "w")
    faulthandler.enable(file=_STACK_FILE, all_threads=True)  # stacks of a crash (e.g. SIGSEGV)
    if hasattr(signal, "SIGUSR1"):  # stacks of a hang, on request from the parent
        faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _report_cpp_crashes(tmpdir, rank)
    kind = "error"
    try:
        torch.set_num_threads(1)
        enter_rank(device, rank)
        fn, args, kwargs = pickle.loads(job)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        _MESH = init_device_mesh(device, mesh_shape, mesh_dim_names=mesh_dim_names)
        torch.manual_seed(0)  # identical on every rank on purpose: same data everywhere
        result = fn(*args, **kwargs)
        try:
            report = pickle.dumps(("ok", result))
            kind = "ok"
        except Exception:
            report = pickle.dumps((kind, "the return value of fn is not picklable:\n"
                                         + traceback.format_exc()))
    except BaseException:
        report = pickle.dumps((kind, traceback.format_exc()))
    writer.send_bytes(report)
    writer.close()
    _MESH = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            if kind == "ok":  # slower peers may still be connecting: do not close under them
                dist.barrier()
            dist.destroy_process_group()
