"""Process plumbing shared by `run_on_ranks` (fresh ranks) and `RankPool` (reused ranks).

Collecting one report per rank with a deadline, asking hung ranks for their stacks, shutting
children down, and turning failed or unfinished ranks into one `MultiRankError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import pathlib
import pickle
import re
import signal
import time
import traceback
from multiprocessing import connection
from typing import Optional

__all__ = ["MultiRankError"]

_FAILURE_GRACE_S = 2.0  # after a failure, time left to the other ranks to report theirs
_KILL_WAIT_S = 3.0  # bound on each step of shutting children down (terminate, then kill)
_STACK_DUMP_WAIT_S = 1.0  # time given to hung ranks to write their stacks when signalled
# Set to 1 in the ranks' environment so that several ranks do not oversubscribe the cores.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class MultiRankError(AssertionError):
    """Raised by `run_on_ranks` when a rank raised, crashed or did not finish in time.

    Attributes:
        failures: rank -> report (traceback, exit code or stack dump) of each rank that failed.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


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


def _report_cpp_crashes(tmpdir: str, rank: int) -> None:
    """In a rank (torch imported): its stderr goes to a file in `tmpdir`, where torch prints the
    C++ stacks of every thread on a fatal signal (`_read_stack` adds them to the report): a
    crash in a thread without Python frames (gloo's workers) then shows where it happened."""
    import torch

    err = os.open(os.path.join(tmpdir, f"rank{rank}.stderr"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    os.close(err)
    print_cpp_stacks = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if print_cpp_stacks is not None:
        print_cpp_stacks(True)


_CPP_CRASH = re.compile(r"^(terminate called|SIG[A-Z]+\(\d+\), PID)", re.MULTILINE)


def _read_stack(tmpdir: str, rank: int) -> str:
    """The rank's Python stacks (faulthandler's file) and, after a fatal signal, the C++ stacks
    torch printed to the rank's stderr file (`_report_cpp_crashes`), from the crash on."""
    path = pathlib.Path(tmpdir, f"rank{rank}.stack")  # absent if the rank never got started
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    err = pathlib.Path(tmpdir, f"rank{rank}.stderr")
    crash = _CPP_CRASH.search(err.read_text(errors="replace")) if err.exists() else None
    if crash is not None:
        lines = crash.string[crash.start():].splitlines()
        text += "\n\nC++ stacks at the crash:\n" + "\n".join(lines[:400])
    return text


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
