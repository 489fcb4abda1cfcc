"""A DBuffer's all-gather and reduce-scatter, by default or through a comm object.

[Note: custom comms]
By default a DBuffer all-gathers straight into its unsharded buffer and reduce-scatters straight
from its gradient buffer ([Note: DBuffer layout]). torch's FSDP2 instead stages every collective in
buffers from its comm object (`Comm.allocate`: `torch.empty` by default, the process group's
allocator after `set_allocate_memory_from_process_group_for_comm`, symmetric memory after
`set_symm_mem_for_comm`, the user's after `set_custom_all_gather` / `set_custom_reduce_scatter`).
A DBuffer given such a comm (`all_gather_comm`, `reduce_scatter_comm`;
`veragged/fsdp/comm_settings.py` sets them) stages that collective the same way, and only then
pays the copies:
- all-gather: `comm.allocate((P * S,), dtype=param dtype, device=)`; this rank's slot of it is
  filled from the shard (cast in the same write) or from the chunk `reshard_after_forward=k` kept;
  `comm(output_tensor=staging, input_tensor=that slot, group=, async_op=True)` gathers in place (as
  torch's); after the wait the staging buffer is copied into the unsharded buffer;
- reduce-scatter: `comm.allocate` of the input (the whole gradient buffer, P slots of Sg + F, so
  that the verdict flags travel: [Note: unreached parameters]; compacted slots of different sizes
  padded to the largest, [Note: compacted gradients]) and of the output (Sg + F); the gradient
  buffer is copied in and freed; `comm(..., op=ReduceOp.SUM, async_op=True)`; the output
  then goes where the default path's own goes (HSDP all-reduce, hook, scale and cast into the
  sharded gradients), so the reduce-scatter never writes the sharded gradients directly.
The comm sees the param dtype (all-gather) and the reduce dtype (reduce-scatter), as torch's comm
does for a group of one dtype, not the bytes the default all-gather moves. A work handle it
returns is waited for before the output is read; None means it is done. A world of one gathers and
reduces nothing, so no comm is called (torch calls none either). The reduce-scatter runs on
`reduce_scatter_group` when set (`set_separate_reduce_scatter_group`), else on the shard group.
torch's process-group allocator comms (`ProcessGroupAlloc*`) allocate from the backend only where
it has an allocator (`supports_tensor_alloc`, e.g. NCCL with multicast) and fall back to
`torch.empty` elsewhere (gloo); there the default path moves the same data in the same kind of
memory without the copies, so it is taken instead (`stages`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from veragged.runtime.streams import named  # re-exported: [Note: failed collectives]

__all__ = [
    "ProcessGroupAllocAllGather", "ProcessGroupAllocReduceScatter", "SymmMemAllGather",
    "SymmMemReduceScatter", "all_gather", "allocate", "named", "reduce_scatter", "stage",
    "stages",
]

# torch's own comm classes (None where the installed torch lacks them; 2.11 lacks several).
try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        ProcessGroupAllocAllGather,
        ProcessGroupAllocReduceScatter,
    )
except ImportError:
    ProcessGroupAllocAllGather = ProcessGroupAllocReduceScatter = None
try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        SymmMemAllGather,
        SymmMemReduceScatter,
    )
except ImportError:
    SymmMemAllGather = SymmMemReduceScatter = None
_PG_ALLOC: tuple[type, ...] = tuple(
    c for c in (ProcessGroupAllocAllGather, ProcessGroupAllocReduceScatter) if c is not None
)


def stages(comm, device: torch.device) -> bool:
    """Whether a collective goes through `comm` (staged) rather than the default path."""
    if comm is None:
        return False
    if isinstance(comm, _PG_ALLOC):  # its allocator, if the backend has one
        return comm._group._get_backend(device).supports_tensor_alloc(device)
    return True


def allocate(comm, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`comm.allocate((numel,), dtype=, device=)`, checked."""
    t = comm.allocate((numel,), dtype=dtype, device=device)
    if not (isinstance(t, torch.Tensor) and t.numel() == numel and t.dtype == dtype
            and t.device == device and t.is_contiguous()):
        got = (f"shape {list(t.shape)}, {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
               else repr(t))
        raise ValueError(
            f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}, device={device}) "
            f"returned {got}: expected a contiguous tensor of {numel} elements of that dtype "
            "on that device"
        )
    return t.view(-1)


def stage(comm, source: torch.Tensor, world: int, width: int,
          starts: list[int] | None = None) -> torch.Tensor:
    """`source` (the gradient buffer: `world` slots, of `width` elements each, or starting at
    `starts` when their sizes differ) copied into `comm`'s buffer of `world` slots of `width`,
    each padded with zeros to it (a comm reduce-scatters equal slots:
    [Note: compacted gradients])."""
    staged = allocate(comm, world * width, source.dtype, source.device)
    if starts is None:
        staged.copy_(source)
        return staged
    slots = staged.view(world, width)
    with torch.no_grad():
        slots.zero_()
        for r, (a, b) in enumerate(zip(starts, starts[1:])):
            slots[r, : b - a].copy_(source[a:b])
    return staged


def all_gather(comm, out: torch.Tensor, source: torch.Tensor, group: dist.ProcessGroup):
    """Gather every rank's `source` into `out` (rank-major: rank r of `group` at
    `[r * n, (r + 1) * n)`, n = `source.numel()`), asynchronously; returns the work (or None).

    Without `comm`, as bytes (every dtype moves, whatever dtypes the backend reduces). With it,
    `out` is its staging buffer: this rank's slot is filled from `source` unless it is that slot.
    """
    if comm is None:
        return named(dist.all_gather_into_tensor(
            out.view(torch.uint8), source.view(torch.uint8), group=group, async_op=True,
        ), "all_gather", group)
    n, j = source.numel(), group.rank()
    mine = out[j * n : (j + 1) * n]
    if mine.data_ptr() != source.data_ptr():
        mine.copy_(source)
    return named(comm(output_tensor=out, input_tensor=mine, group=group, async_op=True),
                 "all_gather", group)


def reduce_scatter(comm, out: torch.Tensor, source: torch.Tensor, group: dist.ProcessGroup,
                   starts: list[int] | None = None):
    """SUM-reduce-scatter `source` into `out` over `group`, asynchronously (through `comm`
    if given); returns the work (or None). `starts`: where each rank's slot of `source` begins
    and the end, for slots of different sizes (the list form of the collective, which moves
    each rank's own slot rather than the largest; `comm` takes equal slots only)."""
    if starts is not None:
        if comm is not None:
            raise ValueError(f"reduce_scatter: {type(comm).__name__} takes equal slots only")
        slots = [source[a:b] for a, b in zip(starts, starts[1:])]
        work = dist.reduce_scatter(out, slots, op=dist.ReduceOp.SUM, group=group, async_op=True)
    elif comm is None:
        work = dist.reduce_scatter_tensor(
            out, source, op=dist.ReduceOp.SUM, group=group, async_op=True
        )
    else:
        work = comm(output_tensor=out, input_tensor=source, group=group, op=dist.ReduceOp.SUM,
                    async_op=True)
    return named(work, "reduce_scatter", group)
