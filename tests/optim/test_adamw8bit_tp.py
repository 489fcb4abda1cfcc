"""veragged.optim.AdamW8bit on FSDP x TP parameters ((dp, tp) and HSDP (replicate, dp, tp) meshes
on gloo ranks) against AdamW8bit on the full tensors in one process, bitwise: parameters, 8-bit
codes and absmax (whose DTensor layout is checked by gathering it), fp32 moments; block sizes
that TP or FSDP would cut raise ([Note: AdamW8bit blocks under TP]).
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from veragged import RaggedShard
from veragged.optim import AdamW8bit
from tests.harness.pool import get_pool

import tp_cases
from tp_cases import srs

# block size -> [(name, shape, (dp placement, tp placement))]; min_8bit_size 64 everywhere
GROUPS = {
    8: [
        ("row", (8, 16), (RaggedShard((0,), (1, 3)), Shard(1))),  # TP-local rows of 8
        ("col_elements", (8, 12), (srs((0, 1), (1, 2)), Shard(0))),  # cut mid-row at 16
        ("uneven_col", (9, 8), (srs((0,), (0, 1)), Shard(0))),  # TP pieces 40 and 32
        ("uneven_experts", (2, 9, 8), (RaggedShard((0,), (1, 0)), Shard(1))),  # rows 40, 32
        ("rep", (10, 8), (RaggedShard((0, 1), (3, 2)), Replicate())),
        ("experts", (4, 4, 8), (srs((0,), (1, 1)), Shard(0))),  # EP
        ("tp_only", (8, 16), (Replicate(), Shard(1))),
        ("bias", (16,), (srs((0,), (1, 1)), Shard(0))),  # fp32 state (< 64 elements)
    ],
    32: [
        ("col", (16, 8), (srs((0,), (1, 1)), Shard(0))),
        ("row_wide", (4, 64), (RaggedShard((0,), (1, 1)), Shard(1))),  # absmax (4, 2)
    ],
    16: [("blocks_span_rows", (2, 8, 4), (RaggedShard((0,), (1, 1)), Shard(1)))],  # f = 4
    12: [("gcd", (2, 12, 6), (RaggedShard((0,), (1, 1)), Shard(1)))],  # g = 6, f = 2
}
CASES = [(bs, *case) for bs, cases in GROUPS.items() for case in cases]
OPTS = dict(lr=1e-2, weight_decay=0.1, min_8bit_size=64)


def _optimizer(params, **kw):
    groups, k = [], 0
    for bs, cases in GROUPS.items():
        groups.append({"params": [(name, params[k + i]) for i, (name, *_) in enumerate(cases)],
                       "block_size": bs})
        k += len(cases)
    return AdamW8bit(groups, **OPTS, **kw)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(mesh_kind, pattern, steps):
    mesh = tp_cases.mesh_of(mesh_kind)
    gen = torch.Generator().manual_seed(5)
    fulls = [torch.randn(shape, generator=gen) for _, _, shape, _ in CASES]
    params = [tp_cases.place(f, mesh, pl) for f, (_, _, _, pl) in zip(fulls, CASES)]
    refs = [nn.Parameter(f.clone()) for f in fulls]
    opt = _optimizer(params, grad_agreement="mesh")
    ref = _optimizer(refs)
    present = tp_cases.pattern(pattern)
    for step in range(steps):
        for q, g in zip(refs, tp_cases.set_grads(params, step, present)):
            q.grad = g
        opt.step()
        ref.step()
    res = {}
    for (_, name, _, _), p, q in zip(CASES, params, refs):
        res[name] = torch.equal(p.full_tensor(), q.detach())
        for key, want in ref.state[q].items():
            got = _full(opt.state[p][key])
            res[f"{name}.{key}"] = (got.shape == want.shape or key.endswith("absmax")) and \
                torch.equal(got.reshape(-1), want.reshape(-1))
    res["kinds"] = sorted({k for p in params for k in opt.state[p]})
    return res


@pytest.mark.parametrize("pattern", ["all", "cycle"])
def test_fsdp_x_tp_state_equals_one_process_bitwise(pattern):
    """5 steps on a 2x2 (dp, tp) mesh, every TP placement kind, uneven TP, block sizes 8 to 32."""
    for res in get_pool(4).run(_train, "2d", pattern, 5):
        kinds = res.pop("kinds")
        assert "exp_avg_codes" in kinds and "exp_avg" in kinds, kinds  # 8-bit and fp32 state
        assert all(v is True for v in res.values()), {k: v for k, v in res.items() if v is not True}


def test_hsdp_x_tp_state_equals_one_process_bitwise():
    for res in get_pool(8).run(_train, "3d", "cycle", 3, timeout=300):
        res.pop("kinds")
        assert all(v is True for v in res.values()), {k: v for k, v in res.items() if v is not True}


def _absmax_placements():
    mesh = tp_cases.mesh_of("2d")
    out = {}
    for bs, name, shape, pl in CASES:
        p = tp_cases.place(torch.zeros(shape), mesh, pl)
        opt = AdamW8bit([p], block_size=bs, min_8bit_size=64)
        a = opt.state[p].get("exp_avg_absmax")
        out[name] = None if a is None else (tuple(a.shape), tuple(a.placements))
    return out


def test_absmax_global_shape_and_placements():
    """The absmax keeps the parameter's Shard(d); d = 0 makes it element-wise over blocks."""
    got = get_pool(4).run(_absmax_placements)[0]
    assert got["row"] == ((8, 2, 1), (RaggedShard((0,), (1, 3)), Shard(1)))
    assert got["row_wide"] == ((4, 2, 1), (RaggedShard((0,), (1, 1)), Shard(1)))
    assert got["blocks_span_rows"] == ((2, 2, 1), (RaggedShard((0,), (1, 1)), Shard(1)))
    assert got["gcd"] == ((2, 6, 1), (RaggedShard((0,), (1, 1)), Shard(1)))
    assert got["col"] == ((4, 1), (srs((0, 1), (1, 1)), Shard(0)))
    assert got["col_elements"] == ((4, 3), (srs((0, 1), (1, 2)), Shard(0)))
    assert got["uneven_col"] == ((9, 1), (srs((0, 1), (0, 1)), Shard(0)))
    assert got["rep"] == ((10,), (RaggedShard((0,), (6, 4)), Replicate()))
    assert got["bias"] is None


def _bad_inputs():
    mesh = tp_cases.mesh_of("2d")
    res = {}

    def make(name, shape, pl, bs):
        p = tp_cases.place(torch.zeros(shape), mesh, pl)
        return lambda: AdamW8bit([(name, p)], block_size=bs, min_8bit_size=1)

    row = make("w_row", (8, 16), (RaggedShard((0,), (1, 1)), Shard(1)), 16)
    res["tp_row"] = tp_cases.raises(row, ValueError, "w_row", "block_size=16", "[8, 16]",
                                    "prod(local_shape[1:])", "[8]")
    res["uneven"] = tp_cases.raises(make("w_uneven", (9, 8), (srs((0,), (1, 0)), Shard(0)), 16),
                                    ValueError, "w_uneven", "block_size=16", "[9, 8]", "[32, 40]")
    res["fsdp_cut"] = tp_cases.raises(make("w_col", (16, 8), (srs((0,), (1, 3)), Shard(0)), 32),
                                      ValueError, "w_col", "rank 0 of mesh dim 0", "16 elements",
                                      "flat offset 0", "[8, 8]", "32-element")
    from torch.distributed.tensor import distribute_tensor

    strided = nn.Parameter(distribute_tensor(torch.zeros(8, 8), mesh,
                                             [_StridedShard(0, split_factor=2), Shard(0)]))
    res["strided"] = tp_cases.raises(
        lambda: AdamW8bit([("w_s", strided)], block_size=8, min_8bit_size=1),
        ValueError, "w_s", "_StridedShard")
    return res


def test_block_sizes_that_tp_or_fsdp_would_cut_raise():
    for res in get_pool(4).run(_bad_inputs):
        assert all(v is True for v in res.values()), res
