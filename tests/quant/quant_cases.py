"""Models and helpers shared by the block-scaled weight tests ([Note: block-scaled weights])."""

from __future__ import annotations

import torch
import torch.nn as nn

import veragged
from veragged.quant.formats import FP32_SCALE, RAW
from veragged.quant.reference import quantize

FORMATS = {
    "block128": veragged.BlockFP8(),
    "ue8m0": veragged.BlockFP8(scale="ue8m0"),
    "row128": veragged.BlockFP8(tile=(1, 128)),
    "mx_floor": veragged.MXFP8(),
    "mx_rceil": veragged.MXFP8(rounding="rceil"),
}


class Mixed(nn.Module):
    """Parameters of many shapes in one group: partial tiles both ways, an expert stack whose
    matrices end in a partial tile-row, a matrix smaller than one tile, a 1-D weight, biases."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(200, 300)  # 300 x 200: partial last tile-row and tile-col
        self.b = nn.Linear(300, 260)
        self.experts = nn.Parameter(torch.randn(3, 130, 70) * 0.1)
        self.small = nn.Parameter(torch.randn(40, 50))
        self.scale = nn.Parameter(torch.rand(260) + 0.5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = self.b(h) * self.scale
        e = torch.einsum("nk,ekj->nej", h[:, :130], self.experts).sum(1)
        return h.sum(-1) + e.sum(-1) + (self.small.sum() * 1e-3)


def mixed_quant_fn(name: str):
    """Different formats in one group: 128x128 on the Linears, MXFP8 on the experts, 1x128 on
    the 1-D scale, ue8m0 on the small matrix, biases raw."""
    table = {"a.weight": FORMATS["block128"], "b.weight": FORMATS["mx_rceil"],
             "experts": FORMATS["mx_floor"], "small": FORMATS["ue8m0"],
             "scale": FORMATS["row128"]}

    def quant_fn(fqn, p):
        return table.get(fqn) if name == "mixed" else (FORMATS[name] if p.ndim >= 2 else None)

    return quant_fn


def expected_packed(buffer, full: dict, param_dtype) -> torch.Tensor:
    """The P * Q bytes a QuantDBuffer's all-gather must produce, built from the one-process
    reference quantiser of each full weight (`full`: name -> the full tensor in the param
    dtype) and the buffer's packed layout; alignment gaps are zero."""
    p = buffer.packing
    out = torch.zeros(p.gather_bytes, dtype=torch.uint8)
    S, Q = buffer.shard_size, p.slot_bytes
    refs = {}
    for e, f in zip(buffer.entries, buffer._formats):
        w = full[e.name].to(param_dtype)
        refs[e.name] = (e, f, w, quantize(w, f) if f is not None else None)
    for row in p.dequantize.tolist():
        fmt, off, rows, cols, tr, tc, d, s, _ = row
        e, f, w, q = next(v for v in refs.values() if v[0].start <= off < v[0].stop)
        first = off - e.start
        if fmt == RAW:
            out[d : d + cols * w.element_size()] = w.reshape(-1)[first : first + cols].view(
                torch.uint8)
            continue
        data, scales = q
        out[d : d + rows * cols] = data.reshape(-1)[first : first + rows * cols]
        B, R, C = f.matrix(e.shape)
        _, Rt, Ct = f.tiles(e.shape)
        m, r0 = divmod(first // C, R)
        sc = scales.reshape(B, Rt, Ct)[m, r0 // tr : r0 // tr + -(-rows // tr)].contiguous()
        nbytes = sc.numel() * (4 if fmt == FP32_SCALE else 1)
        out[s : s + nbytes] = sc.reshape(-1).view(torch.uint8)
    return out
