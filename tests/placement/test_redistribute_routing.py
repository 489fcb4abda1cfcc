"""No silently wrong data from `redistribute` to RaggedShard ([Note: DTensors veragged hands
out], [Note: torch's redistribute to RaggedShard]): DTensors veragged returns without a
RaggedShard redistribute to one through veragged, and torch's own method on torch's DTensors
raises instead of relabelling a replica."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import veragged
from veragged import RaggedDTensor, RaggedShard, RoutedDTensor
from tests.harness import get_mesh, run_on_ranks


def _raises(fn, text):
    try:
        fn()
    except ValueError as e:
        return text in str(e)
    return False


def _one_dim():
    mesh, rank = get_mesh(), dist.get_rank()
    t = torch.arange(16.0).reshape(8, 2)
    ragged = [RaggedShard((0,), (1, 3))]  # rows 0-1 on rank 0, 2-7 on rank 1
    rows = t[:2] if rank == 0 else t[2:]
    out = {}
    # the reported case: veragged.distribute_tensor with a non-ragged placement, then the
    # DTensor's own redistribute to RaggedShard
    for placements in ([Shard(0)], [Replicate()], [Shard(1)]):
        x = veragged.distribute_tensor(t, mesh, placements)
        y = x.redistribute(mesh, ragged)
        out[f"distribute {placements}"] = (
            type(x) is RoutedDTensor and type(y) is RaggedDTensor
            and torch.equal(y.to_local().view(-1, 2), rows) and torch.equal(y.full_tensor(), t))
    # torch's DTensor, torch's method: raises (it would hold 16 elements instead of 4 or 12)
    plain = torch_distribute_tensor(t, mesh, [Replicate()])
    out["torch raises"] = _raises(lambda: plain.redistribute(mesh, ragged), "cannot produce")
    # ... and veragged.redistribute does it right on the same tensor
    y = veragged.redistribute(plain, mesh, ragged)
    out["veragged.redistribute"] = torch.equal(y.to_local().view(-1, 2), rows)
    # back from ragged: RoutedDTensor again, which can go to ragged once more
    back = y.redistribute(mesh, [Shard(0)])
    again = back.redistribute(mesh, [RaggedShard((0,), (3, 1))])
    out["round trip"] = (type(back) is RoutedDTensor and torch.equal(back.full_tensor(), t)
                         and torch.equal(again.full_tensor(), t))
    # ops on a RoutedDTensor are torch's: torch DTensors out, right values
    z = veragged.distribute_tensor(t, mesh, [Shard(0)]) * 2 + 1
    out["ops"] = type(z) is DTensor and torch.equal(z.full_tensor(), t * 2 + 1)
    # from_local keeps autograd; the leaf made by distribute_tensor stays a leaf
    local = torch.ones(4, 2, requires_grad=True)
    f = veragged.DTensor.from_local(local, mesh, [Shard(0)])
    (f.redistribute(mesh, ragged).to_local() * 3).sum().backward()
    leaf = veragged.distribute_tensor(t.clone().requires_grad_(), mesh, [Shard(0)])
    param = torch.nn.Parameter(veragged.distribute_tensor(t, mesh, [Shard(0)]))
    out["parameter"] = (type(param) is RoutedDTensor and isinstance(param, torch.nn.Parameter)
                        and type(param.detach()) is RoutedDTensor and param.requires_grad)
    out["autograd"] = (type(f) is RoutedDTensor and torch.equal(local.grad, torch.full((4, 2), 3.0))
                       and leaf.is_leaf and leaf.requires_grad)
    return out


def test_one_dim_mesh():
    for result in run_on_ranks(_one_dim, 2, timeout=120):
        assert all(result.values()), result


def _two_dim():
    mesh = get_mesh()
    t = torch.arange(48.0).reshape(12, 4)
    target = [Shard(0), RaggedShard((0,), (1, 2))]
    plain = torch_distribute_tensor(t, mesh, [Shard(0), Replicate()])
    ok_torch = _raises(lambda: plain.redistribute(mesh, target), "cannot produce")
    x = veragged.distribute_tensor(t, mesh, [Shard(0), Replicate()])
    y = x.redistribute(mesh, target)
    expected = veragged.distribute_tensor(t, mesh, target)
    return (ok_torch, type(y) is RaggedDTensor,
            torch.equal(y.to_local(), expected.to_local()), torch.equal(y.full_tensor(), t))


def test_two_dim_mesh():
    for result in run_on_ranks(_two_dim, 4, mesh_shape=(2, 2), timeout=120):
        assert all(result), result
