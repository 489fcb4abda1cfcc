"""A happens-before checker for fully_shard's streams, on the CPU.

`Recorder` is the runtime of [Note: streams and events] (veragged/runtime/streams.py) with
virtual streams: the code runs as on the CPU (collectives complete when the host waits for them),
but every stream, event, wait, launch, read, write, allocation and free is recorded as it would
order work on an accelerator, where each stream runs on its own. Each stream keeps a vector clock
(one counter per stream); an access ticks its stream's counter; an event copies its stream's clock
and a wait merges it into the waiter's. Access X on stream s happens before the current point of
stream t iff s is t or t's clock has seen s's counter at X. Checked as the accesses come:
- a read follows the last write of its buffer (made on another stream, it must be ordered before);
- a write follows the last write and every read since (no stream still reads the old values);
- a free follows every access since the allocation, as seen from the stream that allocated the
  memory (the caching allocator hands the block to that stream's next allocation).
A violation is kept (`violations`), not raised, so a test sees every one. `log` keeps each
operation for the overlap checks (`launches`, `depends_on`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import torch

from veragged.runtime.streams import ROLES, DeferringStreams, Handle, Streams

__all__ = ["Event", "Op", "Recorder", "VirtualStream"]


class VirtualStream:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name} stream>"


@dataclass(frozen=True)
class Event:
    clock: dict  # stream name -> counter


@dataclass
class Op:
    """One recorded access: `kind` (read, write, alloc, free, launch), on `stream`, the
    stream's counter at it, and the clock the stream had (what it was ordered after)."""

    kind: str
    stream: str
    tick: int
    key: Hashable = None
    name: str = ""
    clock: dict = field(default_factory=dict)


@dataclass
class _History:
    alloc_stream: str
    write: Op | None = None
    reads: list = field(default_factory=list)


class Recorder(DeferringStreams):
    """`Streams` on virtual streams that records and checks every ordering (see module)."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.compute = VirtualStream("compute")
        self._side = {r: VirtualStream(r) for r in ROLES}
        self._stack: list[VirtualStream] = [self.compute]
        self.clocks: dict[str, dict[str, int]] = {
            s.name: {s.name: 0} for s in (self.compute, *self._side.values())}
        self._hist: dict[Hashable, _History] = {}
        self.violations: list[str] = []
        self.log: list[Op] = []
        self.alive: set = set()  # keys allocated by the runtime and not freed
        self.peak: dict[str, int] = {}  # buffer kind -> most alive at once

    # --- streams and events ------------------------------------------------------------------

    def stream(self, role: str):
        Streams.stream(self, role)  # checks the role
        return self._side[role]

    def current(self):
        return self._stack[-1]

    @contextlib.contextmanager
    def use(self, stream) -> Iterator[None]:
        if stream is None:
            yield
            return
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def _s(self, stream) -> str:
        return (stream if stream is not None else self.current()).name

    def record(self, stream=None) -> Event:
        return Event(dict(self.clocks[self._s(stream)]))

    def wait(self, event, stream=None) -> None:
        if event is not None:
            self._merge(self._s(stream), event.clock)

    def wait_stream(self, waiter, waited=None) -> None:
        self._merge(waiter.name, dict(self.clocks[self._s(waited)]))

    def _merge(self, name: str, clock: dict) -> None:
        mine = self.clocks[name]
        for s, c in clock.items():
            if c > mine.get(s, 0):
                mine[s] = c

    def handle(self, work, stream=None) -> Handle:
        return Handle(work, self.record(stream), stream)

    def wait_for(self, handle, stream=None) -> None:
        if handle is None:
            return
        Streams.wait_for(self, handle)  # the host waits, as on the CPU
        self.wait(handle.event, stream)

    # --- accesses ----------------------------------------------------------------------------

    def _op(self, kind: str, stream, key=None, name: str = "") -> Op:
        s = self._s(stream)
        self.clocks[s][s] += 1
        op = Op(kind, s, self.clocks[s][s], key, name, dict(self.clocks[s]))
        self.log.append(op)
        return op

    def _ordered(self, before: Op, stream: str) -> bool:
        return before.stream == stream or self.clocks[stream].get(before.stream, 0) >= before.tick

    def _check(self, what: str, key, ops, stream: str) -> None:
        for b in ops:
            if b is not None and not self._ordered(b, stream):
                self.violations.append(
                    f"{what} of {key} on {stream} is not ordered after the {b.kind} on "
                    f"{b.stream} (#{b.tick}{', ' + b.name if b.name else ''})")

    def _history(self, key) -> _History:
        h = self._hist.get(key)
        if h is None:  # memory the runtime did not allocate (a shard, a kept chunk): compute's
            h = self._hist[key] = _History(self.compute.name)
        return h

    def read(self, key, stream=None, name: str = "") -> None:
        op = self._op("read", stream, key, name)
        h = self._history(key)
        self._check("read", key, [h.write], op.stream)
        h.reads.append(op)

    def write(self, key, stream=None, name: str = "") -> None:
        op = self._op("write", stream, key, name)
        h = self._history(key)
        self._check("write", key, [h.write, *h.reads], op.stream)
        h.write, h.reads = op, []

    def accesses(self, name: str, reads=(), writes=(), stream=None) -> None:
        self._op("launch", stream, None, name)
        for k in reads:
            self.read(k, stream, name)
        for k in writes:
            self.write(k, stream, name)

    # --- memory ------------------------------------------------------------------------------

    def alloc(self, key, tensor, stream=None) -> None:
        super().alloc(key, tensor, stream)
        op = self._op("alloc", stream, key)
        old = self._hist.get(key)
        if old is not None and (old.write is not None or old.reads):
            # memory that was never freed (kept storage): reusing it is a write
            self._check("reuse", key, [old.write, *old.reads], op.stream)
        self._hist[key] = _History(op.stream, op, [])
        self.alive.add(key)
        kind = key[-1] if isinstance(key, tuple) else key
        now = sum(1 for k in self.alive if (k[-1] if isinstance(k, tuple) else k) == kind)
        self.peak[kind] = max(self.peak.get(kind, 0), now)

    def free(self, key, tensor) -> None:
        h = self._hist.pop(key, None)
        self.alive.discard(key)
        if h is not None:
            # the block goes back to its stream's pool: every use must precede that point
            self._check("free", key, [h.write, *h.reads], h.alloc_stream)
            op = Op("free", h.alloc_stream, self.clocks[h.alloc_stream][h.alloc_stream], key)
            self.log.append(op)
        super().free(key, tensor)

    # --- queries for the overlap checks -------------------------------------------------------

    def mark(self, label: str) -> None:
        """A phase boundary in the log (a test's "forward 0", "backward 0", ...)."""
        self.log.append(Op("mark", "", 0, None, label))

    def ops(self, kind: str | None = None, name: str | None = None,
            stream: str | None = None) -> list[Op]:
        return [o for o in self.log if (kind is None or o.kind == kind)
                and (name is None or o.name == name) and (stream is None or o.stream == stream)]

    @staticmethod
    def depends_on(later: Op, earlier: Op) -> bool:
        """Whether `later`'s stream had waited for `earlier` when `later` ran."""
        return later.stream == earlier.stream and later.tick > earlier.tick or (
            later.clock.get(earlier.stream, 0) >= earlier.tick)


def recorder_factory(into: list) -> Any:
    """A `use_runtime` factory that makes a Recorder per root and appends it to `into`."""

    def make(device):
        r = Recorder(device)
        into.append(r)
        return r

    return make
