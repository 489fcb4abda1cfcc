"""What both optimizers share: local views of (DTensor) parameters and the grad-presence agreement.

[Note: symmetric grad presence]
A sharded parameter can have a gradient on some ranks and `grad=None` on others (conditional
compute, or a user dropping a gradient). A distributed optimizer must still issue the same
collectives in the same order on every rank, or it hangs or pairs unrelated collectives, and the
shards of one parameter must take the same step. So every rank of a parameter's device mesh
reaches the same verdict:
- a parameter no rank has a gradient for is skipped (no state change, no collective);
- a parameter some rank has a gradient for is stepped everywhere, a rank without one using zeros
  for its shard (exactly what a single process would see after summing the ranks' gradients).

How the ranks agree (`GradPresence`, the optimizers' `grad_agreement`, default "auto"):
- Plain tensors (one process, DDP-style replicas): each rank's own verdict, no communication.
- DTensors declared symmetric (`declare_symmetric_grads`): their own verdict, no communication.
- `veragged.fully_shard`'s parameters after a backward: the verdict that backward recorded, no
  communication ([Note: grad verdicts for optimizers], dbuffer/grads.py). Every rank of the
  mesh, including one holding none of a parameter, read the same grad/None verdict from the
  reduce-scatter, whatever each rank's data reached ([Note: unreached parameters]). A record
  serves one step (or ends at the optimizer's `zero_grad`); a `.grad` whose presence changed
  by hand since that backward raises ValueError on that rank before any collective (ranks
  may have changed it differently: `grad_agreement="mesh"` is for that), so no rank waits in
  an all-reduce another rank skipped.
- Other DTensors (`veragged.distribute_tensor`'d or torch's fully_shard parameters, gradients
  set by hand): one MAX all-reduce of one byte per parameter, all of a mesh's parameters in one
  tensor, over all the ranks of the parameters' own device mesh: the mesh dim's group when one
  dim has more than one rank, else one group over its flattened dims (`domain_group`), so on a
  (dp, tp) or HSDP (replicate, dp, tp) mesh the MAX covers shards, TP pieces and replicas, and
  with them every Muon domain of those parameters ([Note: optimizer pieces on N-D meshes]). It
  never covers ranks outside that mesh: pipeline stages, which hold different parameters on
  different meshes, never meet in a collective. The all-reduce is launched asynchronously and
  its result is read (on a GPU, a host sync) only by a rank that lacks a gradient for one of
  those parameters: a rank that has one already knows the MAX is 1. Every rank waits for it at
  the end of the step (on NCCL a stream wait).
`grad_agreement="mesh"` agrees over the mesh for every DTensor, declared, recorded or not
(gradients dropped by hand on fully_shard parameters); `"local"` takes every rank's own verdict
with no communication at all: the caller guarantees the symmetry (if it does not hold, shards of one
parameter step differently and Muon's exchange may hang).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veragged.optim.pieces import domain_group
from veragged.placement.tensor import GRAD_VERDICTS
from veragged.runtime.streams import mesh_device

__all__ = ["GRAD_AGREEMENTS", "GradPresence", "consume_backward_verdicts",
           "declare_symmetric_grads", "local", "local_grads"]

GRAD_AGREEMENTS = ("auto", "mesh", "local")
_SYMMETRIC = "_veragged_symmetric_grads"  # attribute set by `declare_symmetric_grads`


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def declare_symmetric_grads(params: Iterable[torch.Tensor]) -> None:
    """Declare that every rank of each parameter's device mesh always gets the same grad/None
    verdict for it (as `veragged.fully_shard`'s backward gives): with `grad_agreement="auto"`
    the optimizers then take each rank's own verdict without communicating
    ([Note: symmetric grad presence]). The mark is an attribute of the parameter object."""
    for p in params:
        setattr(p, _SYMMETRIC, True)


def check_grad_agreement(owner: str, value: str) -> str:
    if value not in GRAD_AGREEMENTS:
        raise ValueError(f"{owner}: grad_agreement must be one of {GRAD_AGREEMENTS}, got {value!r}")
    return value


class GradPresence:
    """Per parameter, whether some rank of its mesh has a gradient ([Note: symmetric grad
    presence]). Construction launches the agreement's all-reduces (every rank of a mesh must
    construct it with that mesh's parameters in the same order); `verdicts()` returns the
    answers, waiting only where this rank lacks a gradient; `finish()` waits for what is left.
    """

    def __init__(self, params: Sequence[torch.Tensor], agreement: str = "auto",
                 owner: str = "GradPresence"):
        check_grad_agreement(owner, agreement)
        self._verdicts = [p.grad is not None for p in params]
        self._pending: list[tuple[list[int], torch.Tensor, object]] = []
        self._unread: list[int] = []  # indices into _pending whose result this rank needs
        self._taken: list[tuple[object, int]] = []  # backward records this step consumes
        if agreement == "local":
            return
        buckets: dict = {}  # the mesh's group -> (mesh, param indices)
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                continue
            if agreement == "auto" and getattr(p, _SYMMETRIC, False):
                continue
            if agreement == "auto" and self._backward_verdict(owner, i, p):
                continue
            mesh = p.device_mesh
            dims = tuple(d for d in range(mesh.ndim) if mesh.size(d) > 1)
            if not dims:
                continue
            group = mesh.get_group(dims[0]) if len(dims) == 1 else domain_group(mesh, dims)[0]
            buckets.setdefault(group, (mesh, []))[1].append(i)
        for group, (mesh, indices) in buckets.items():
            flags = [self._verdicts[i] for i in indices]
            mask = torch.tensor(flags, dtype=torch.uint8)
            device = mesh_device(mesh)
            if device.type != "cpu":  # pinned, so the copy does not wait for the device
                mask = mask.pin_memory().to(device, non_blocking=True)
            work = dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group, async_op=True)
            if not all(flags):
                self._unread.append(len(self._pending))
            self._pending.append((indices, mask, work))

    def _backward_verdict(self, owner: str, i: int, p: torch.Tensor) -> bool:
        """Whether parameter `i` takes the verdict fully_shard's last backward recorded
        ([Note: grad verdicts for optimizers]): a record no step has used yet. Raises when this
        rank's `.grad` no longer agrees with it."""
        record = _backward_record(p)
        if record is None:
            return False
        source, j = record
        if source.verdicts is None or not source.fresh[j]:
            return False
        if source.verdicts[j] != self._verdicts[i]:
            had = "a gradient" if source.verdicts[j] else "no gradient"
            now = "None" if source.verdicts[j] else "set"
            raise ValueError(
                f"{owner}: parameter {i} of the step (shape {list(p.shape)}): fully_shard's "
                f"backward left it {had} on every rank, but its .grad is {now} on this rank "
                "now. With grad_agreement='auto' the optimizer takes the backward's verdict "
                "without communicating; gradients set or dropped by hand after backward (which "
                "ranks may do differently) need grad_agreement='mesh'"
            )
        self._taken.append((source, j))
        return True

    def verdicts(self) -> list[bool]:
        """Per parameter, True if some rank of its mesh has a gradient. Reads the all-reduce
        (a host sync on a GPU) only for meshes where this rank lacks a gradient."""
        for k in self._unread:
            indices, mask, work = self._pending[k]
            work.wait()
            for i, flag in zip(indices, mask.tolist()):
                self._verdicts[i] = bool(flag)
        self._unread = []
        return self._verdicts

    def finish(self) -> None:
        """Wait for every launched all-reduce (on NCCL: the current stream waits, not the host)."""
        for _, _, work in self._pending:
            work.wait()
        self._pending = []
        consume_backward_verdicts_of(self._taken)
        self._taken = []


def _backward_record(p: torch.Tensor) -> tuple[object, int] | None:
    """`(gradients, index)` of fully_shard's record for parameter `p`, if it has one
    ([Note: grad verdicts for optimizers])."""
    source = GRAD_VERDICTS.get(id(p))
    j = None if source is None else source.verdict_index(p)
    return None if j is None else (source, j)


def consume_backward_verdicts_of(records) -> None:
    """Mark backward records `(source, index)` used: the next step communicates unless another
    backward records again ([Note: grad verdicts for optimizers])."""
    for source, j in records:
        if j < len(source.fresh):
            source.fresh[j] = False


def consume_backward_verdicts(params: Iterable[torch.Tensor]) -> None:
    """The optimizers' `zero_grad`: the records of `params` serve no later step."""
    consume_backward_verdicts_of(r for r in map(_backward_record, params) if r is not None)


def local_grads(params: Sequence[torch.Tensor], mask: Sequence[bool]) -> list[torch.Tensor | None]:
    """Local gradients for the masked-in parameters: the stored shard, or zeros if this rank has
    none; None for parameters the mask leaves out."""
    out: list[torch.Tensor | None] = []
    for p, m in zip(params, mask):
        if not m:
            out.append(None)
        elif p.grad is None:
            out.append(torch.zeros_like(local(p)))
        else:
            out.append(local(p.grad))
    return out
