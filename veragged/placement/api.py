"""Creating RaggedShard DTensors: `distribute_tensor`, `from_local` and per-rank sizes."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, Replicate

from veragged.placement import collectives as coll
from veragged.placement.layout import (
    check_placements,
    normalize_placements,
    ragged_layout,
    ragged_mesh_dim,
)
from veragged.placement.redistribute import redistribute
from veragged.placement.tensor import RaggedDTensor, accumulate_grads_locally, make_spec, routed

__all__ = ["distribute_tensor", "from_local", "local_numel_and_offset"]


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_placements):
        ctx.shape, ctx.grad_placements = local.shape, grad_placements
        return RaggedDTensor(
            local.reshape(-1).view_as(local.reshape(-1)), spec, requires_grad=local.requires_grad
        )

    @staticmethod
    def backward(ctx, grad: DTensor):
        if ctx.grad_placements is not None:
            grad = redistribute(grad, grad.device_mesh, ctx.grad_placements)
        return grad._local_tensor.reshape(ctx.shape), None, None



def _mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    mesh = device_mesh or _mesh_resources.get_current_mesh()
    if mesh is None:
        raise ValueError("device_mesh is required (no current mesh is set)")
    return mesh


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """`torch.distributed.tensor.distribute_tensor`, extended to RaggedShard placements.

    With a RaggedShard, the placements are normalised first (the LCM rule for `Shard(d>0)` and the
    `StridedRaggedShard` spelling; see [Note: ragged layout on an N-D mesh]). On a 1-D mesh the data
    of rank `src_data_rank` reaches the others in one all-to-all that sends each rank only its rows;
    with `src_data_rank=None` every rank slices its rows from its own `tensor`, with no
    communication. On N-D meshes torch distributes the other mesh dims first. The result is a leaf
    whose `requires_grad` follows `tensor`. Without a RaggedShard this is torch's
    `distribute_tensor`, returned as a RoutedDTensor ([Note: DTensors veragged hands out]).
    """
    mesh = _mesh(device_mesh)
    if placements is None or ragged_mesh_dim(placements) is None:
        if isinstance(tensor, DTensor):  # torch returns it as is, or raises
            return _torch_distribute_tensor(tensor, mesh, placements,
                                            src_data_rank=src_data_rank)
        return routed(_torch_distribute_tensor(tensor, mesh, placements,
                                               src_data_rank=src_data_rank))
    if isinstance(tensor, DTensor):  # as torch: already distributed this way, or an error
        if tensor.device_mesh == mesh and tuple(tensor.placements) == tuple(placements):
            return tensor
        raise ValueError(
            f"Cannot distribute a DTensor with mesh {tensor.device_mesh} and placements "
            f"{tensor.placements} to mesh {mesh} and placements {tuple(placements)}; use "
            "redistribute"
        )
    if tensor.device.type != mesh.device_type and not tensor.is_meta:
        tensor = tensor.to(mesh.device_type)
    placements = normalize_placements(tensor.shape, mesh, placements)
    layout = ragged_layout(tensor.shape, mesh, placements)
    i = layout.mesh_dim
    with torch.no_grad():
        if mesh.ndim == 1 and src_data_rank is not None:
            full = tensor.detach().contiguous().view(-1)
            n = full.numel()
            src = [0] * (mesh.size(0) + 1)
            for r in range(src_data_rank + 1, mesh.size(0) + 1):
                src[r] = n
            mine = full if layout.coordinate == src_data_rank else full[:0]
            local = coll.all_to_all(
                mine, src, layout.bounds, layout.coordinate, mesh.get_group(0)
            ).finish()
        else:
            block = tensor.detach()
            if mesh.ndim > 1:
                others = tuple(Replicate() if j == i else p for j, p in enumerate(placements))
                block = _torch_distribute_tensor(
                    block, mesh, others, src_data_rank=src_data_rank
                )._local_tensor
            local = coll.slice_local(block, layout.bounds, layout.coordinate).finish()
    spec = make_spec(mesh, placements, tensor.shape, tensor.dtype)
    dt = RaggedDTensor(local, spec, requires_grad=tensor.requires_grad)
    accumulate_grads_locally(dt)
    return dt


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = False,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
    grad_placements: Sequence[Placement] | None = None,
) -> DTensor:
    """`DTensor.from_local`, extended to RaggedShard placements.

    A RaggedShard needs the global `shape` (`stride` defaults to contiguous). The local tensor
    must hold exactly this rank's elements (any shape; it is viewed flat). With `run_check=True`
    all ranks of the ragged mesh dim agree before any of them raises for a wrong size.
    """
    mesh = _mesh(device_mesh)
    if placements is None or ragged_mesh_dim(placements) is None:
        # torch 2.11's DTensor.from_local has no grad_placements: pass it only when given.
        extra = {} if grad_placements is None else {"grad_placements": grad_placements}
        return routed(DTensor.from_local(
            local_tensor, mesh, placements, run_check=run_check, shape=shape, stride=stride,
            **extra,
        ))
    if isinstance(local_tensor, DTensor):
        raise ValueError(f"from_local expects a torch.Tensor, got {type(local_tensor).__name__}")
    if shape is None:
        raise ValueError(f"from_local with placements {tuple(placements)} needs the global shape=")
    placements = tuple(placements)
    check_placements(shape, mesh, placements)
    layout = ragged_layout(shape, mesh, placements)
    if local_tensor.device.type != mesh.device_type and not local_tensor.is_meta:
        local_tensor = local_tensor.to(mesh.device_type)
    wrong = local_tensor.numel() != layout.local_numel
    if run_check:
        flag = torch.tensor([int(wrong)], device=local_tensor.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(layout.mesh_dim))
        wrong_somewhere = bool(flag.item())
    else:
        wrong_somewhere = wrong
    if wrong_somewhere:
        raise ValueError(
            f"from_local: rank {dist.get_rank()} holds {local_tensor.numel()} elements "
            f"but {placements} of shape {list(shape)} gives it {layout.local_numel}"
            if wrong
            else "from_local: another rank's local tensor has the wrong number of elements"
        )
    spec = make_spec(mesh, placements, shape, local_tensor.dtype, stride)
    return _FromLocal.apply(
        local_tensor, spec, tuple(grad_placements) if grad_placements is not None else None
    )



def local_numel_and_offset(
    shape: Sequence[int], device_mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[int, int]:
    """This rank's local numel and its flat offset in the block it belongs to.

    On a 1-D mesh the block is the whole tensor, so the offset is a flat offset into it. For any
    rank (not just this one), use `RaggedShard.local_numel_and_offset(block_shape, rank)`.
    """
    placements = tuple(placements)
    if check_placements(shape, device_mesh, placements) is None:
        raise ValueError(f"placements {placements} hold no RaggedShard")
    layout = ragged_layout(shape, device_mesh, placements)
    return layout.local_numel, layout.flat_offset
