"""The DeepSeek-format export ([Note: DeepSeek export], veragged/quant/export.py): every rank
quantises its own tile-rows of the master, DCP writes the FP8 weights and fp32
`weight_scale_inv`, and what loads back (on one rank, into plain tensors) equals the offline
quantiser of the full master bit for bit, for any world size that wrote it."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import veragged
from veragged.quant.export import deepseek_state_dict, scale_name
from veragged.quant.reference import quantize, scale_inv
from tests.harness import get_mesh, run_on_ranks
from tests.quant.quant_cases import FORMATS


class Net(nn.Module):
    """A partial last tile-row and tile-col (300 x 200), a matrix under one tile (40 x 50), an
    expert stack ending in a partial tile-row (3 x 130 x 70), 1-D and bias entries."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(200, 300)
        self.b = nn.Linear(300, 260, bias=False)
        self.small = nn.Parameter(torch.randn(40, 50))
        self.experts = nn.Parameter(torch.randn(3, 130, 70) * 0.1)
        self.norm = nn.Parameter(torch.rand(260) + 0.5)


QUANT = {"a.weight": FORMATS["block128"], "b.weight": FORMATS["ue8m0"],
         "small": FORMATS["block128"], "experts": FORMATS["block128"]}


def _save(folder):
    net = Net()
    veragged.fully_shard(net.a, mesh=get_mesh(), quant_fn=lambda n, p: QUANT.get(f"a.{n}"))
    veragged.fully_shard(net, mesh=get_mesh(), quant_fn=lambda n, p: QUANT.get(n))
    with torch.no_grad():  # a step's worth of change: the export reads the current master
        for p in net.parameters():
            p.mul_(1.5)
    full = {n: p.full_tensor() for n, p in net.named_parameters()}
    sd = deepseek_state_dict(net, dtype=torch.bfloat16)
    kinds = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=folder)
    return full, kinds


def _load(folder, full):
    sd = {}
    for name, w in full.items():
        f = QUANT.get(name)
        if f is None:
            sd[name] = torch.empty(w.shape, dtype=torch.bfloat16)
            continue
        sd[name] = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        sd[scale_name(name)] = torch.empty(quantize(w, f)[1].shape, dtype=torch.float32)
    dcp.load(sd, checkpoint_id=folder)
    same = {}
    for name, w in full.items():
        f = QUANT.get(name)
        if f is None:
            same[name] = torch.equal(sd[name], w.to(torch.bfloat16))
            continue
        data, scales = quantize(w, f)
        same[name] = (torch.equal(sd[name].view(torch.uint8), data)
                      and torch.equal(sd[scale_name(name)], scale_inv(scales, f)))
    return same


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_deepseek_export_equals_the_offline_quantiser(world, tmp_path):
    folder = str(tmp_path / "ckpt")
    results = run_on_ranks(_save, world, args=(folder,), timeout=180)
    full, kinds = results[0]
    assert kinds["a.weight"] == (torch.float8_e4m3fn, (300, 200)), kinds
    assert kinds["a.weight_scale_inv"] == (torch.float32, (3, 2)), kinds
    assert kinds["experts_scale_inv"] == (torch.float32, (3, 2, 1)), kinds
    assert kinds["norm"] == (torch.bfloat16, (260,)), kinds
    (same,) = run_on_ranks(_load, 1, args=(folder, full), timeout=180)
    assert all(same.values()), same
    if world > 1:  # and at another world size, into plain tensors on every rank
        for same in run_on_ranks(_load, 2, args=(folder, full), timeout=180):
            assert all(same.values()), same


def _refuse():
    net = nn.Linear(64, 64)
    veragged.fully_shard(net, mesh=get_mesh(), quant_fn=lambda n, p: veragged.MXFP8()
                         if p.ndim == 2 else None)
    plain = nn.Linear(8, 8)
    veragged.fully_shard(plain, mesh=get_mesh())
    errors = []
    for m in (net, plain):
        try:
            deepseek_state_dict(m)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_deepseek_export_refuses_what_it_cannot_write():
    (errors,) = run_on_ranks(_refuse, 1, timeout=60)
    assert "'weight'" in errors[0] and "MXFP8" in errors[0], errors
    assert "no parameter" in errors[1], errors
