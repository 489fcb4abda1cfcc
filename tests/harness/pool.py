"""A persistent pool of gloo ranks that runs one job after another, for fast multi-rank tests.

A fresh rank costs seconds of CPU (interpreter start, `import torch`, rendezvous), more than
most test jobs; a `RankPool` pays that once per session (`run_on_ranks` runs its calls on these
pools too): its `world_size` processes initialise `torch.distributed` (gloo, FileStore
rendezvous in a temporary directory, one intra-op thread) and then run jobs `(fn, args,
kwargs)` sent by the parent. After each job every rank calls `dist.barrier()` (so that no rank
starts the next job while a peer is still inside the previous one), destroys the process groups
the job created (`_release_job_groups`: idle gloo groups cost CPU) and calls
`torch.manual_seed(0)`. A job must therefore not keep meshes or groups for the next one.

Any failure (a rank raising, dying, or not finishing in time) raises `MultiRankError` with every
failed rank's report and tears the pool down: the ranks' collectives may be out of step, so the
next `run` starts a fresh pool.

    pool = get_pool(2)                       # cached per world size, shut down at exit
    results = pool.run(fn, 1, x=2)           # fn(1, x=2) on each rank -> [result0, result1]
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import get_context
from typing import Any, Callable, Optional
from unittest import mock

from tests.harness._procs import (
    _THREAD_VARS,
    MultiRankError,
    _collect,
    _die_with_parent,
    _dump_stacks,
    _raise_failures,
    _report_cpp_crashes,
    _shutdown,
)
from tests.harness.device import backend_for, check_devices, enter_rank, test_device

__all__ = ["RankPool", "get_pool", "shutdown_pools"]

_STACK_FILE = None  # kept open in workers: faulthandler writes to its file descriptor
_POOLS: dict[tuple[int, str], "RankPool"] = {}
# A rank with more threads than this after a job (a fresh one has ~10; each live gloo group adds
# a few, see `_release_job_groups`) is restarted with its pool before the next job.
_RECYCLE_THREADS = 64


class RankPool:
    """`world_size` spawned gloo ranks, started lazily and reused by successive `run` calls.

    Args:
        world_size: number of ranks (processes), at least 1.
        timeout_s: default limit in seconds of one `run` (also of the start-up and of each
            collective, through the process group timeout).
        device: "cpu" (gloo ranks) or "cuda" (rank r on GPU r, NCCL for CUDA tensors; see
            tests.harness.device); default: the harness's, `VERAGGED_TEST_DEVICE`.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0, device: Optional[str] = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.device = device or test_device()
        backend_for(self.device)  # names a bad device now, not in the ranks
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self._procs: list = []
        self._jobs: list = []  # parent's write ends, one per rank
        self._reports: dict = {}  # parent's read ends -> rank
        self._tmpdir: Optional[str] = None

    @property
    def alive(self) -> bool:
        return bool(self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None,
            **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results indexed by rank.

        `fn` must be importable (module level) and everything picklable. Raises `TypeError` if
        the job cannot be pickled, `MultiRankError` (an AssertionError) if a rank failed.
        """
        timeout = self.timeout_s if timeout is None else float(timeout)
        label = f"RankPool.run({getattr(fn, '__qualname__', fn)!s}, world_size={self.world_size})"
        return self._run(fn, args, kwargs, timeout, label)

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float,
             label: str) -> list[Any]:
        """`run` with the label its errors start with (run_on_ranks names its own call)."""
        try:
            job = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"RankPool.run: fn and its arguments must be picklable "
                            f"(define fn at module level): {exc!r}") from exc
        if not self.alive:
            self._start()
        try:
            for conn in self._jobs:
                with contextlib.suppress(OSError):  # a dead rank shows up as "died" below
                    conn.send_bytes(job)
            self._wait(label, timeout)
        except BaseException as exc:  # e.g. KeyboardInterrupt, pytest-timeout: ranks mid-job
            if not isinstance(exc, MultiRankError):
                self.shutdown()
            raise
        results = [result for result, _ in self._results]
        threads = max(n for _, n in self._results)
        if os.environ.get("VERAGGED_POOL_DEBUG"):
            print(f"[pool] {label}: {threads} threads after the job", file=sys.stderr)
        if threads > _RECYCLE_THREADS:  # something still holds this job's groups: start afresh
            self.shutdown()
        return results

    def _start(self) -> None:
        try:
            self._spawn()
        except BaseException as exc:
            if not isinstance(exc, MultiRankError):  # _wait already shut down for those
                self.shutdown()
            raise

    def _spawn(self) -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="veragged_pool_")
        ctx = get_context("spawn")
        config = (self.world_size, self.timeout_s, os.getpid(), self._tmpdir, self.device)
        with mock.patch.dict(os.environ, dict.fromkeys(_THREAD_VARS, "1")):  # children copy it
            for rank in range(self.world_size):
                job_r, job_w = ctx.Pipe(duplex=False)
                rep_r, rep_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, name=f"pool{self.world_size}-rank{rank}",
                                   args=(rank, config, job_r, rep_w))
                self._procs.append(proc)
                self._jobs.append(job_w)
                self._reports[rep_r] = rank
                proc.start()
                job_r.close()  # the child holds the only copies now: EOF means it is gone
                rep_w.close()
        self._wait(f"RankPool(world_size={self.world_size}) start-up", self.timeout_s)

    def _wait(self, label: str, timeout: float) -> None:
        """Collect one report per rank; on any failure tear down and raise MultiRankError."""
        reports, pending = _collect(self._reports, time.monotonic() + timeout)
        all_ok = all(kind == "ok" for _, kind, _ in reports)
        if all_ok and not pending:
            results = {rank: payload for rank, _, payload in reports}
            self._results = [results[rank] for rank in range(self.world_size)]
            return
        if all_ok:  # timed out: have the hung ranks write down where they are
            _dump_stacks(self._procs, pending)
        procs, tmpdir = self._procs, self._tmpdir
        _shutdown(procs)
        try:
            _raise_failures(label, reports, pending, procs, tmpdir, timeout)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the ranks (a later `run` starts fresh ones)."""
        for conn in self._jobs:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")  # asks the worker to leave its loop
        end = time.monotonic() + 2.0
        for proc in self._procs:
            if proc.pid is not None:  # started (a failed start leaves later ranks unstarted)
                proc.join(max(0.0, end - time.monotonic()))
        _shutdown(self._procs)
        for conn in [*self._jobs, *self._reports]:
            conn.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._procs, self._jobs, self._reports, self._tmpdir = [], [], {}, None


def get_pool(world_size: int, timeout_s: float = 120.0, device: Optional[str] = None) -> RankPool:
    """The session-wide pool of `world_size` ranks on `device` (default: the harness's,
    tests.harness.device), created on first use and shut down at exit. Raises
    `unittest.SkipTest` where the device cannot hold that many ranks (GPUs: one each)."""
    device = device or test_device()
    check_devices(device, world_size)
    if (world_size, device) not in _POOLS:
        _POOLS[world_size, device] = RankPool(world_size, timeout_s, device)
    return _POOLS[world_size, device]


@atexit.register
def shutdown_pools() -> None:
    """Shut every cached pool down."""
    for pool in _POOLS.values():
        pool.shutdown()


def _release_job_groups() -> int:
    """Destroy the process groups a job created (its meshes' groups) and drop what holds them.

    Every gloo process group owns a transport thread that wakes up every 10 ms even when idle.
    Ranks that kept the groups of every job's meshes ended up with hundreds of threads each and
    spent a fifth of a core apiece on those wake-ups, which slowed every other test on a 2-core
    machine. A group's threads stop only once nothing references it, so the caches that hold
    meshes or specs are emptied too: torch's sharding propagation caches (they match meshes by
    value, so a later job's equal mesh would get a spec on this job's destroyed groups) and
    every veragged cache ([Note: module caches]). Jobs must not keep meshes from one job to the next; where
    something still does, the threads stay, and the parent restarts the pool once a rank has
    more than `_RECYCLE_THREADS`. Returns this rank's thread count (0 where /proc is missing).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import GroupMember, _world
    from torch.distributed.tensor import DTensor

    from veragged.optim import pieces
    from veragged.runtime import caches

    # Kept: the optimizers' groups per rank set (made once and reused by any later mesh). They
    # are made with use_local_synchronization, whose names are hashes of the ranks: torch 2.11
    # gives a re-created one the destroyed one's name, and so its stale rendezvous keys in the
    # store (its ranks then connect to closed ports).
    kept = {id(pg) for pg in pieces.domain_groups()}
    for pg in list(_world.pg_map):
        if pg is not GroupMember.WORLD and id(pg) not in kept:
            dist.destroy_process_group(pg)
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path's cache (newer torch)
        native()
    caches.clear()  # veragged's: [Note: module caches]
    # Until a pass finds nothing: a fully_shard model (which holds its groups in its DBuffers)
    # can need more than one (one on a 2-D mesh was unreachable only after the first pass).
    for _ in range(4):
        if not gc.collect():
            break
    # Meshes that outlive their job (kept by torch's caches: the redistribute planner's
    # transform infos, the collective cost model's topology, ...) hold their groups in
    # `_pg_registry` (newer torch). Those groups are destroyed: dropping them frees their
    # threads, and torch resolves a group by name outside torch.compile tracing anyway.
    live = {id(pg) for pg in _world.pg_map}
    for obj in gc.get_objects():
        mesh = issubclass(type(obj), DeviceMesh)  # (isinstance would read obj.__class__)
        registry = getattr(obj, "_pg_registry", None) if mesh else None
        if registry:
            for name in [n for n, pg in registry.items() if id(pg) not in live]:
                del registry[name]
    tasks = f"/proc/{os.getpid()}/task"
    return len(os.listdir(tasks)) if os.path.isdir(tasks) else 0


def _freeze_start_up() -> None:
    """Take what start-up imported (torch and veragged: ~300k objects) out of the collector's
    view (`gc.freeze`): `_release_job_groups` collects after every job, which cost 0.2 s of CPU
    per rank and job over those objects, and 1 ms without them."""
    import veragged  # noqa: F401 - what _release_job_groups and most jobs import
    import veragged.optim.pieces  # noqa: F401

    gc.collect()
    gc.freeze()


def _worker_main(rank: int, config: tuple, jobs, reports) -> None:
    """Entry point of each rank: init the process group, then run jobs until told to stop."""
    global _STACK_FILE
    world_size, timeout, parent_pid, tmpdir, device = config
    _die_with_parent(parent_pid)
    _STACK_FILE = open(os.path.join(tmpdir, f"rank{rank}.stack"), "w")
    faulthandler.enable(file=_STACK_FILE, all_threads=True)  # stacks of a crash (e.g. SIGSEGV)
    if hasattr(signal, "SIGUSR1"):  # stacks of a hang, on request from the parent
        faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)

    import torch
    import torch.distributed as dist

    _report_cpp_crashes(tmpdir, rank)
    try:
        torch.set_num_threads(1)
        enter_rank(device, rank)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(backend_for(device), store=store, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        dist.barrier()
        _freeze_start_up()
        torch.manual_seed(0)
        reports.send_bytes(pickle.dumps(("ok", None)))
    except BaseException:
        reports.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    while True:
        try:
            job = jobs.recv_bytes()
        except (EOFError, OSError):
            break
        if not job:  # shutdown request
            break
        try:
            fn, args, kwargs = pickle.loads(job)
            result = fn(*args, **kwargs)
            dist.barrier()  # no rank moves on while a peer is still in this job
            del fn, args, kwargs
            threads = _release_job_groups()
            try:
                report = pickle.dumps(("ok", (result, threads)))
            except Exception:
                report = pickle.dumps(("error", "the return value of fn is not picklable:\n"
                                                + traceback.format_exc()))
            del result
        except BaseException:
            report = pickle.dumps(("error", traceback.format_exc()))
        torch.manual_seed(0)
        reports.send_bytes(report)
    gc.unfreeze()  # let finalization see them (nanobind reports instances it never freed)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
