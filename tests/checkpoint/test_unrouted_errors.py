"""torch's entry points that cannot take a RaggedShard, without `route_torch_entry_points()`.

[Note: torch's entry points without the routing] (veragged/placement/torch_callers.py): each
must raise, on every rank, an error that names `veragged.route_torch_entry_points()` and, where
torch's loader was at a key, the key; never torch's opaque "unsupported placements RS(0,)" or a
shape mismatch, never a hang, never wrong data. The same loads succeed under the routing
(test_torch_entry_points.py). Models as there: a Llama on 1-D (2 ranks) and FSDP x TP (dp 2,
tp 2) meshes, on the mesh's device or on meta.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
import torch.distributed.tensor as dtensor
from torch.distributed.checkpoint.state_dict import StateDictOptions

import veragged
from tests.checkpoint.test_torch_entry_points import (
    TIMEOUT_S,
    _adamw,
    _build,
    _full_model_sd,
    _full_optim_sd,
    _rank0_meta_init,
)
from tests.harness import get_mesh, run_on_ranks
from tests.harness.pool import get_pool

ROUTE = "veragged.route_torch_entry_points()"


def _load(mode: str, layout: str, meta: bool) -> tuple[str, str] | None:
    """torch's loader `mode` on veragged's model, unrouted: (error type, message) or None."""
    model, _ = _build("veragged", layout, meta)
    assert not veragged.torch_entry_points_routed()
    full = _full_model_sd(layout)
    rank0 = dist.get_rank() == 0
    try:
        if mode == "distribute":  # torch's rank-0 meta-init recipe: torch's distribute_tensor
            _rank0_meta_init(model, full)
        elif mode == "optimizer":  # the model loads through veragged; then torch's optim setter
            veragged.checkpoint.set_model_state_dict(model, full, options=StateDictOptions(
                full_state_dict=True))
            optim = _adamw(model)
            osd = _full_optim_sd(model, optim)
            dsd.set_optimizer_state_dict(model, optim, osd if rank0 else {}, options=(
                StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)))
        else:
            broadcast = mode == "broadcast"
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
            if mode == "set_state_dict":
                optim = _adamw(model)
                dsd.set_state_dict(model, optim, model_state_dict=full,
                                   optim_state_dict=_full_optim_sd(model, optim), options=opts)
            else:
                dsd.set_model_state_dict(model, full if rank0 or not broadcast else {},
                                         options=opts)
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


CASES = [  # mode, layout, meta, what the error names
    ("every_rank", "1d", False, "'embed.weight'"),
    ("every_rank", "tp", True, "'embed.weight'"),
    ("broadcast", "1d", False, "'embed.weight'"),
    ("broadcast", "tp", False, "'embed.weight'"),
    ("broadcast", "1d", True, "embed.weight"),  # a meta model: fully_shard's load hook
    ("set_state_dict", "1d", False, "'state.embed.weight.exp_avg'"),  # torch loads it first
    ("optimizer", "1d", False, "'state.embed.weight.exp_avg'"),
    ("distribute", "1d", True, "RaggedShard(dims="),
    ("distribute", "tp", True, "RaggedShard(dims="),
]


@pytest.mark.parametrize("mode,layout,meta,names", CASES)
def test_torch_loader_without_routing_names_the_opt_in(mode, layout, meta, names):
    world = 2 if layout == "1d" else 4
    for rank, err in enumerate(get_pool(world).run(_load, mode, layout, meta,
                                                   timeout=TIMEOUT_S)):
        assert err is not None, (rank, "torch's loader took a RaggedShard value unrouted")
        kind, msg = err
        assert ROUTE in msg and names in msg, (rank, kind, msg)
        assert "unsupported placements" not in msg and "must match the size" not in msg, msg


def _direct() -> dict[str, str]:
    """torch's own distribute_tensor and DTensor.from_local, called by a user on RaggedShard."""
    mesh = get_mesh()
    placement = veragged.RaggedShard((0,), (1, 3))
    out = {}
    try:
        dtensor.distribute_tensor(torch.ones(4, 2), mesh, [placement])
        out["distribute_tensor"] = "no error"
    except RuntimeError as e:
        out["distribute_tensor"] = str(e)
    out["str"] = str(placement)  # anywhere else, the short form
    out["f-string"] = f"{placement}"
    return out


def test_torch_distribute_tensor_names_the_opt_in():
    for res in run_on_ranks(_direct, 2, timeout=TIMEOUT_S):
        assert ROUTE in res["distribute_tensor"] and "veragged.distribute_tensor" in res[
            "distribute_tensor"], res
        assert res["str"] == res["f-string"] == "RS(0,)"
