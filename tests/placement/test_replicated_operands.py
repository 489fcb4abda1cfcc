"""Element-wise ops between a RaggedShard DTensor and a tensor every rank holds whole
([Note: replicated operands of ragged ops]): a Replicate DTensor, a plain tensor under
`implicit_replication()`, full-size or broadcastable (bias-like); bit-exact against the op on
the full tensors, no communication."""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

import veragged
from veragged import RaggedShard
from tests.harness import get_mesh, run_on_ranks

# (shape, ragged dims, local_units on 4 ranks, the other operand's shape)
CASES = [
    ((8, 6), (0,), (1, 0, 5, 2), (8, 6)),
    ((8, 6), (0,), (1, 0, 5, 2), (6,)),  # a bias
    ((8, 6), (0,), (0, 0, 8, 0), (8, 1)),  # one rank holds everything; a column
    ((4, 6, 5), (0, 1), (3, 1, 0, 2), (6, 1)),  # rows cut inside dim 1
    ((4, 6, 5), (0, 1, 2), (7, 1, 0, 4), (4, 6, 5)),  # element granularity
    ((4, 6, 5), (), (0, 0, 1, 0), (5,)),  # the whole tensor on rank 2
]


def _one_dim():
    mesh, out = get_mesh(), {}
    torch.manual_seed(0)
    for shape, dims, units, other_shape in CASES:
        full, other = torch.randn(shape), torch.randn(other_shape)
        placements = [RaggedShard(dims, units)]
        dt = veragged.distribute_tensor(full, mesh, placements)
        rep = torch_distribute_tensor(other, mesh, [Replicate()])
        inplace = veragged.distribute_tensor(full, mesh, placements)
        with CommDebugMode() as comms:
            with implicit_replication():
                plain_sum = dt + other
                inplace.mul_(other)
            rep_div = rep / dt  # the replicated operand first
            rep_max = torch.maximum(dt, rep)
        out[f"{shape} {dims} {other_shape}"] = (
            comms.get_total_counts() == 0
            and type(plain_sum) is veragged.RaggedDTensor
            and torch.equal(plain_sum.full_tensor(), full + other)
            and torch.equal(inplace.full_tensor(), full * other)
            and torch.equal(rep_div.full_tensor(), other / full)
            and torch.equal(rep_max.full_tensor(), torch.maximum(full, other)))
    dt = veragged.distribute_tensor(torch.randn(8, 6), mesh, [RaggedShard((0,), (1, 0, 5, 2))])
    for name, bad, text in [
        ("plain without implicit_replication", torch.randn(8, 6), "implicit_replication"),
        ("Shard DTensor", torch_distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]),
         "redistribute it first"),
        ("enlarging broadcast", torch.randn(3, 8, 6), "does not broadcast"),
    ]:
        try:
            with implicit_replication() if "plain" not in name else _null():
                dt + bad
            out[name] = False
        except ValueError as e:
            out[name] = text in str(e)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_one_dim_mesh():
    for result in run_on_ranks(_one_dim, 4, timeout=120):
        assert all(result.values()), {k: v for k, v in result.items() if not v}


def _two_dim():
    mesh, out = get_mesh(), []
    full, bias = torch.randn(8, 6), torch.randn(6)
    for placements in ([RaggedShard((0,), (1, 3)), Shard(1)],  # FSDP x TP column split
                       [Shard(0), RaggedShard((0,), (1, 3))]):  # FSDP over TP/EP Shard(0)
        dt = veragged.distribute_tensor(full, mesh, placements)
        rep = torch_distribute_tensor(bias, mesh, [Replicate(), Replicate()])
        out.append(torch.equal((dt - rep).full_tensor(), full - bias))
        with implicit_replication():
            out.append(torch.equal((dt * full).full_tensor(), full * full))
    return out


def test_two_dim_mesh():
    for result in run_on_ranks(_two_dim, 4, mesh_shape=(2, 2), timeout=120):
        assert all(result), result
