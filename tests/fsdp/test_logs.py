"""fully_shard's logs (veragged/fsdp/log.py): INFO one line per root at its first forward, DEBUG
every group's plan and fallback, nothing on stderr by default."""

import contextlib
import io
import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

import veragged
from tests.harness import get_mesh, run_on_ranks


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 16), nn.LayerNorm(16))
    m[3].weight.requires_grad_(False)
    m[3].bias.requires_grad_(False)
    return m


def _build(m):
    veragged.fully_shard(m[0], mesh=get_mesh(), quant_fn=lambda n, p: veragged.BlockFP8()
                         if p.ndim == 2 else None)
    veragged.fully_shard(m[2], mesh=get_mesh(),
                         shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    veragged.fully_shard(m[3], mesh=get_mesh())
    veragged.fully_shard(m, mesh=get_mesh())


def _logged():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # default logging: nothing printed
        m = _model()
        _build(m)
        m(torch.randn(4, 16)).sum().backward()
    handler = _Records()
    log = logging.getLogger("veragged")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        m = _model()
        _build(m)
        m(torch.randn(4, 16)).sum().backward()
        m(torch.randn(4, 16)).sum().backward()  # a second step logs nothing more
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    return err.getvalue(), handler.lines


def test_info_per_root_debug_per_group_silent_by_default():
    for printed, lines in run_on_ranks(_logged, 2, timeout=120):
        assert printed == "", printed
        info = [m for lvl, m in lines if lvl == "INFO"]
        debug = [m for lvl, m in lines if lvl == "DEBUG"]
        assert len(info) == 1, info
        # m[2]: its weight in torch's chunked layout, its bias in a planned group
        assert "root Sequential: 4 modules, 4 groups" in info[0], info
        assert "over 2 ranks" in info[0] and "planner padding" in info[0], info
        assert "BlockFP8(128x128, fp32)" in info[0], info
        plans = [m for m in debug if " group " in m and "falls back" not in m
                 and "is frozen" not in m]
        assert len(plans) == 4, debug
        assert any("QuantDBuffer" in m and "8-bit formats" in m for m in plans), plans
        assert any("ChunkedDBuffer" in m for m in plans), plans
        assert any("falls back: torch's chunked layout" in m for m in debug), debug
        assert any("is frozen" in m and "LayerNorm" in m for m in debug), debug
        assert all(lvl in ("INFO", "DEBUG") for lvl, _ in lines), lines
