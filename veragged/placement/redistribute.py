"""Redistribution of DTensors to, from and between RaggedShard layouts.

A redistribution is planned as a short list of steps on the placements tuple. A "ragged" step
changes one mesh dim with one collective from `veragged.placement.collectives`:

| mesh dim before -> after        | collective                                   |
|---------------------------------|----------------------------------------------|
| RaggedShard -> Replicate        | all-gather of padded pieces, then views      |
| Replicate -> RaggedShard        | none (local slice)                           |
| Partial(sum/avg) -> RaggedShard | reduce-scatter of padded pieces              |
| RaggedShard(a) -> RaggedShard(b)| all-to-all of the overlapping intervals     |
| RaggedShard <-> Shard(0)        | all-to-all of the overlapping intervals     |

A "torch" step hands a plain DTensor (no RaggedShard left) to torch's own `redistribute` for the
other mesh dims. Anything else goes through Replicate on the ragged mesh dim. Each redistribution
is an autograd function whose backward is the inverse redistribution (Partial inputs get
Replicate gradients, as in torch). The async form launches the first collective and returns a
`RedistributeHandle`; `wait()` finishes it and runs any remaining steps.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from veragged.placement import collectives as coll
from veragged.placement.layout import normalize_placements, ragged_layout, ragged_mesh_dim
from veragged.placement.ragged_shard import RaggedShard
from veragged.placement.tensor import RaggedDTensor, as_ragged, make_spec, routed

__all__ = ["RedistributeHandle", "redistribute"]

Step = tuple  # ("ragged", mesh_dim, src_placements, dst_placements) or ("torch", None, src, dst)


def _replace(placements: tuple, i: int, p: Placement) -> tuple:
    return placements[:i] + (p,) + placements[i + 1 :]


def _shard0_direct(placements: tuple, m: int) -> bool:
    """RaggedShard <-> Shard(0) on mesh dim m is one all-to-all.

    That holds when no other mesh dim shards dim 0.
    """
    return not any(p == Shard(0) for j, p in enumerate(placements) if j != m)


def _direct(a: Placement, b: Placement, src: tuple, dst: tuple, m: int) -> bool:
    ra, rb = isinstance(a, RaggedShard), isinstance(b, RaggedShard)
    if ra and rb:
        return True
    if ra:
        return isinstance(b, Replicate) or (b == Shard(0) and _shard0_direct(dst, m))
    if rb:
        return (
            isinstance(a, Replicate)
            or type(a) is Partial
            or (a == Shard(0) and _shard0_direct(src, m))
        )
    return False


def plan_steps(src: tuple, dst: tuple) -> list[Step]:
    """The steps from placements `src` to `dst` (same mesh); see the module docstring."""
    if src == dst:
        return []
    diff = [m for m in range(len(src)) if src[m] != dst[m]]
    if len(diff) == 1 and _direct(src[diff[0]], dst[diff[0]], src, dst, diff[0]):
        return [("ragged", diff[0], src, dst)]
    steps: list[Step] = []
    cur = src
    i, j = ragged_mesh_dim(src), ragged_mesh_dim(dst)
    if i is not None:
        mid = _replace(cur, i, Replicate())
        steps.append(("ragged", i, cur, mid))
        cur = mid
    if j is None:
        if cur != dst:
            steps.append(("torch", None, cur, dst))
        return steps
    keep = cur[j]
    if not (
        isinstance(keep, Replicate)
        or type(keep) is Partial
        or (keep == Shard(0) and _shard0_direct(dst, j))
    ):
        keep = Replicate()
    pre = _replace(dst, j, keep)
    if pre != cur:
        steps.append(("torch", None, cur, pre))
    steps.append(("ragged", j, pre, dst))
    return steps


def _shard0_layout(layout, mesh: DeviceMesh, m: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bounds and this rank's local shape of Shard(0) on mesh dim m.

    Computed over the ragged layout's block.
    """
    block = layout.block_shape
    row_numel = math.prod(block[1:])
    bounds = coll.shard0_bounds(block[0], row_numel, mesh.size(m))
    rank = layout.coordinate
    rows = (bounds[rank + 1] - bounds[rank]) // row_numel if row_numel else 0
    return bounds, (rows, *block[1:])


def run_step(local: torch.Tensor, spec: DTensorSpec, step: Step) -> coll.Pending:
    """Launch one step on this rank's local tensor of a DTensor with `spec`.

    The placements of `spec` are the step's src.
    """
    kind, m, src, dst = step
    mesh, shape = spec.mesh, spec.tensor_meta.shape
    if kind == "torch":
        plain = DTensor(
            local,
            make_spec(mesh, src, shape, local.dtype, spec.tensor_meta.stride),
            requires_grad=False,
        )
        return coll.done(plain.redistribute(mesh, dst)._local_tensor)
    a, b = src[m], dst[m]
    group = mesh.get_group(m)
    if isinstance(a, RaggedShard):
        la = ragged_layout(shape, mesh, src)
        if isinstance(b, Replicate):
            return coll.all_gather(local, la.bounds, group, la.block_shape)
        if isinstance(b, RaggedShard):
            lb = ragged_layout(shape, mesh, dst)
            return coll.all_to_all(local, la.bounds, lb.bounds, la.coordinate, group)
        bounds, local_shape = _shard0_layout(la, mesh, m)
        pending = coll.all_to_all(local, la.bounds, bounds, la.coordinate, group)
        return pending.then(lambda out: out.view(local_shape))
    lb = ragged_layout(shape, mesh, dst)
    if isinstance(a, Replicate):
        return coll.slice_local(local, lb.bounds, lb.coordinate)
    if isinstance(a, Partial):
        return coll.reduce_scatter(local, lb.bounds, lb.coordinate, group, a.reduce_op)
    bounds, _ = _shard0_layout(lb, mesh, m)
    return coll.all_to_all(local, bounds, lb.bounds, lb.coordinate, group)


def _wrap(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    if ragged_mesh_dim(spec.placements) is not None:
        return RaggedDTensor(local, spec, requires_grad=requires_grad)
    return DTensor(local, spec, requires_grad=requires_grad)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, dst: tuple, steps: list, first: coll.Pending | None):
        ctx.src = dt._spec
        local, spec = dt._local_tensor, dt._spec
        for n, step in enumerate(steps):
            pending = first if n == 0 and first is not None else run_step(local, spec, step)
            local = pending.finish()
            # Ragged steps leave row-major data (flat shards or gathered blocks):
            # contiguous strides.
            stride = spec.tensor_meta.stride if step[0] == "torch" else None
            spec = make_spec(spec.mesh, step[3], spec.tensor_meta.shape, local.dtype, stride)
        return _wrap(local, spec, dt.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        src = ctx.src.placements
        target = tuple(Replicate() if isinstance(p, Partial) else p for p in src)
        grad = as_ragged(grad)
        return redistribute(grad, ctx.src.mesh, target), None, None, None


class RedistributeHandle:
    """An asynchronous redistribution.

    Its first collective is in flight; `wait()` returns the DTensor.
    """

    def __init__(self, dt: DTensor, dst: tuple, steps: list[Step]):
        self._dt, self._dst, self._steps = dt, dst, steps
        self._first = run_step(dt._local_tensor, dt._spec, steps[0]) if steps else None
        self._result: DTensor | None = None

    def is_completed(self) -> bool:
        return self._result is not None or self._first is None or self._first.is_completed()

    def wait(self) -> DTensor:
        if self._result is None:
            if not self._steps:
                self._result = self._dt
            else:
                self._result = routed(
                    _Redistribute.apply(self._dt, self._dst, self._steps, self._first))
            self._dt = self._first = None
        return self._result


def redistribute(
    dt: DTensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    async_op: bool = False,
) -> DTensor | RedistributeHandle:
    """Redistribute `dt` to `placements`; works whenever either side holds a RaggedShard.

    Differentiable (the backward is the inverse redistribution). With `async_op=True` the first
    collective is launched and a `RedistributeHandle` is returned; call `.wait()` for the DTensor.
    Without a RaggedShard on either side this is torch's `DTensor.redistribute`. A result
    without RaggedShard is a RoutedDTensor ([Note: DTensors veragged hands out]).
    """
    if not isinstance(dt, DTensor):
        raise TypeError(f"redistribute expects a DTensor, got {type(dt).__name__}")
    mesh = device_mesh or dt.device_mesh
    if mesh != dt.device_mesh:
        raise ValueError(
            f"redistribute between meshes is not supported: {dt.device_mesh} -> {mesh}"
        )
    if placements is None:
        raise ValueError("redistribute needs placements")
    dt = as_ragged(dt)
    src = dt._spec.placements
    dst = normalize_placements(dt.shape, mesh, placements)
    if ragged_mesh_dim(src) is None and ragged_mesh_dim(dst) is None:
        if async_op:
            return RedistributeHandle(dt, dst, [("torch", None, src, dst)])
        return routed(DTensor.redistribute(dt, mesh, dst))
    steps = plan_steps(src, dst)
    if async_op:
        return RedistributeHandle(dt, dst, steps)
    if not steps:
        return dt
    return routed(_Redistribute.apply(dt, dst, steps, None))
