"""When Shampoo's roots and SOAP's bases are refreshed and installed: inline, or in the
background with an exact delay ([Note: asynchronous roots] in async_roots.py).

`AsyncRefresh` is mixed into Shampoo and SOAP ahead of `MatrixOptimizer`. The optimizer says
when a matrix refreshes (`_refresh_at`), which of its steps a call is (`_counter`) and how many
jobs one refresh is (`_jobs_per_refresh`: Shampoo's tiles); this class schedules them, waits for
the jobs due at the start of a step, turns a worker's exception into the same error on every
rank, and keeps in-flight results checkpointable.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from veragged.optim.async_roots import AsyncStats, RootWorker
from veragged.optim.common import local
from veragged.optim.engine import Matrix

__all__ = ["AsyncRefresh"]


class AsyncRefresh:
    """Refresh scheduling for a `MatrixOptimizer` ([Note: asynchronous roots])."""

    def _init_async(self, async_precondition: bool, staleness: int, async_workers: int) -> None:
        name = self._NAME
        if not isinstance(async_precondition, bool):
            raise ValueError(f"{name}: async_precondition must be a bool, got "
                             f"{async_precondition!r}")
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise ValueError(f"{name}: staleness must be an int >= 0, got {staleness!r}")
        if staleness and not async_precondition:
            raise ValueError(f"{name}: staleness={staleness} needs async_precondition=True")
        if not isinstance(async_workers, int) or isinstance(async_workers, bool) \
                or async_workers < 1:
            raise ValueError(f"{name}: async_workers must be an int >= 1, got "
                             f"{async_workers!r}")
        self.async_precondition, self.staleness = async_precondition, staleness
        self.async_workers = async_workers
        self._roots = RootWorker(async_workers) if staleness > 0 else None
        # matrix label -> the submit step of results its pending state holds with no job (from
        # a loaded checkpoint, or a job forgotten before a new plan): read off the step
        self._held: dict[str, int] = {}

    def _check_staleness(self, group: dict) -> None:
        """staleness <= precondition_frequency: one job in flight per matrix at most."""
        f = group["precondition_frequency"]
        if self.staleness > f:
            raise ValueError(f"{self._NAME}: staleness={self.staleness} must be <= "
                             f"precondition_frequency={f} (a refresh is installed before the "
                             "next one is submitted)")

    # --- the optimizer's part ----------------------------------------------------------------

    def _refresh_at(self, m: Matrix, t: int) -> bool:
        """Whether `m` submits a refresh at its step `t`."""
        raise NotImplementedError

    def _counter(self, m: Matrix) -> int:
        """The step of `m` this step() call is (its own counter, symmetric on every rank)."""
        raise NotImplementedError

    def _jobs_per_refresh(self, m: Matrix) -> int:
        return 1

    # --- scheduling ----------------------------------------------------------------------------

    @property
    def async_stats(self) -> dict:
        """submitted, installed, stalls, stall_seconds, max_in_flight, max_age (this rank's
        jobs: those of the matrices it owns)."""
        return (self._roots.stats if self._roots is not None else AsyncStats()).as_dict()

    def _due(self, m: Matrix, t: int) -> int | None:
        """The submit step of the refresh `m` installs at its step `t`, if any."""
        s = t - self.staleness
        if self.staleness == 0 or s < 1 or not self._refresh_at(m, s):
            return None
        return s

    def _submit(self, m: Matrix, job: int, t: int, run: Callable[[], Any]) -> None:
        """Run `run` (it writes the owner's pending_* state) for job `job` of `m`'s refresh at
        its step `t`: in the background when asynchronous, else now."""
        if self._roots is None:
            run()
            return
        pending = self.owned_state(m, "pending_step")
        pending.fill_(t)
        self._held.pop(m.label, None)
        self._roots.submit((m.label, job, t), run, pending.device)

    def _take(self, m: Matrix, job: int, s: int, t: int) -> bool:
        """Whether job `job` of `m`'s refresh of step `s` has results to install at step `t`
        (its job finished, or its results came with a loaded checkpoint); forgets the job."""
        key = (m.label, job, s)
        if key in self._roots:
            self._roots.forget(key, age=t - s)  # waited for at the start of the step
            return True
        # A checkpoint with the refresh in flight carries it; one saved without it (by a
        # synchronous run, or with another staleness) resumes with the roots it holds.
        return self._held.get(m.label) == s

    def _start_step(self, grads: dict[int, torch.Tensor | None]) -> None:
        """Wait for the jobs due this step and raise a job's exception on every rank of its
        domain, before any parameter changes."""
        if self._roots is None:
            return
        for domain in self._domains:
            due = []  # (matrix, job key), the same list on every rank of the domain
            for m in domain.matrices:
                if grads[id(m.param)] is None:
                    continue
                s = self._due(m, self._counter(m))
                if s is not None:
                    due += [(m, (m.label, j, s)) for j in range(self._jobs_per_refresh(m))]
            if not due:
                continue
            errors = {j: e for j, (_, key) in enumerate(due)
                      if key in self._roots and (e := self._roots.wait(key)) is not None}
            group = domain.matrices[0].layout.group
            failed = [j in errors for j in range(len(due))]
            if group is not None:
                flags = torch.tensor(failed, dtype=torch.uint8)
                flags = flags.to(local(due[0][0].param).device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
                failed = [bool(x) for x in flags.tolist()]
            for j, bad in enumerate(failed):
                if bad:
                    m, (_, job, s) = due[j]
                    where = "this rank" if j in errors else (
                        "its owner" if m.owner is None else f"its owner, rank {m.owner} of "
                        "its domain")
                    raise RuntimeError(
                        f"{self._NAME}: the background refresh of {m.label}, tile {job}, "
                        f"submitted at its step {s}, raised on {where}"
                        + (f": {errors[j]!r}" if j in errors else "")) from errors.get(j)

    def _settle(self) -> None:
        """Before a new plan: wait for every job (its results are in the pending state the plan
        moves) and forget those that finished; a failed one stays, to raise at its step."""
        if self._roots is not None:
            errors = self._roots.drain()
            for key in self._roots.in_flight():
                if key not in errors:
                    self._roots.forget(key)

    def state_dict(self) -> dict:
        if self._roots is not None:
            self._roots.drain()  # the in-flight results are in the pending state it saves
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self._roots is not None:  # the loaded pending state replaces what was in flight
            self._roots.drain()
            for key in self._roots.in_flight():
                self._roots.forget(key)
        super().load_state_dict(state_dict)
        self._read_held()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # a new plan: `_settle` forgot the finished jobs
        if not self._building:
            self._read_held()

    def _read_held(self) -> None:
        """Which refresh results the pending state holds with no job, from `pending_step`: one
        host read per matrix this rank owns, here rather than at an install step."""
        if self._roots is not None:
            self._held = {m.label: int(self.owned_state(m, "pending_step").item())
                          for m in self.matrices() if m.home is not None and m.home.here}

    def close(self) -> None:
        """Stop the worker threads (they never hold the process at exit either)."""
        if self._roots is not None:
            self._roots.close()

