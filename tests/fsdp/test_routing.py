"""Data-dependent routing through a whole training step under veragged's fully_shard.

Each of 4 ranks runs its own subset of experts (tests/harness/routing.py): on every step some
experts are reached by some ranks only, one by none, and one rank runs none; each expert tensor
lies whole on one rank, so ranks hold no element of most experts, reached by them or not, and the
input layer's weight crosses three ranks' slots. Forward, backward, torch's `clip_grad_norm_` or
`veragged.clip_grad_norm_`, torch's AdamW, veragged's Muon or AdamW8bit, a GradScaler, no-sync
micro-batches, HSDP and a DCP save and load must run the same collectives on every rank: every
rank agrees after backward on which parameters have a gradient ([Note: unreached parameters]).

Compared with one process (the mean of every rank's loss): the same parameters have a gradient
(None exactly where no rank reached one, in the default mode), and the losses, gradients, norms,
parameters and optimizer states agree to float32 round-off: the gradient of a parameter is the
same sum of the same per-rank terms in another order (autograd accumulates the ranks' terms in
one process, the reduce-scatter adds them in gloo's order); the first step's losses are bitwise
equal (the same parameters and the same kernels). Compared with torch's fully_shard, which runs
at all only with `set_reduce_scatter_unused_params(True)` (its reduce-scatters differ otherwise):
veragged in that mode gives every trainable parameter a gradient as torch does, and the same
numbers to round-off (the reduce-scatter's summation order depends on where an element sits in
the buffer, Shard(0) chunks there, RaggedShard slots here).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from tests.harness import routing
from tests.harness.device import rank_device_type
from tests.harness.pool import get_pool

WORLD, STEPS = 4, 3
TORCH_HAS_UNUSED_PARAMS_MODE = hasattr(TorchFSDPModule, "set_reduce_scatter_unused_params")


def _mesh(hsdp: bool):
    if hsdp:
        return init_device_mesh(rank_device_type(), (2, WORLD // 2),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(rank_device_type(), (WORLD,))


def _coverage(model) -> dict:
    """Which kinds of (rank, parameter) this rank saw at step 0's routing: a parameter it holds
    no element of and reached, one it holds none of and did not reach, and how many ranks hold
    part of `inp.weight`."""
    rank = dist.get_rank()
    mine = set(routing.routes(0, WORLD)[rank])
    reached_any = set().union(*map(set, routing.routes(0, WORLD)))
    kinds = set()
    for name, p in model.named_parameters():
        if p.to_local().numel():
            continue
        if name.startswith("moe.experts."):
            e = int(name.split(".")[2])
            kinds.add("empty_reached" if e in mine else
                      "empty_unreached_elsewhere" if e in reached_any else "empty_nowhere")
        else:
            kinds.add("empty_reached")  # every rank reaches the layers around the experts
    holders = torch.tensor([float(model.inp.weight.to_local().numel() > 0)])
    dist.all_reduce(holders)
    return {"kinds": kinds, "inp_holders": int(holders.item())}


def _job(cfg: dict, path: str | None = None):
    mesh = _mesh(cfg.get("hsdp", False))
    fired: list[set] = [set()]  # per step, the parameters whose post-accumulate hook ran
    extra = {}

    def on_shard(model):
        extra["coverage"] = _coverage(model)
        if cfg.get("hooks"):
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda p, name=name: fired[-1].add(name))

    def on_sample(step, model, opt):
        fired.append(set())
        if path is not None and step + 1 == cfg["steps"]:
            extra["dcp"] = routing.dcp_roundtrip(model, opt, path)

    kwargs = {k: v for k, v in cfg.items() if k not in ("hsdp", "steps", "hooks")}
    out = routing.train(cfg["steps"], WORLD, mesh=mesh, on_shard=on_shard, on_sample=on_sample,
                        sample=1, **kwargs)
    out.update(extra)
    out["fired"] = [sorted(f) for f in fired[:-1]]
    return out


def _reference(cfg: dict) -> dict:
    kwargs = {k: v for k, v in cfg.items() if k not in ("hsdp", "steps", "hooks", "impl",
                                                        "unused")}
    return routing.train(cfg["steps"], WORLD, **kwargs)


def _close(a, b, what, atol=2e-6, rtol=1e-5):
    assert (a is None) == (b is None), what
    if a is not None:
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=what)


def _check_vs_one_process(res: list, ref: dict):
    names = ref["names"]
    for rank, out in enumerate(res):
        assert out["present"] == ref["present"], rank
        assert out["losses"][0] == ref["losses"][0][rank]  # step 0: bitwise
        for step, losses in enumerate(ref["losses"]):
            assert abs(out["losses"][step] - losses[rank]) <= 1e-5, (rank, step)
        for step, (g, rg) in enumerate(zip(out["grads"], ref["grads"])):
            for name, a, b in zip(names, g, rg):
                _close(a, b, f"rank {rank} step {step} grad {name}")
        for a, b in zip(out["norms"], ref["norms"]):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (a, b)
        for name, a, b in zip(names, out["params"], ref["params"]):
            _close(a, b, f"rank {rank} param {name}")
        assert out["state"] == ref["state"]


CASES = {
    # torch's clip, torch's AdamW, a GradScaler, hooks on the sharded parameters, DCP
    "adamw_torch_clip_scaler": dict(optim="adamw", clip="torch", scaler=True, hooks=True),
    "muon_veragged_clip": dict(optim="muon", clip="veragged"),
    "adamw8bit_veragged_clip": dict(optim="adamw8bit", clip="veragged"),
    "adamw_no_sync_micro_batches": dict(optim="adamw", clip="veragged", micro=2),
    "adamw_hsdp": dict(optim="adamw", clip="torch", hsdp=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_matches_one_process(case, tmp_path):
    cfg = dict(CASES[case], steps=STEPS)
    path = str(tmp_path / "ckpt") if case == "adamw_torch_clip_scaler" else None
    res = get_pool(WORLD).run(_job, cfg, path, timeout=300)
    ref = _reference(cfg)
    # the routing gives every situation: experts reached by some ranks only, and by none
    none_anywhere = [n for n, has in zip(ref["names"], ref["present"][1]) if not has]
    assert "moe.experts.5.w1.weight" in none_anywhere, none_anywhere
    if cfg.get("micro", 1) == 1:  # step 1: expert 1 too
        assert "moe.experts.1.w1.weight" in none_anywhere, none_anywhere
    else:  # an expert only the no-sync micro-batch reached (step 0: expert 1) has a gradient
        first, second = (set().union(*map(set, routing.routes(k, WORLD))) for k in (0, 1))
        assert 1 in first - second and ref["present"][0][ref["names"].index(
            "moe.experts.1.w1.weight")]
    _check_vs_one_process(res, ref)
    if cfg.get("hooks"):
        kinds = set().union(*(r["coverage"]["kinds"] for r in res))
        assert {"empty_reached", "empty_unreached_elsewhere", "empty_nowhere"} <= kinds, kinds
        assert res[0]["coverage"]["inp_holders"] >= 3
        for out in res:  # each hook fired once per written gradient, deferred ones included
            for step, (fired, present) in enumerate(zip(out["fired"], out["present"])):
                assert fired == sorted(n for n, h in zip(out["names"], present) if h), step
    if path is not None:
        for out in res:
            assert out["dcp"]["keys_agree"] and out["dcp"]["loaded"], out["dcp"]
            assert "moe.experts.5.w1.weight" not in out["dcp"]["keys"]


@pytest.mark.skipif(not TORCH_HAS_UNUSED_PARAMS_MODE,
                    reason="this torch's FSDP2 has no set_reduce_scatter_unused_params (2.11)")
def test_routing_unused_params_mode_matches_torch():
    cfg = dict(optim="adamw", clip="torch", steps=STEPS, unused=True)
    ours = get_pool(WORLD).run(_job, cfg, timeout=300)
    theirs = get_pool(WORLD).run(_job, dict(cfg, impl="torch"), timeout=300)
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert all(all(p) for p in a["present"])  # every trainable parameter, zeros if unreached
        assert a["present"] == b["present"]
        assert a["losses"][0] == b["losses"][0]  # step 0: bitwise
        for x, y in zip(a["losses"], b["losses"]):
            assert abs(x - y) <= 1e-5
        for step, (g, tg) in enumerate(zip(a["grads"], b["grads"])):
            for name, x, y in zip(a["names"], g, tg):
                _close(x, y, f"rank {rank} step {step} grad {name}")
        for x, y in zip(a["norms"], b["norms"]):
            assert abs(x - y) <= 1e-6, (x, y)
        for name, x, y in zip(a["names"], a["params"], b["params"]):
            _close(x, y, f"rank {rank} param {name}")
        assert a["state"] == b["state"]
