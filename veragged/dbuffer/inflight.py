"""What a DBuffer has in flight between a launch and its finish, as named records: an
all-gather staged in a comm's buffer, the chunk kept after forward, the reduce-scatter launched,
reduced gradients arriving in host memory, verdicts being read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "HostCopy", "InFlightReduce", "OffloadedLanding", "PendingVerdicts", "PostForwardChunk",
    "StagedGather", "start_copy_to_host", "start_read", "wait_all",
]


class StagedGather(NamedTuple):
    """An all-gather into a comm's staging buffer, copied into `output` at the wait
    ([Note: custom comms])."""

    staged: torch.Tensor
    output: torch.Tensor


class PostForwardChunk(NamedTuple):
    """What `reshard(post_forward_group)` keeps (`reshard_after_forward=k`): this rank's 1/k of
    the unsharded buffer, the group of k ranks the next all-gather runs within, and the sharded
    parameters' versions then (any in-place write since makes the chunk stale)."""

    chunk: torch.Tensor
    group: dist.ProcessGroup
    versions: tuple[int, ...]


class HostCopy:
    """A copy into host memory: the host tensor, and the event to wait for before reading it
    (None: the copy is done, or on the CPU)."""

    __slots__ = ("host", "event")

    def __init__(self, host: torch.Tensor, event: object | None):
        self.host, self.event = host, event

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def wait_all(copies: Sequence[HostCopy | None]) -> None:
    """Wait for several copies with one host sync: their events were recorded in this order on
    one stream (the backward's), so the last one covers the others, which are then checked
    without blocking (one that is not done is waited for: another stream)."""
    pending = [c for c in copies if c is not None and c.event is not None]
    if not pending:
        return
    pending[-1].wait()
    for c in pending[:-1]:
        if c.event.query():
            c.event = None
        else:
            c.wait()


def start_copy_to_host(t: torch.Tensor) -> HostCopy:
    """Start copying `t` into a host tensor of its own."""
    if t.device.type == "cpu":
        return HostCopy(t.clone(), None)
    return start_read(t)


def start_read(t: torch.Tensor) -> HostCopy:
    """Start copying `t` to the host (on the CPU: `t` itself)."""
    if t.device.type == "cpu":
        return HostCopy(t, None)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.get_device_module(t.device.type).Event()
    event.record()
    return HostCopy(host, event)


@dataclass(slots=True)
class InFlightReduce:
    """A launched reduce-scatter (`Gradients.reduce(async_op=True)`) and how `finish_reduce`
    completes it."""

    handle: object  # the runtime's Handle of the collective
    source: torch.Tensor | None  # its input: alive until the collective completed
    temp: torch.Tensor | None  # its output when a temporary, released after use
    reduced: torch.Tensor  # its output
    direct: bool  # it wrote the sharded gradients itself
    accumulate: bool  # add to sharded gradients holding earlier sums
    scale: float  # what the sum is still multiplied by (1/world over the landing's scale)
    all_reduce: bool  # HSDP: all-reduce over the replicas (else keep the sum aside)
    unreached: Sequence[bool] | None  # per tensor: this rank's backward did not reach it


class OffloadedLanding(NamedTuple):
    """Reduced gradients still arriving in host memory, and how `Gradients.resolve` writes them
    there ([Note: offloaded gradients])."""

    arriving: HostCopy
    add: bool  # add to the sharded gradients (earlier sums) instead of writing them
    scale: float
    fresh: list[tuple[int, int]]  # ranges that start again from zero when adding
    bind: list[int]  # the tensors whose gradients are bound once written
    accumulate: bool


class PendingVerdicts(NamedTuple):
    """Verdicts being read for tensors this rank did not reach ([Note: unreached parameters]):
    `Gradients.resolve` binds the gradients of those some rank reached."""

    reached: HostCopy  # per flag: whether some rank reached its tensor
    asked: list[tuple[int, int]]  # (tensor, its flag)
    accumulate: bool
