"""The streams and events of fully_shard's runtime, and the one interface every stream, event,
wait, collective launch, buffer access, allocation and free goes through.

[Note: streams and events]
On an accelerator a kernel runs when its stream reaches it, long after the host queued it, and
NCCL's stream waits, at launch, for everything already queued on the stream that launches it.
So a collective launched from the compute stream cannot start before the compute queued ahead of
it ends, and memory handed back to the caching allocator can be handed out again while another
stream still reads it. `Streams` (one per root `fully_shard` state, as torch's `FSDPCommContext`)
owns the side streams and decides every ordering; the DBuffer and the FSDP hooks only say what
they do (`use`, `record`, `wait`, `accesses`, `read`, `write`, `release`):
- all-gather stream: the all-gathers, their copy-in (a cast for mixed precision, the host copy for
  CPU offload) and their output. It never waits for the compute stream to drain: the all-gather
  of the next block (launched when the host reaches its pre-forward, while the device still runs
  this block) overlaps this block's compute, which is FSDP2's implicit forward prefetch; in
  backward, the prefetched block's all-gather overlaps the current block's backward. The
  compute stream waits for the all-gather's event before the block's compute (`wait_unshard`).
- reduce-scatter stream: waits for an event the compute stream records after the group's
  gradients landed, then reduce-scatters; the compute stream waits for its event only when the
  result is needed (the next reduction beyond `set_reduce_scatter_max_input_buffers`, the end
  of backward). HSDP all-reduce: its own stream, after the reduce-scatter's event.
- The first forward of an iteration orders the all-gather stream after the optimizer's writes
  to the shards: after the post-optim event if one was set (`set_post_optim_event`), else after
  everything the compute stream has queued (torch's rule).
- Memory is reclaimed by events, never `record_stream`: a buffer allocated on a side stream and
  consumed on the compute stream (an unsharded buffer, a reduce-scatter output) is `release`d
  with an event the compute stream records after its last consumer was queued; its storage is
  freed only when its side stream next allocates (`reclaim`), after that stream waited for the
  event, so the caching allocator can hand the block to that stream's next allocation and no
  other stream can still be reading it. In forward the releases of the state whose forward
  ended last stay pending (`hold_from_here` at its post-forward: the block just computed, all its
  groups): the next all-gather then waits only for the block before it, so at most two blocks'
  unsharded groups are alive, as FSDP2's all-gather state keeps them. A buffer allocated on
  the stream that releases it is freed at once (stream order protects it).
- No host sync: events and stream waits only; collectives are launched `async_op=True` and on an
  accelerator their work is waited for inside the launching stream right away (a stream wait,
  not a host wait), so the host runs ahead.
On the CPU (gloo) there is one stream, the caller's: `Streams` is then the current-stream
runtime (no events; a collective's work is waited for by the host when its result is needed,
and memory is freed at once), and the same code runs. `veragged.tools.happens_before.Recorder` is a
`Streams` with virtual side streams that records every operation above and checks, with vector
clocks, that each read follows the write it needs and each free follows every use on another
stream (tests/runtime/test_happens_before.py). A DBuffer used on its own (no fully_shard) runs
on the current-stream runtime.
"""

from __future__ import annotations

import contextlib
from typing import Any, Hashable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

__all__ = ["Handle", "NamedWork", "Streams", "alloc_storage", "current_stream_runtime", "describe",
           "for_device", "free_storage", "mesh_device", "named", "same_storage", "use_runtime"]

ROLES = ("all_gather", "reduce_scatter", "all_reduce")


def free_storage(buf: torch.Tensor) -> None:
    """Release `buf`'s memory; its views stay valid (and empty) until `alloc_storage`."""
    buf.untyped_storage().resize_(0)


def alloc_storage(buf: torch.Tensor) -> None:
    """Regrow a storage freed by `free_storage` in place (the same storage object), on the
    current stream."""
    storage = buf.untyped_storage()
    need = buf.numel() * buf.element_size()
    if storage.size() != need:
        storage.resize_(need)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` live in the same memory (their storages' data pointers agree). Fake
    tensors (FakeTensorMode memory estimates) have no data pointer: there, whether their
    storages are the same object."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if is_fake(a) or is_fake(b):
        return sa._cdata == sb._cdata
    return sa.data_ptr() == sb.data_ptr()


# --- collectives' works ---------------------------------------------------------------------
# [Note: failed collectives]
# The DBuffer's collectives (veragged/dbuffer/comms.py, and the HSDP all-reduce in grads.py)
# return `NamedWork`s: when waiting fails (a peer died, gloo's connection closed or the process
# group's timeout passed), the error is raised again as the same type with the collective and
# its group in front, e.g. `veragged: all_gather on process group 1 ("default_pg", global ranks
# [0, 1], rank 0 of 2) failed: <the backend's error>`, since gloo's own names neither. Nothing
# else changes. They live in the runtime, which waits on every collective, so what a backend
# runs inside its `wait` (gloo's emulation of reduce-scatter, say) is counted where it was
# before by `LaunchCounter`/`WriteCounter`: not as FSDP's own work.


class NamedWork:
    """A collective's work whose failed `wait` names the collective and its group
    ([Note: failed collectives]); everything else goes to the work."""

    __slots__ = ("work", "collective", "group")

    def __init__(self, work, collective: str, group: dist.ProcessGroup):
        self.work, self.collective, self.group = work, collective, group

    def wait(self, *args, **kwargs):
        try:
            return self.work.wait(*args, **kwargs)
        except RuntimeError as err:
            msg = f"veragged: {self.collective} on {describe(self.group)} failed: {err}"
            try:
                named_err = type(err)(msg)
            except Exception:  # an error type that takes other arguments
                named_err = RuntimeError(msg)
            raise named_err from err

    def __getattr__(self, name):
        return getattr(self.work, name)


def describe(group: dist.ProcessGroup) -> str:
    """`process group <name> ("<desc>", global ranks [...], rank r of n)`, as far as known."""
    parts = []
    try:
        desc = group.group_desc
        if desc and desc != "undefined":
            parts.append(f'"{desc}"')
    except Exception:
        pass
    try:
        parts.append(f"global ranks {dist.get_process_group_ranks(group)}")
    except Exception:
        pass
    try:
        parts.append(f"rank {group.rank()} of {group.size()}")
    except Exception:
        pass
    try:
        name = group.group_name
    except Exception:
        name = "?"
    return f"process group {name} ({', '.join(parts)})"


def named(work, collective: str, group: dist.ProcessGroup):
    """`work` (None stays None) as a `NamedWork`."""
    return None if work is None else NamedWork(work, collective, group)


class Handle:
    """A launched collective: its work (waited for by the host) or its stream's event."""

    __slots__ = ("work", "event", "stream")

    def __init__(self, work: Any, event: Any, stream: Any):
        self.work, self.event, self.stream = work, event, stream


class Streams:
    """The current-stream runtime: every role runs on the caller's stream, nothing is
    deferred. `DeviceStreams` (CUDA-like devices) and the test recorder override the stream
    methods; the access methods are no-ops except for the recorder."""

    side_streams = False

    # --- streams and events ------------------------------------------------------------------

    def stream(self, role: str) -> Any:
        """The stream of `role` (one of ROLES); None is the current stream."""
        if role not in ROLES:
            raise ValueError(f"Streams.stream: role must be one of {ROLES}, got {role!r}")
        return None

    def current(self) -> Any:
        return None

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        """Make `stream` current for the block (None: leave the current one)."""
        yield

    def record(self, stream: Any = None) -> Any:
        """An event marking what `stream` (default: the current one) has queued so far."""
        return None

    def wait(self, event: Any, stream: Any = None) -> None:
        """Make `stream` (default: current) wait for `event` (None: nothing to wait for)."""

    def wait_stream(self, waiter: Any, waited: Any = None) -> None:
        """Make `waiter` wait for everything `waited` (default: current) has queued."""

    # --- collectives -------------------------------------------------------------------------

    def handle(self, work: Any, stream: Any = None) -> Handle:
        """The handle of a collective launched with `async_op=True` on `stream` (the current
        one inside `use(stream)`); `work` may be None (already done). `wait_for` takes it."""
        return Handle(work, None, stream)

    def wait_for(self, handle: Handle | None, stream: Any = None) -> None:
        """Order `stream` (default: current) after the collective: the host waits for its
        work here (current-stream runtime), a device stream waits for its event."""
        if handle is not None and handle.work is not None:
            handle.work.wait()
            handle.work = None

    # --- accesses (recorded by the checker; nothing to do otherwise) -------------------------

    def read(self, key: Hashable, stream: Any = None) -> None:
        """`stream` (default: current) reads buffer `key` from here on."""

    def write(self, key: Hashable, stream: Any = None) -> None:
        """`stream` (default: current) writes buffer `key` from here on."""

    def accesses(self, name: str, reads: tuple = (), writes: tuple = (), stream: Any = None):
        """A collective (or copy) `name` queued on `stream` reads the buffers `reads` and
        writes the buffers `writes` (until its `wait_for`)."""

    # --- memory ------------------------------------------------------------------------------

    def alloc(self, key: Hashable, tensor: torch.Tensor, stream: Any = None) -> None:
        """Grow `tensor`'s freed storage on `stream` (default: current); the same storage."""
        self.reclaim_key(key)
        with self.use(stream):
            alloc_storage(tensor)

    def free(self, key: Hashable, tensor: torch.Tensor | None) -> None:
        """Free buffer `key` now: `tensor`'s storage, or (None) a temporary whose last
        reference the caller drops."""
        if tensor is not None:
            free_storage(tensor)

    def release(self, key: Hashable, tensor: torch.Tensor, stream: Any,
                mode: str = "free") -> None:
        """The current stream has queued the last use of buffer `key`, allocated on `stream`;
        once no stream can still use it ([Note: streams and events]): `mode` "free" frees
        `tensor`'s storage, "keep" keeps it for the next `alloc` of `key`, "drop" drops the
        reference to a temporary (the allocator then reuses it)."""
        if mode not in ("free", "keep", "drop"):
            raise ValueError(f"Streams.release: mode must be free, keep or drop, got {mode!r}")
        if mode != "keep":
            self.free(key, tensor if mode == "free" else None)

    def hold_from_here(self) -> None:
        """Releases from now on are the block that is finishing its forward: `reclaim(...,
        keep_held=True)` leaves them pending (the next all-gather must not wait for its
        compute)."""

    def reclaim(self, stream: Any, keep_held: bool = False) -> None:
        """Free the buffers released to `stream` (but those held, with `keep_held`), after
        `stream` waited for their consumers."""

    def reclaim_key(self, key: Hashable) -> None:
        """Buffer `key` is about to be used again: finish its pending release first."""

    def flush(self) -> None:
        """Reclaim every pending release (end of forward or backward)."""


class DeferringStreams(Streams):
    """Side streams: releases to a stream other than the releasing one wait for an event."""

    side_streams = True

    def __init__(self) -> None:
        # (key, tensor, stream, event, mode, sequence number)
        self._pending: list[tuple[Hashable, Any, Any, Any, str, int]] = []
        self._seq = 0  # releases so far
        self._held = 0  # releases from this number on are held (`hold_from_here`)

    def release(self, key, tensor, stream, mode: str = "free") -> None:
        self.reclaim_key(key)
        if self._same(stream, self.current()):
            super().release(key, tensor, stream, mode)
            return
        self._pending.append((key, tensor, stream, self.record(), mode, self._seq))
        self._seq += 1

    def hold_from_here(self) -> None:
        self._held = self._seq

    def _same(self, a, b) -> bool:
        return a is b or a == b

    def _finish(self, entry) -> None:
        key, tensor, stream, event, mode, _ = entry
        self.wait(event, stream)
        with self.use(stream):
            Streams.release(self, key, tensor, stream, mode)

    def reclaim(self, stream, keep_held: bool = False) -> None:
        done = [e for e in self._pending if self._same(e[2], stream)
                and not (keep_held and e[5] >= self._held)]
        if not done:
            return
        self._pending = [e for e in self._pending if not any(e is d for d in done)]
        for e in done:
            self._finish(e)

    def reclaim_key(self, key) -> None:
        for e in [e for e in self._pending if e[0] == key]:
            self._pending.remove(e)
            self._finish(e)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for e in pending:
            self._finish(e)


class DeviceStreams(DeferringStreams):
    """CUDA-like devices: real high-priority side streams and events."""

    def __init__(self, device: torch.device, module: Any = None):
        super().__init__()
        self.device = device
        # torch.cuda (or the device type's module): Stream, Event, stream(), current_stream()
        self.module = module if module is not None else torch.get_device_module(device.type)
        with self.module.device(device):
            self._streams = {r: self.module.Stream(priority=-1) for r in ROLES}

    def stream(self, role: str):
        super().stream(role)  # checks the role
        return self._streams[role]

    def current(self):
        return self.module.current_stream(self.device)

    @contextlib.contextmanager
    def use(self, stream):
        if stream is None:
            yield
            return
        with self.module.stream(stream):
            yield

    def record(self, stream=None):
        event = self.module.Event()
        event.record(stream if stream is not None else self.current())
        return event

    def wait(self, event, stream=None) -> None:
        if event is not None:
            (stream if stream is not None else self.current()).wait_event(event)

    def wait_stream(self, waiter, waited=None) -> None:
        waiter.wait_stream(waited if waited is not None else self.current())

    def handle(self, work, stream=None) -> Handle:
        # Inside the launching stream: that stream waits for the collective (NCCL's end event),
        # the host does not; later users wait for this stream's event.
        with self.use(stream):
            if work is not None:
                work.wait()
            return Handle(None, self.record(stream), stream)

    def wait_for(self, handle, stream=None) -> None:
        if handle is not None:
            self.wait(handle.event, stream)


_CURRENT = Streams()
_FACTORY: list = []  # installed by `use_runtime` (tests): device -> Streams


def current_stream_runtime() -> Streams:
    """The runtime of a DBuffer used without fully_shard: the caller's stream only."""
    return _CURRENT


def mesh_device(mesh) -> torch.device:
    """The device of this rank on `mesh`, from one place (dbuffer, fsdp, checkpoint and optim
    ask): its current CUDA device for a CUDA mesh, else the mesh's device type."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def for_device(device: torch.device) -> Streams:
    """The runtime a root fully_shard state uses on `device` ([Note: streams and events])."""
    if _FACTORY:
        return _FACTORY[-1](device)
    if device.type in ("cpu", "meta"):
        return _CURRENT
    return DeviceStreams(device)


@contextlib.contextmanager
def use_runtime(factory) -> Iterator[None]:
    """Root states initialised inside the block take `factory(device)` as their runtime (the
    happens-before recorder of tests)."""
    _FACTORY.append(factory)
    try:
        yield
    finally:
        _FACTORY.remove(factory)
