"""Bytes a rank receives from other ranks in its all-to-alls, all-gathers and broadcasts, for
tests and benchmarks: what crosses the network, not what a collective's buffers hold.

`PeerTraffic` is a `TorchDispatchMode` that reads the `c10d` ops as torch.distributed dispatches
them: an all-to-all (`alltoall_base_`) receives its output splits but its own (its rank in the
group); an all-gather (`_allgather_base_`, `allgather_`, `allgather_into_tensor_coalesced_`)
receives its output but its own input; a broadcast (`broadcast_`) its tensors, except on the
root. Equal splits (empty split lists) are output / group size
each. Other collectives (reduce-scatter, all-reduce) are not counted: `ops` names what was seen.
Summed over ranks, `bytes` is the traffic of those collectives over the network.

    with PeerTraffic() as traffic:
        opt.step()
    traffic.bytes  # received from other ranks by this rank
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PeerTraffic"]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unboxed(group) -> dist.ProcessGroup:
    """The process group of a c10d op's argument (the dispatcher passes it boxed)."""
    return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)


class PeerTraffic(TorchDispatchMode):
    """Bytes received from other ranks by all-to-alls and all-gathers while active (`bytes`;
    per op in `by_op`; every c10d op seen in `ops`)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.by_op: Counter = Counter()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            self.ops[name] += 1
            received = self._received(name, args)
            if received:
                self.bytes += received
                self.by_op[name] += received
        return func(*args, **kwargs)

    @staticmethod
    def _received(name: str, args) -> int:
        if name == "alltoall_base_":
            output, _, group, out_splits = args[:4]
            group = _unboxed(group)
            if not out_splits:
                size = group.size()
                return _bytes(output) * (size - 1) // size
            return (sum(out_splits) - out_splits[group.rank()]) * output.element_size()
        if name == "broadcast_":  # every rank but the root receives the tensors
            tensors, group, root = args[:3]
            return 0 if _unboxed(group).rank() == root else sum(_bytes(t) for t in tensors)
        if name == "_allgather_base_":
            output, inp = args[:2]
            return _bytes(output) - _bytes(inp)
        if name == "allgather_":
            outputs, inputs = args[:2]
            return sum(_bytes(o) for o in outputs[0]) - _bytes(inputs[0])
        if name == "allgather_into_tensor_coalesced_":
            outputs, inputs = args[:2]
            return sum(_bytes(o) for o in outputs) - sum(_bytes(i) for i in inputs)
        return 0
