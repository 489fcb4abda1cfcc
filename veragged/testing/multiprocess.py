"""Run a function on several ranks, as real processes sharing a gloo process group, for tests."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import math
import os
import pathlib
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from multiprocessing import connection, get_context
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence
from unittest import mock

if TYPE_CHECKING:  # torch is imported lazily so that importing this module stays cheap.
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MultiRankError", "get_mesh", "run_on_ranks"]

_FAILURE_GRACE_S = 2.0  # after a failure, time left to the other ranks to report theirs
_KILL_WAIT_S = 3.0  # bound on each step of shutting children down (terminate, then kill)
_STACK_DUMP_WAIT_S = 1.0  # time given to hung ranks to write their stacks when signalled
# Set to 1 in the ranks' environment so that several ranks do not oversubscribe the cores.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

_MESH: Optional["DeviceMesh"] = None
_STACK_FILE = None  # kept open in children: faulthandler writes to its file descriptor


class MultiRankError(AssertionError):
    """Raised by `run_on_ranks` when a rank raised, crashed or did not finish in time.

    Attributes:
        failures: rank -> report (traceback, exit code or stack dump) of each rank that failed.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


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
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` spawned processes and collect the results.

    Each rank runs in its own process with `torch.distributed` initialised (rendezvous through
    a `FileStore` in a fresh temporary directory, so no port is ever fixed), a CPU device mesh
    available through `get_mesh()`, one intra-op thread, and `torch.manual_seed(0)` applied
    identically on every rank so that tests can build the same data everywhere. As soon as a
    rank fails, the others (usually blocked in a collective) are killed after a short grace
    period; every wait is bounded by `timeout`.

    Args:
        fn: function to run; it must be picklable, i.e. defined at module level of a module
            that the spawned ranks can import (a test module or a script file, not `-c`/stdin).
        world_size: number of ranks (processes), at least 1.
        mesh_shape: shape of the device mesh (1-D or 2-D); defaults to `(world_size,)`.
        mesh_dim_names: optional names of the mesh dimensions, one per dimension.
        timeout: overall limit in seconds, process start-up included.
        args: positional arguments for `fn`; must be picklable.
        kwargs: keyword arguments for `fn`; must be picklable.
        backend: `torch.distributed` backend; the default `"gloo"` is the one that works on CPU.

    Returns:
        The return values of `fn`, indexed by rank (each must be picklable).

    Raises:
        ValueError: if `world_size`, `mesh_shape` or `mesh_dim_names` are inconsistent.
        TypeError: if `fn`, `args` or `kwargs` cannot be pickled.
        MultiRankError: (an `AssertionError`) if any rank raised, died or did not finish within
            `timeout`; its message holds the traceback, exit code or stack dump of each such rank.
    """
    mesh_shape = _check_mesh(world_size, mesh_shape, mesh_dim_names)
    try:
        job = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise TypeError(f"run_on_ranks: fn and its arguments must be picklable "
                        f"(define fn at module level): {exc!r}") from exc
    label = f"run_on_ranks({getattr(fn, '__qualname__', fn)!s}, world_size={world_size})"
    config = (world_size, mesh_shape, tuple(mesh_dim_names) if mesh_dim_names else None,
              backend, float(timeout), os.getpid())
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


def _collect(readers: dict, deadline: float) -> tuple[list, list[int]]:
    """Read one report per rank until all arrived, a failure's grace expired or the deadline.

    Returns the reports as (rank, kind, payload) in order of arrival, kind being "ok",
    "error" (payload: traceback) or "died" (no report), and the ranks that sent nothing.
    """
    pending = dict(readers)
    reports = []
    grace_end = math.inf
    while pending:
        wait_s = min(deadline, grace_end) - time.monotonic()
        if wait_s <= 0:
            break
        for conn in connection.wait(list(pending), timeout=wait_s):
            rank = pending.pop(conn)
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                kind, payload = "died", None
            except Exception:
                kind, payload = "error", f"unreadable report:\n{traceback.format_exc()}"
            reports.append((rank, kind, payload))
            if kind != "ok" and grace_end == math.inf:
                grace_end = time.monotonic() + _FAILURE_GRACE_S
    return reports, sorted(pending.values())


def _dump_stacks(procs: list, ranks: list[int]) -> None:
    """Ask still-running ranks to write their Python stacks (see `_child_main`)."""
    if hasattr(signal, "SIGUSR1"):
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, TypeError):  # gone, or never started
                os.kill(procs[rank].pid, signal.SIGUSR1)
        time.sleep(_STACK_DUMP_WAIT_S)


def _join_all(procs: list, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, end - time.monotonic()))


def _shutdown(procs: list) -> None:
    """Terminate, then kill, every child still alive; each step is bounded."""
    for method in ("terminate", "kill"):
        alive = [p for p in procs if p.pid is not None and p.is_alive()]
        for proc in alive:
            getattr(proc, method)()
        _join_all(alive, _KILL_WAIT_S)


def _exit_description(code: Optional[int]) -> str:
    if code is not None and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}, exit code {code}"
    return f"exit code {code}"


def _read_stack(tmpdir: str, rank: int) -> str:
    path = pathlib.Path(tmpdir, f"rank{rank}.stack")  # absent if the rank never got started
    return path.read_text(errors="replace").strip() if path.exists() else ""


def _raise_failures(label: str, reports: list, pending: list[int], procs: list,
                    tmpdir: str, timeout: float) -> None:
    """Raise a MultiRankError describing every failed or unfinished rank."""
    failures: dict[int, str] = {}
    for rank, kind, payload in reports:
        if kind == "error":
            failures[rank] = payload
        elif kind == "died":
            stack = _read_stack(tmpdir, rank)  # written by faulthandler on a fatal signal
            failures[rank] = (f"process died without reporting a result "
                              f"({_exit_description(procs[rank].exitcode)})"
                              + (f"; Python stacks at the crash:\n{stack}" if stack else ""))
    if failures:
        head = f"{label}: ranks {sorted(failures)} failed (rank {next(iter(failures))} first)"
        if pending:
            head += f"; ranks {pending} were still running and have been killed"
    else:
        head = f"{label} timed out after {timeout:g} s; ranks {pending} did not finish"
        for rank in pending:
            stack = _read_stack(tmpdir, rank)
            failures[rank] = ("did not finish; Python stacks at the timeout:\n" + stack
                              if stack else "did not finish (no stack dump available)")
    parts = [head] + [f"\n----- rank {rank} -----\n{text.rstrip()}"
                      for rank, text in failures.items()]
    raise MultiRankError("\n".join(parts), failures)


def _die_with_parent(parent_pid: int) -> None:
    """Make this child die with the test process, so that no orphan stays blocked forever."""
    with contextlib.suppress(AttributeError, OSError):  # Linux only; elsewhere timeouts bound it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(rank: int, config: tuple, job: bytes, tmpdir: str, writer) -> None:
    """Entry point of each spawned rank: set up, run the job, send one report, tear down."""
    global _MESH, _STACK_FILE
    world_size, mesh_shape, mesh_dim_names, backend, timeout, parent_pid = config
    _die_with_parent(parent_pid)
    _STACK_FILE = open(os.path.join(tmpdir, f"rank{rank}.stack"), "w")
    faulthandler.enable(file=_STACK_FILE, all_threads=True)  # stacks of a crash (e.g. SIGSEGV)
    if hasattr(signal, "SIGUSR1"):  # stacks of a hang, on request from the parent
        faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    kind = "error"
    try:
        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(job)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        _MESH = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_dim_names)
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
