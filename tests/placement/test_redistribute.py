"""RaggedShard DTensors on 4 gloo ranks.

Covers creation, redistribution, autograd, async and collective counts.

Each test runs one worker on 4 real processes and checks many layouts inside it (process start-up
dominates the cost). Every comparison with the single-process tensor is bit-exact.
"""

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from veragged import RaggedShard, RoutedDTensor
from tests.harness import get_mesh, run_on_ranks

WORLD = 4
# (shape, dims): awkward sizes, 3-D tensors, element / row / plane / whole-tensor granularity.
CASES = [
    ((7, 13), (0,)),
    ((7, 13), (0, 1)),
    ((18, 5), (0,)),
    ((3, 4, 5), (0, 1)),
    ((3, 4, 5), (0,)),
    ((6,), (0,)),
    ((5, 3), ()),
]


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _layouts(rows, seed):
    """local_units for `rows` rows on WORLD ranks.

    Random with zeros, one-hot roots, scaled, even.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        counts = torch.bincount(torch.randint(0, WORLD, (rows,), generator=g), minlength=WORLD)
        out.append(tuple(int(c) for c in counts))
    out.append(tuple(int(r == 2) for r in range(WORLD)))  # root-only on rank 2
    out.append(tuple(int(r == 0) * 5 for r in range(WORLD)))  # root-only, unit 5
    if rows % WORLD == 0:
        out.append((1,) * WORLD)
    if rows % 2 == 0:
        out.append((0, 1, 1, 0))
    return out


def _rows(shape, dims):
    n = 1
    for d in dims:
        n *= shape[d]
    return n


def _expected_local(full, placement, rank):
    numel, offset = placement.local_numel_and_offset(full.shape, rank)
    return full.reshape(-1)[offset : offset + numel]


def _round_trips():
    mesh, rank = get_mesh(), dist.get_rank()
    checked = 0
    for c, (shape, dims) in enumerate(CASES):
        full = _full(shape, c)
        layouts = _layouts(_rows(shape, dims), c)
        for i, units in enumerate(layouts):
            p = RaggedShard(dims, units)
            dt = veragged.distribute_tensor(full, mesh, [p])
            assert isinstance(dt, DTensor) and dt.shape == full.shape and dt.placements == (p,)
            assert torch.equal(dt.to_local(), _expected_local(full, p, rank))
            assert torch.equal(
                veragged.distribute_tensor(full, mesh, [p], src_data_rank=None).to_local(),
                dt.to_local(),
            )
            assert torch.equal(dt.full_tensor(), full)
            # RaggedShard(a) -> RaggedShard(b), every other layout of the same tensor
            q = RaggedShard(dims, layouts[(i + 1) % len(layouts)])
            moved = dt.redistribute(mesh, [q])
            assert torch.equal(moved.to_local(), _expected_local(full, q, rank))
            assert torch.equal(veragged.redistribute(moved, mesh, [p]).to_local(), dt.to_local())
            # Replicate -> RaggedShard, RaggedShard -> Replicate
            rep = DTensor.from_local(full, mesh, [Replicate()])
            assert torch.equal(veragged.redistribute(rep, mesh, [p]).to_local(), dt.to_local())
            assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full)
            # RaggedShard <-> Shard(0), both ways, against torch's own Shard(0)
            torch_s0 = torch.distributed.tensor.distribute_tensor(full, mesh, [Shard(0)])
            s0 = dt.redistribute(mesh, [Shard(0)])
            assert type(s0) is RoutedDTensor and torch.equal(s0.to_local(), torch_s0.to_local())
            assert torch.equal(veragged.redistribute(torch_s0, mesh, [p]).to_local(), dt.to_local())
            # Partial(sum) and Partial(avg) -> RaggedShard: one reduce-scatter
            contrib = full * (rank + 1)
            for op, scale in (("sum", 10.0), ("avg", 2.5)):
                partial = DTensor.from_local(contrib, mesh, [Partial(op)])
                got = veragged.redistribute(partial, mesh, [p]).to_local()
                want = _expected_local(
                    sum(full * (r + 1) for r in range(WORLD)) / (4.0 if op == "avg" else 1.0),
                    p,
                    rank,
                )
                assert torch.allclose(got, want, rtol=0, atol=1e-5), (op, scale)
            # from_local with shape=, stride=
            again = veragged.DTensor.from_local(
                dt.to_local().clone(), mesh, [p], shape=full.shape, stride=full.stride()
            )
            assert torch.equal(again.full_tensor(), full)
            checked += 1
    return checked


def test_round_trips_are_bit_exact_for_random_root_and_even_layouts():
    counts = run_on_ranks(_round_trips, WORLD, timeout=240)
    assert counts[0] == counts[-1] > 30


def _grad_of(x):
    g = x.grad
    assert g is not None
    return g


def _backward():
    mesh, rank = get_mesh(), dist.get_rank()
    full, w = _full((7, 13), 1), _full((7, 13), 2)
    p, q = RaggedShard((0, 1), (30, 0, 51, 10)), RaggedShard((0,), (0, 7, 0, 0))
    results = {}

    # RaggedShard -> Replicate (full_tensor): the gradient is the local slice of the upstream grad.
    x = veragged.distribute_tensor(full.clone().requires_grad_(), mesh, [p])
    assert x.requires_grad and x.is_leaf
    (x.full_tensor() * w).sum().backward()
    g = _grad_of(x)
    results["to_replicate"] = (
        type(g).__name__,
        g.placements == (p,),
        torch.equal(g.to_local(), _expected_local(w, p, rank)),
    )

    # RaggedShard(a) -> RaggedShard(b): gradient moves back with the inverse all-to-all.
    x = veragged.distribute_tensor(full.clone().requires_grad_(), mesh, [p])
    (veragged.redistribute(x, mesh, [q]).full_tensor() * w).sum().backward()
    results["ragged_to_ragged"] = torch.equal(_grad_of(x).to_local(), _expected_local(w, p, rank))

    # Replicate -> RaggedShard and Shard(0) -> RaggedShard.
    for name, placement in (("replicate", Replicate()), ("shard0", Shard(0))):
        x = torch.distributed.tensor.distribute_tensor(
            full.clone(), mesh, [placement]
        ).requires_grad_()
        (veragged.redistribute(x, mesh, [p]).full_tensor() * w).sum().backward()
        want = torch.distributed.tensor.distribute_tensor(w, mesh, [placement]).to_local()
        results[name] = torch.equal(_grad_of(x).to_local(), want)

    # RaggedShard -> Shard(0).
    x = veragged.distribute_tensor(full.clone().requires_grad_(), mesh, [p])
    (x.redistribute(mesh, [Shard(0)]).full_tensor() * w).sum().backward()
    results["to_shard0"] = torch.equal(_grad_of(x).to_local(), _expected_local(w, p, rank))

    # Partial -> RaggedShard: the gradient is Replicate (as torch does for Partial inputs).
    x = DTensor.from_local(full.clone(), mesh, [Partial()]).detach().requires_grad_()
    (veragged.redistribute(x, mesh, [p]).full_tensor() * w).sum().backward()
    results["partial"] = _grad_of(x).placements == (Replicate(),) and torch.equal(
        _grad_of(x).to_local(), w
    )

    # Gradients accumulate over two backwards.
    x = veragged.distribute_tensor(full.clone().requires_grad_(), mesh, [p])
    for _ in range(2):
        (x.full_tensor() * w).sum().backward()
    results["accumulate"] = type(x.grad).__name__ == "RaggedDTensor" and torch.equal(
        _grad_of(x).to_local(), 2 * _expected_local(w, p, rank)
    )

    # The backward of the gather is a local slice: no communication.
    x = veragged.distribute_tensor(full.clone().requires_grad_(), mesh, [p])
    y = x.full_tensor()
    with CommDebugMode() as comm:
        (y * w).sum().backward()
    results["gather_backward_comms"] = comm.get_total_counts()
    return results


def test_every_redistribution_is_differentiable():
    for res in run_on_ranks(_backward, WORLD, timeout=180):
        assert res.pop("to_replicate") == ("RaggedDTensor", True, True)
        assert res.pop("gather_backward_comms") == 0
        assert all(res.values()), res


def _counts(fn):
    """c10d collectives issued by `fn` (names of the c10d ops, e.g. `_allgather_base_`)."""
    with CommDebugMode() as comm:
        fn()
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


def _collective_counts():
    mesh = get_mesh()
    full = _full((18, 5), 3)
    p, q = RaggedShard((0,), (5, 0, 9, 4)), RaggedShard((0,), (0, 0, 18, 0))
    dt = veragged.distribute_tensor(full, mesh, [p])
    even = veragged.distribute_tensor(full, mesh, [RaggedShard((0,), (5, 4, 5, 4))])
    rep = DTensor.from_local(full, mesh, [Replicate()])
    partial = DTensor.from_local(full, mesh, [Partial()])
    s0 = torch.distributed.tensor.distribute_tensor(full, mesh, [Shard(0)])
    rooted = veragged.distribute_tensor(full, mesh, [q])
    gathers = {
        "skewed_to_replicate": lambda: dt.full_tensor(),
        "root_to_replicate": lambda: rooted.full_tensor(),
        "from_partial": lambda: veragged.redistribute(partial, mesh, [p]),
        "partial_to_root": lambda: veragged.redistribute(partial, mesh, [q]),
    }
    for name, fn in gathers.items():  # the results are right
        got = fn()
        if "partial" in name:  # a sum of 4 ranks' values: equal up to rounding
            want = _expected_local(full * WORLD, got.placements[0], dist.get_rank())
            assert torch.allclose(got.to_local(), want, rtol=0, atol=1e-5), name
        else:
            assert torch.equal(got, full), name
    return {
        "sends": {name: _send_sizes(fn) for name, fn in gathers.items()},
        "root_to_replicate": _counts(gathers["root_to_replicate"]),
        "partial_to_root": _counts(gathers["partial_to_root"]),
        "distribute": _counts(lambda: veragged.distribute_tensor(full, mesh, [p])),
        "to_replicate": _counts(lambda: even.full_tensor()),
        "skewed_to_replicate": _counts(lambda: dt.full_tensor()),
        "to_root": _counts(lambda: dt.redistribute(mesh, [q])),
        "from_replicate": _counts(lambda: veragged.redistribute(rep, mesh, [p])),
        "from_partial": _counts(lambda: veragged.redistribute(partial, mesh, [p])),
        "to_shard0": _counts(lambda: dt.redistribute(mesh, [Shard(0)])),
        "from_shard0": _counts(lambda: veragged.redistribute(s0, mesh, [p])),
    }


def test_each_redistribution_is_one_collective():
    for res in run_on_ranks(_collective_counts, WORLD, timeout=120):
        sends = res.pop("sends")
        assert res["distribute"] == {"alltoall_base_": 1}, res
        assert res["to_replicate"] == {"_allgather_base_": 1}, res
        # (5, 0, 9, 4): an all-gather of pieces padded to 9 rows (not an all-to-all, whose send
        # buffer would hold the local piece once per rank)
        assert res["skewed_to_replicate"] == {"_allgather_base_": 1}, res
        assert res["root_to_replicate"] == {"broadcast_": 1}, res  # everything on one rank
        assert res["to_root"] == {"alltoall_base_": 1}, res
        assert res["from_replicate"] == {}, res
        assert res["from_partial"] == {"_reduce_scatter_base_": 1}, res
        assert res["partial_to_root"] == {"reduce_": 1}, res
        assert res["to_shard0"] == {"alltoall_base_": 1}, res
        assert res["from_shard0"] == {"alltoall_base_": 1}, res
        # send buffers: one padded piece (9 rows of 5), the tensor (90), the tensor padded to
        # 4 x 9 rows, the tensor; none is a multiple of the world size
        assert sends == {"skewed_to_replicate": [45], "root_to_replicate": [90],
                         "from_partial": [180], "partial_to_root": [90]}, sends


def _send_sizes(fn):
    """The numel of the tensor each collective of `fn` sends (its input)."""
    sizes = []
    patches = []
    for name, arg in (("all_gather_into_tensor", 1), ("broadcast", 0),
                      ("reduce_scatter_tensor", 1), ("reduce", 0), ("all_to_all_single", 1)):
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _arg=arg, **kwargs):
            sizes.append(args[_arg].numel())
            return _real(*args, **kwargs)

        patches.append(mock.patch.object(dist, name, wrapped))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        fn()
    return sizes


def _async_forms():
    mesh, rank = get_mesh(), dist.get_rank()
    full = _full((7, 13), 4)
    p, root = RaggedShard((0,), (1, 3, 0, 3)), RaggedShard((), (0, 0, 0, 1))
    dt = veragged.distribute_tensor(full, mesh, [p])
    handles = [
        veragged.redistribute(dt, mesh, [Replicate()], async_op=True),
        veragged.redistribute(dt, mesh, [root], async_op=True),
        veragged.redistribute(
            DTensor.from_local(full, mesh, [Partial()]), mesh, [p], async_op=True
        ),
    ]
    assert all(isinstance(h, veragged.RedistributeHandle) for h in handles)
    gathered, rooted, reduced = (h.wait() for h in handles)
    ok = torch.equal(gathered.to_local(), full)
    ok &= torch.equal(rooted.to_local(), full.reshape(-1) if rank == 3 else full.reshape(-1)[:0])
    ok &= torch.allclose(reduced.to_local(), 4 * _expected_local(full, p, rank))
    back = veragged.redistribute(rooted, mesh, [p], async_op=True).wait()
    ok &= torch.equal(back.to_local(), dt.to_local())
    # async + autograd: the backward of the waited result runs the inverse redistribution
    x = veragged.distribute_tensor(full.clone().requires_grad_(), mesh, [p])
    y = veragged.redistribute(x, mesh, [Replicate()], async_op=True).wait()
    y.to_local().sum().backward()
    ok &= torch.equal(x.grad.to_local(), torch.ones(x.to_local().shape))
    return ok


def test_async_forms_return_handles_that_wait():
    assert all(run_on_ranks(_async_forms, WORLD, timeout=120))
