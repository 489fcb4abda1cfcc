"""How much of a step's NCCL time a GPU hides behind compute, from a profiler trace.

A kernel is communication if its name holds "nccl" (NCCL's kernels: `ncclDevKernel_*`,
`ncclKernel_*`), compute otherwise (memcpy and memset activities are not kernels and are left
out). On the device timeline:
  nccl_us     the time some NCCL kernel runs (the union of their intervals);
  compute_us  the time some compute kernel runs;
  hidden_us   the time both run at once (the intersection of the two unions): communication
              overlapped with compute, which costs the step nothing where the GPU has room;
  exposed_us  nccl_us - hidden_us: communication the step waits for;
  hidden      hidden_us / nccl_us (1.0 where there is no NCCL time).
Intervals are in microseconds, as `torch.profiler` gives them. `overlap()` is pure (tested on the
CPU with made-up intervals); `profile_step()` runs a callable under the CUDA profiler.
"""

from __future__ import annotations

from typing import Callable, Iterable


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering exactly the given ones (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two disjoint sorted interval lists (one merge pass)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def overlap(kernels: Iterable[tuple[str, float, float]]) -> dict:
    """The NCCL/compute overlap of `kernels`, given as (name, start_us, end_us) on one device."""
    kernels = list(kernels)
    for name, start, end in kernels:
        if end < start:
            raise ValueError(f"kernel {name!r} ends ({end}) before it starts ({start})")
    nccl = _union((s, e) for n, s, e in kernels if is_nccl(n))
    compute = _union((s, e) for n, s, e in kernels if not is_nccl(n))
    nccl_us, hidden_us = _length(nccl), _intersection(nccl, compute)
    return {
        "nccl_us": nccl_us,
        "compute_us": _length(compute),
        "hidden_us": hidden_us,
        "exposed_us": nccl_us - hidden_us,
        "hidden": hidden_us / nccl_us if nccl_us else 1.0,
        "nccl_kernels": sum(1 for n, _, _ in kernels if is_nccl(n)),
    }


def profile_step(step: Callable[[], object]) -> dict:
    """`overlap()` of the CUDA kernels that `step()` runs on the current device (synchronised
    before and after, so that every kernel of the step is in the trace)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower()]
    return overlap(kernels)
