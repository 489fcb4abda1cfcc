"""How the optimizers agree on grad=None ([Note: symmetric grad presence]), on gloo ranks.

- One rank without a gradient: the all-reduce runs on the parameters' mesh group, once per step
  and optimizer, only ranks lacking a gradient read it, and the result is torch.optim's (Muon,
  AdamW) or single-process AdamW8bit's on the full tensors, bitwise.
- Declared-symmetric parameters (what veragged.fully_shard guarantees) and
  grad_agreement="local": no collective at all.
- Two pipeline stages (ranks 0-1 and 2-3) with different models, each stepping its own
  optimizer with a rank lacking a gradient: no collective crosses the stages (a world-group
  mask would hang or fail), and each stage matches torch.optim on its full tensors.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import veragged
from veragged import RaggedShard
from veragged.optim import AdamW8bit, Muon
from veragged.optim.common import GradPresence, declare_symmetric_grads
from tests.harness import get_mesh, run_on_ranks
from tests.harness.grads import set_grads

MUON = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
A8 = dict(lr=1e-2, weight_decay=0.1, block_size=32, min_8bit_size=256)
STEPS = 3


def _sharded(full, dims, units, mesh):
    return nn.Parameter(veragged.distribute_tensor(full.clone(), mesh, [RaggedShard(dims, units)]))


def _muon_params(mesh):
    """A (rows 5/0/7/4), B (whole on rank 1), v (elements, even): two Muon matrices and one
    AdamW vector. Returns (sharded params, full copies)."""
    gen = torch.Generator().manual_seed(1)
    fulls = [torch.randn(16, 32, generator=gen), torch.randn(8, 12, generator=gen),
             torch.randn(40, generator=gen)]
    layouts = [((0,), (5, 0, 7, 4)), ((0,), (0, 8, 0, 0)), ((0,), (10, 10, 10, 10))]
    return ([_sharded(f, d, u, mesh) for f, (d, u) in zip(fulls, layouts)],
            [nn.Parameter(f.clone()) for f in fulls])


def _adamw8bit_params(mesh):
    """C: 10 rows of one 32-element block (8-bit state); D: 35 elements (fp32 state)."""
    gen = torch.Generator().manual_seed(2)
    fulls = [torch.randn(10, 32, generator=gen), torch.randn(5, 7, generator=gen)]
    layouts = [((0,), (3, 3, 0, 4)), ((0,), (2, 1, 1, 1))]
    return ([_sharded(f, d, u, mesh) for f, (d, u) in zip(fulls, layouts)],
            [nn.Parameter(f.clone()) for f in fulls])


def _drop(step, i, r):
    """Muon set: rank 2 lacks A's gradient at step 1; nobody has v's at step 2. AdamW8bit
    set (i + 10): rank 0 lacks C's at step 0, rank 3 lacks D's at step 2."""
    return (step, i, r) in {(1, 0, 2), (2, 2, 0), (2, 2, 1), (2, 2, 2), (2, 2, 3),
                            (0, 10, 0), (2, 11, 3)}


def _max_diff(params, refs):
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
    return max((a - b).abs().max().item() for a, b in zip(full, refs))


def _one_rank_without_grad():
    mesh, rank = get_mesh(), dist.get_rank()
    muon_p, muon_ref = _muon_params(mesh)
    a8_p, a8_ref = _adamw8bit_params(mesh)
    muon = Muon(muon_p, **MUON)
    ref_muon = torch.optim.Muon(muon_ref[:2], lr=0.02, weight_decay=0.1)
    ref_adamw = torch.optim.AdamW(muon_ref[2:], lr=0.02, weight_decay=0.1, foreach=False)
    a8 = AdamW8bit(a8_p, **A8)
    ref_a8 = AdamW8bit(a8_ref[:1], **A8)  # one process, plain tensors
    ref_torch = torch.optim.AdamW(a8_ref[1:], lr=1e-2, weight_decay=0.1, foreach=False)
    reduces, reads = [], []
    real_all_reduce, real_tolist = dist.all_reduce, torch.Tensor.tolist

    def all_reduce(t, *args, group=None, **kwargs):
        reduces.append(group)
        return real_all_reduce(t, *args, group=group, **kwargs)

    def tolist(t):
        reads.append(t.numel())
        return real_tolist(t)

    for step in range(STEPS):
        for params, refs, offset in ((muon_p, muon_ref, 0), (a8_p, a8_ref, 10)):
            present = lambda i, r, o=offset: not _drop(step, i + o, r)  # noqa: E731
            for ref, g in zip(refs, set_grads(params, step, present)):
                ref.grad = g
        with mock.patch.object(dist, "all_reduce", all_reduce), \
                mock.patch.object(torch.Tensor, "tolist", tolist):
            muon.step()
            a8.step()
        for opt in (ref_muon, ref_adamw, ref_a8, ref_torch):
            opt.step()
    return {
        "muon": _max_diff(muon_p, muon_ref),
        "adamw8bit": _max_diff(a8_p, a8_ref),
        "reduces": len(reduces),
        "on_mesh_group": all(g is mesh.get_group(0) for g in reduces),
        "reads": reads,
        "rank": rank,
    }


def _symmetric_without_collectives():
    """Declared parameters, and grad_agreement="local": the same grad/None on every rank."""
    mesh = get_mesh()
    counts = {}
    for mode in ("declared", "local"):
        muon_p, muon_ref = _muon_params(mesh)
        a8_p, _ = _adamw8bit_params(mesh)
        kw = {}
        if mode == "declared":
            declare_symmetric_grads(muon_p + a8_p)
        else:
            kw = dict(grad_agreement="local")
        muon, a8 = Muon(muon_p, **MUON, **kw), AdamW8bit(a8_p, **A8, **kw)
        ref_muon = torch.optim.Muon(muon_ref[:2], lr=0.02, weight_decay=0.1)
        for step in range(2):
            grads = set_grads(muon_p + a8_p, step, lambda i, r: i != 1)  # B: None everywhere
            for ref, g in zip(muon_ref[:2], grads):
                ref.grad = g
            with CommDebugMode() as comm:
                a8.step()
            counts[f"{mode}/adamw8bit"] = comm.get_total_counts()
            with CommDebugMode() as comm:
                muon.step()
            counts[f"{mode}/muon"] = {str(k).split(".")[-1]: v
                                      for k, v in comm.get_comm_counts().items()}
            ref_muon.step()
        counts[f"{mode}/diff"] = _max_diff(muon_p[:2], muon_ref[:2])
    return counts


def _presence_reads():
    """GradPresence on its own: a rank with every gradient never reads the all-reduce."""
    mesh, rank = get_mesh(), dist.get_rank()
    p = _sharded(torch.ones(8), (0,), (2, 2, 2, 2), mesh)
    set_grads([p], 0, lambda i, r: r != 3)
    presence = GradPresence([p], "auto")
    with mock.patch.object(torch.Tensor, "tolist", side_effect=AssertionError("read")):
        if rank != 3:
            assert presence.verdicts() == [True]
    verdict = presence.verdicts()  # rank 3 reads: some rank has the gradient
    presence.finish()
    with pytest.raises(ValueError, match=r"grad_agreement must be one of .* got 'world'"):
        Muon([p], grad_agreement="world")
    with pytest.raises(ValueError, match=r"grad_agreement must be one of .* got 'world'"):
        AdamW8bit([p], grad_agreement="world")
    return verdict


def _world_checks():
    return _one_rank_without_grad(), _symmetric_without_collectives(), _presence_reads()


@pytest.fixture(scope="module")
def world_results():
    return run_on_ranks(_world_checks, 4, timeout=300)


def test_one_rank_without_grad_matches_torch(world_results):
    for res, _, _ in world_results:
        assert res["muon"] == 0.0 and res["adamw8bit"] == 0.0, res
        assert res["reduces"] == 2 * STEPS and res["on_mesh_group"], res  # one per optimizer
    # the mask is read only where a gradient was missing: rank 2 (A, step 1), every rank (v,
    # step 2), rank 0 (C, step 0), rank 3 (D, step 2); Muon masks 3 parameters, AdamW8bit 2
    reads = {res["rank"]: res["reads"] for res, _, _ in world_results}
    assert reads == {0: [2, 3], 1: [3], 2: [3, 3], 3: [3, 2]}, reads


def test_symmetric_gradients_need_no_collective(world_results):
    for _, counts, _ in world_results:
        for mode in ("declared", "local"):
            assert counts[f"{mode}/adamw8bit"] == 0, counts
            assert "allreduce_" not in counts[f"{mode}/muon"], counts
            assert counts[f"{mode}/muon"].get("alltoall_base_", 0) > 0, counts  # the exchange
            assert counts[f"{mode}/diff"] == 0.0, counts


def test_only_ranks_without_grad_read_the_mask(world_results):
    assert [v for *_, v in world_results] == [[True]] * 4


# --------------------------------------------------------------------------- pipeline stages
class _Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 16)
        self.b = nn.Linear(16, 24, bias=False)


class _Stage1(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(64, 16)  # weight 1024: 8-bit state
        self.d = nn.Linear(16, 7)  # fp32 state
        self.e = nn.Parameter(torch.randn(300))  # 8-bit, one rank holds it whole


def _stage_model(stage, mesh):
    torch.manual_seed(stage)
    model = _Stage0() if stage == 0 else _Stage1()
    if mesh is not None:
        from veragged.optim import adamw8bit_granularity

        fn = adamw8bit_granularity(A8["block_size"], A8["min_8bit_size"]) if stage else None
        veragged.fully_shard(model, mesh=mesh, granularity_fn=fn)
    return model


def _two_stages():
    world_mesh = get_mesh()
    stage, dp = world_mesh.get_coordinate()[0], world_mesh["dp"]
    model, ref_model = _stage_model(stage, dp), _stage_model(stage, None)
    params, refs = list(model.parameters()), list(ref_model.parameters())
    kw = dict(grad_agreement="mesh")  # gradients dropped by hand: agree (within the stage)
    if stage == 0:  # Muon for the matrices, AdamW for the bias
        opts = [Muon(params, **MUON, **kw)]
        ref_opts = [torch.optim.Muon([refs[0], refs[2]], lr=0.02, weight_decay=0.1),
                    torch.optim.AdamW([refs[1]], lr=0.02, weight_decay=0.1, foreach=False)]
    else:
        opts = [AdamW8bit(params, **A8, **kw)]
        eight = [p for p in refs if p.numel() >= A8["min_8bit_size"]]
        ref_opts = [AdamW8bit(eight, **A8),
                    torch.optim.AdamW([p for p in refs if p.numel() < A8["min_8bit_size"]],
                                      lr=1e-2, weight_decay=0.1, foreach=False)]
    groups = []
    real_all_reduce = dist.all_reduce

    def all_reduce(t, *args, group=None, **kwargs):
        groups.append(dist.get_process_group_ranks(group))
        return real_all_reduce(t, *args, group=group, **kwargs)

    for step in range(STEPS):
        # a different parameter and rank lacks its gradient each step, per stage
        present = lambda i, r: (i, r) != (step % len(params), step % 2)  # noqa: E731
        for ref, g in zip(refs, set_grads(params, step, present, seed=stage)):
            ref.grad = g
        with mock.patch.object(dist, "all_reduce", all_reduce):
            for opt in opts:
                opt.step()
        for opt in ref_opts:
            opt.step()
    return stage, _max_diff(params, refs), groups


def test_two_pipeline_stages_step_their_own_optimizers():
    """Ranks 0-1 (stage 0, Muon) and 2-3 (stage 1, AdamW8bit) hold different models; each
    pair's agreement runs on its own data-parallel group and must not wait for the other."""
    results = run_on_ranks(_two_stages, 4, mesh_shape=(2, 2), mesh_dim_names=("pp", "dp"),
                           timeout=240)
    for rank, (stage, diff, groups) in enumerate(results):
        assert stage == rank // 2 and diff == 0.0, (rank, diff)
        assert groups and all(g == [2 * stage, 2 * stage + 1] for g in groups), (rank, groups)
