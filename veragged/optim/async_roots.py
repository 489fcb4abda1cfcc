"""Background root and basis refreshes with an exact delay (Asteria, issue 28).

[Note: asynchronous roots]
Shampoo's inverse roots and SOAP's eigenbasis refreshes run every `precondition_frequency`
steps and cost far more than the steps between them (Asteria, a 1B model at f = 10: refresh
steps of 96.0 s and 80.7 s against 65.3 s for AdamW). With `async_precondition=True,
staleness=k` the owner hands each refresh to a worker thread on a snapshot of its inputs and
the step goes on; the result is installed at the matrix's step s + k exactly (s: the step that
submitted it, counted by the matrix's own step counter), where the synchronous optimizer would
have installed a refresh of step s + k. Asteria installs a result as soon as it is ready and
waits only past its bound; Anil et al.'s Lingvo code never waits: there the numbers depend on
timing. Here timing changes wall time only:
- the install step is a function of the step counters alone, which are symmetric across the
  ranks of a domain and across HSDP replicas, so every replica installs the same result at the
  same step with no coherence protocol;
- a job still running when its install step starts makes that step wait (`stalls`,
  `stall_seconds`); a result is never installed early and never skipped;
- k = 0 runs the same submit and install functions inline: the synchronous code path.
With k <= f (checked) a matrix has at most one job in flight: its install (step s + k <= s + f)
comes before the next submit, and in one step an install precedes a submit (SOAP's next job
starts from the basis just installed).

Where the work runs. A job is one op per matrix side (`veragged::inverse_root_`,
`veragged::refresh_eigenbasis_`: csrc/optim/roots.cpp, the same ATen calls as kronecker.py's
Python twins, bitwise), which releases the GIL for its whole length (eigh, pow, matmul, QR), so
a job takes the GIL for a few tens of microseconds per root of milliseconds. Python threads are
therefore enough, and exceptions travel back in futures: benchmarks/async_precondition.py part
3 times the most Python-bound step there is (AdamW, foreach off) beside a worker thread running
roots back to back and beside the same roots in another process (same competition for the
cores, no GIL shared); on the 2-core CI machine the ratio was 0.91x and 1.13x in two runs, the
machine's own noise (+-15% between identical runs), so no GIL cost is visible at this
resolution and no C++ thread pool was built. The threads are daemon threads of our own, not a
ThreadPoolExecutor's, whose exit handler joins running jobs: a process exits without waiting
for a slow job. Each worker runs with the main thread's `torch.get_num_threads()` (LAPACK's
results may depend on it). On a GPU a worker issues its job on a stream of its own after an
event recorded at submit (the snapshot is ready), and the main stream waits on the job's
completion event at install; the job writes its results into buffers the main thread
allocated (the owner's `pending_*` state), so no block crosses streams in the caching
allocator.

Errors. A job that raises (not a failed root: Shampoo keeps the previous root and counts that,
as in the synchronous path) surfaces at its install step on every rank of the matrix's domain,
at the start of `step()` before any parameter changes: each rank knows which installs are due
(the counters are symmetric), the owners wait for theirs, and one MAX all-reduce of one byte per
due install tells every rank which failed; all raise the same RuntimeError naming the
parameter, the tile and the submit step.

Checkpoints. A job's results land in owner-resident `pending_*` state (with `pending_step`:
the submit step of the refresh it holds, 0 before the first), so `state_dict()` drains the
workers and DCP saves and reshards in-flight refreshes like any owner state; a loaded optimizer
installs them at their step (a checkpoint saved without one, by a synchronous run or with
another staleness, resumes with the roots it holds). `add_param_group` (a new plan, which may
move owner state) and `load_state_dict` drain first. The engine side is
veragged/optim/refresh.py (`AsyncRefresh`).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["RootWorker", "AsyncStats"]


@dataclass
class AsyncStats:
    """What the background refreshes did: jobs `submitted` and `installed`, install steps that
    had to wait for their job (`stalls`, `stall_seconds` in all), the most jobs in flight at
    once and the largest install step - submit step seen (`max_age`: the staleness)."""

    submitted: int = 0
    installed: int = 0
    stalls: int = 0
    stall_seconds: float = 0.0
    max_in_flight: int = 0
    max_age: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Job:
    key: tuple  # (matrix label, tile, submit step)
    run: Callable[[], Any]
    future: Future = field(default_factory=Future)
    device: torch.device | None = None  # a CUDA device: the job runs on a stream there
    ready: Any = None  # a CUDA event: the snapshot is taken
    done: Any = None  # a CUDA event: the results are written


_STOP = object()


def _serve(jobs: queue.SimpleQueue, threads: int, delay: list) -> None:
    torch.set_num_threads(threads)
    streams: dict = {}
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        if not job.future.set_running_or_notify_cancel():
            continue
        try:
            if delay[0]:
                time.sleep(delay[0])  # a test hook: a slow worker
            if job.device is None:
                job.future.set_result(job.run())
            else:  # on the device: a stream of this worker's, after the snapshot
                stream = streams.get(job.device)
                if stream is None:
                    stream = streams[job.device] = torch.cuda.Stream(device=job.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(job.ready)
                    out = job.run()
                    job.done = stream.record_event()
                job.future.set_result(out)
        except BaseException as e:  # noqa: BLE001 - travels to the install step
            job.future.set_exception(e)


class RootWorker:
    """A pool of `workers` daemon threads running refresh jobs ([Note: asynchronous roots]).

    `submit(key, run)` queues `run()` (on a GPU, after the current stream's work so far);
    `wait(key)` blocks until it finished (a stall if it had not), makes the current stream wait
    for it, and returns its exception or None; `forget(key)` drops a finished job. Threads
    start with the first job; `close()` stops them without waiting for a running job (also at
    garbage collection; they never hold the process at exit)."""

    def __init__(self, workers: int = 1):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"async_workers must be an int >= 1, got {workers!r}")
        self.workers = workers
        self.stats = AsyncStats()
        self.delay = [0.0]  # seconds each job sleeps first (tests: a slow worker)
        self._jobs: dict[tuple, _Job] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._threads)

    def _start(self) -> None:
        if self._threads:
            return
        threads = torch.get_num_threads()
        for i in range(self.workers):
            t = threading.Thread(target=_serve, args=(self._queue, threads, self.delay),
                                 name=f"veragged-roots-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, key: tuple, run: Callable[[], Any], device: torch.device) -> None:
        if key in self._jobs:
            raise RuntimeError(f"refresh job {key} submitted twice")
        self._start()
        job = _Job(key, run)
        if device.type == "cuda":
            job.device = device
            job.ready = torch.cuda.current_stream(device).record_event()
        self._jobs[key] = job
        self._queue.put(job)
        self.stats.submitted += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._jobs))

    def __contains__(self, key: tuple) -> bool:
        return key in self._jobs

    def wait(self, key: tuple, stall: bool = True) -> BaseException | None:
        """Block until job `key` finished; its exception, or None. `stall`: a wait at the
        job's install step (counted when the job had not finished)."""
        job = self._jobs[key]
        if not job.future.done():
            start = time.perf_counter()
            job.future.exception()  # waits
            if stall:
                self.stats.stalls += 1
                self.stats.stall_seconds += time.perf_counter() - start
        error = job.future.exception()
        if error is None and job.done is not None:
            torch.cuda.current_stream(job.device).wait_event(job.done)
        return error

    def forget(self, key: tuple, age: int | None = None) -> None:
        """Drop finished job `key` (installed after `age` steps, for the stats)."""
        del self._jobs[key]
        if age is not None:
            self.stats.installed += 1
            self.stats.max_age = max(self.stats.max_age, age)

    def drain(self) -> dict[tuple, BaseException]:
        """Wait for every job in flight; the exceptions of those that raised, by key. The jobs
        stay until `forget`."""
        return {k: e for k in list(self._jobs) if (e := self.wait(k, stall=False)) is not None}

    def in_flight(self) -> list[tuple]:
        return list(self._jobs)

    def close(self) -> None:
        self._finalizer()


def _stop(jobs: queue.SimpleQueue, threads: list) -> None:
    for _ in threads:
        jobs.put(_STOP)
