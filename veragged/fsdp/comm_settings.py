"""`FSDPModule`'s communication settings on DBuffers, with torch's meaning and errors: the comm
objects its all-gathers and reduce-scatters go through ([Note: custom comms] in
`veragged/dbuffer/comms.py`) and the reduce-scatter's own process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from veragged.dbuffer.comms import (
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
)
from veragged.runtime.streams import mesh_device

__all__ = [
    "check_symm_mem_buffers", "set_allocate_from_process_group", "set_custom_comm",
    "set_separate_reduce_scatter_group", "set_symm_mem",
]

_KINDS = {"all_gather": ("AllGather", "all gather"),
          "reduce_scatter": ("ReduceScatter", "reduce scatter")}


def _buffers(state) -> list:
    return [g.buffer for g in state.groups]


def _needs(cls, method: str) -> None:
    if cls is None:
        raise NotImplementedError(
            f"{method} needs the comm classes of a newer torch's FSDP2 (torch 2.15 has them; "
            f"torch {torch.__version__} does not)"
        )


def set_custom_comm(state, kind: str, comm) -> None:
    """`set_custom_all_gather` / `set_custom_reduce_scatter`: every group of the state."""
    method, (cls, _) = f"set_custom_{kind}", _KINDS[kind]
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method}: comm must be a torch FSDP2 {cls} (callable, with allocate(size, *, "
            f"dtype, device)), got {comm!r}"
        )
    # torch refuses several parameter groups (parameters on different meshes); veragged's
    # groups of one mesh (one per dtype, frozen or not) share its process group, and the comm.
    if len({id(b.group) for b in _buffers(state)}) > 1:
        raise ValueError(
            f"{method} is not supported with multiple param groups (from per-param mesh via "
            "shard_placement_fn). The custom comm would be ambiguous across groups with "
            "different meshes."
        )
    for b in _buffers(state):
        b.set_comm(kind, comm)


def _check_not_custom(buffers, method: str, allowed: dict[str, tuple]) -> None:
    """torch's AssertionError when a comm it did not install (a custom one) is set."""
    for b in buffers:
        for kind, classes in allowed.items():
            comm = b.comm(kind)
            if comm is not None and not isinstance(comm, tuple(c for c in classes if c)):
                raise AssertionError(
                    f"cannot call {method}() when {_KINDS[kind][1]} comm is custom: "
                    f"{type(comm).__name__}"
                )


def set_allocate_from_process_group(state, enable: bool) -> None:
    """`set_allocate_memory_from_process_group_for_comm`: torch's `ProcessGroupAlloc*` comms
    (staging from the backend's allocator where it has one), or back to the default path."""
    method = "set_allocate_memory_from_process_group_for_comm"
    if not isinstance(enable, bool):
        raise ValueError(f"{method}: enable must be a bool, got {enable!r}")
    _needs(ProcessGroupAllocAllGather, method)
    buffers = _buffers(state)
    _check_not_custom(buffers, method, {"all_gather": (ProcessGroupAllocAllGather,),
                                        "reduce_scatter": (ProcessGroupAllocReduceScatter,)})
    for b in buffers:
        rs_group = b.reduce_scatter_group or b.group
        b.set_comm("all_gather", ProcessGroupAllocAllGather(b.group) if enable else None)
        b.set_comm("reduce_scatter", ProcessGroupAllocReduceScatter(rs_group) if enable else None)


def set_symm_mem(state, backend: str) -> None:
    """`set_symm_mem_for_comm`: torch's symmetric-memory comms for the all-gather, and for the
    reduce-scatter of groups with `set_force_sum_reduction_for_comms(True)` (NCCL's symmetric
    reduce-scatter sums only; veragged always sends sums, but follows torch's switch)."""
    method = "set_symm_mem_for_comm"
    if backend != "NCCL":
        raise ValueError(f"{method}: backend must be 'NCCL' (the only one torch supports), "
                         f"got {backend!r}")
    _needs(SymmMemAllGather, method)
    buffers = _buffers(state)
    for b in buffers:
        device, pg = mesh_device(b.mesh), dist.get_backend(b.group)
        if device.type != "cuda" or pg != "nccl":  # torch fails at its first all-gather there
            raise RuntimeError(
                f"{method}(backend={backend!r}) needs CUDA tensors on an NCCL process group "
                f"(symmetric memory); this module's mesh is on {device.type} with process "
                f"group backend {pg!r}"
            )
    _check_not_custom(buffers, method, {"all_gather": (SymmMemAllGather,),
                                        "reduce_scatter": (SymmMemReduceScatter,)})
    if any(g.force_sum_reduction_for_comms for g in state.groups):
        check_symm_mem_buffers(state, state.max_reduce_scatter_buffers, symm=True)
    for g in state.groups:
        b = g.buffer
        b.set_comm("all_gather", SymmMemAllGather(b.group, backend))
        if g.force_sum_reduction_for_comms:
            b.set_comm("reduce_scatter",
                       SymmMemReduceScatter(b.reduce_scatter_group or b.group, backend))


def check_symm_mem_buffers(state, max_input_buffers: int, symm: bool = False) -> None:
    """torch's ValueError: more than one reduce-scatter input buffer with a symmetric-memory
    reduce-scatter (its pool reuses one buffer; K would need K symmetric segments)."""
    symm = symm or any(SymmMemReduceScatter is not None
                       and isinstance(b.reduce_scatter_comm, SymmMemReduceScatter)
                       for b in _buffers(state))
    if max_input_buffers > 1 and symm:
        raise ValueError(
            "set_reduce_scatter_max_input_buffers(>1) is not supported with the "
            f"symmetric-memory reduce-scatter comm, but got {max_input_buffers}. Keep "
            "max_input_buffers=1 with symmetric memory, or use the default reduce-scatter comm."
        )


def set_separate_reduce_scatter_group(states, enable: bool) -> None:
    """`set_separate_reduce_scatter_group`: each group's reduce-scatter on a process group of
    its own over the shard ranks, made as torch makes it (one per distinct rank set in this
    call, reusing one already set; local synchronization: HSDP replicas make different ones);
    `enable=False` goes back to the shard group."""
    if not isinstance(enable, bool):
        raise ValueError(f"set_separate_reduce_scatter_group: enable must be a bool, "
                         f"got {enable!r}")
    new_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for state in states:
        for b in _buffers(state):
            if not enable:
                b.set_reduce_scatter_group(None)
                continue
            ranks = tuple(dist.get_process_group_ranks(b.group))
            if ranks not in new_groups:
                group = b.reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True,
                    group_desc="fsdp_reduce_scatter",
                )
                if group == dist.GroupMember.NON_GROUP_MEMBER:  # torch's check
                    raise AssertionError(f"Current rank was not included in process group {ranks}")
                new_groups[ranks] = group
            b.set_reduce_scatter_group(new_groups[ranks])
