"""`deepseek_state_dict`: a fully_shard module's master weights as a DeepSeek-format checkpoint
(FP8 E4M3 `weight` + fp32 `weight_scale_inv` per 128 x 128 tile), for `torch.distributed.
checkpoint.save`, quantised where each rank holds the tiles.

[Note: DeepSeek export]
A parameter whose group has a `BlockFP8` format holds whole tile-rows on every rank ([Note:
block-scaled weights]), so every rank quantises its own rows of the master with the one-process
rules (`reference.quantize`: [Note: block-scaled rules]) and no collective: the result is the
offline quantiser's output of the full master, bit for bit, at any world size. The entries are
RaggedShard DTensors on the parameter's mesh, so DCP writes each rank's part and loads them at
any other world size, into plain tensors too:
- `<name>`: float8_e4m3fn, the parameter's shape, the master's placement;
- `<name minus ".weight">.weight_scale_inv` (or `<name>_scale_inv` for another name): fp32,
  [..., ceil(rows / tile_rows), ceil(cols / tile_cols)], the multiplier of each tile's E4M3
  values (`scale="ue8m0"`: powers of two, DeepSeek-V3.1's `scale_fmt: ue8m0`); each rank holds
  the scales of its tile-rows.
Every other entry is the module's own state dict entry (cast to `dtype` if given). The master is
quantised in its own dtype (fp32 masters are not rounded to the param dtype first).
"""

from __future__ import annotations

import math

import torch

from veragged.placement.ragged_shard import RaggedShard
from veragged.placement.tensor import RaggedDTensor, make_spec
from veragged.quant.formats import BlockFP8
from veragged.quant.reference import quantize, scale_inv

__all__ = ["deepseek_state_dict", "scale_name"]


def scale_name(name: str) -> str:
    """The state-dict key of `name`'s scales: `x.weight` -> `x.weight_scale_inv`."""
    return f"{name}_scale_inv"


def _scale_rows(a: int, b: int, R: int, C: int, tr: int) -> int:
    """Tile-rows of the elements [a, b) of a stack of R x C matrices whose rank pieces are whole
    tile-rows of a matrix or whole matrices."""
    if b <= a:
        return 0
    lo, hi = a // C, b // C
    n = 0
    for k in range(lo // R, (hi - 1) // R + 1):
        rows = min(hi, (k + 1) * R) - max(lo, k * R)
        n += -(-rows // tr)
    return n


def _local_quantized(local: torch.Tensor, a: int, b: int, shape, fmt: BlockFP8):
    """This rank's E4M3 bytes and scale_inv rows of its elements [a, b) of a tensor."""
    B, R, C = fmt.matrix(shape)
    if b <= a:
        _, _, Ct = fmt.tiles(shape)
        return (local.new_empty((0,), dtype=torch.uint8),
                local.new_empty((0, Ct), dtype=torch.float32))
    whole = (a // C) % R == 0 and (b - a) % (R * C) == 0
    piece = local.reshape(-1, R, C) if whole else local.reshape(-1, C)
    data, scales = quantize(piece, fmt)
    return data.reshape(-1), scale_inv(scales, fmt).reshape(-1, scales.shape[-1])


def _groups(module) -> dict[int, tuple]:
    """id(sharded parameter) -> (buffer, index) over every fully_shard group under `module`."""
    found = {}
    for m in module.modules():
        st = getattr(m, "_veragged_state", None)
        for g in (st.groups if st is not None else ()):
            for i, p in enumerate(g.sharded):
                found[id(p)] = (g.buffer, i)
    return found


def deepseek_state_dict(module: torch.nn.Module, *, dtype: torch.dtype | None = None
                        ) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every parameter whose group has a `BlockFP8` format written as
    DeepSeek-format FP8 weight and `weight_scale_inv` ([Note: DeepSeek export]); pass it to
    `torch.distributed.checkpoint.save`. `dtype`: cast the other floating entries (DeepSeek's
    checkpoints keep them in bf16). Raises for an MXFP8 parameter (not DeepSeek's format) and
    for a module without block-scaled groups."""
    sd = module.state_dict()
    owners = _groups(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    exported = 0
    for key, value in sd.items():
        owner = owners.get(id(params[key])) if key in params else None
        fmt = None
        if owner is not None and getattr(owner[0], "_formats", None) is not None:
            fmt = owner[0]._formats[owner[1]]
        if fmt is None:
            out[key] = value.to(dtype) if dtype and value.is_floating_point() else value
            continue
        if not isinstance(fmt, BlockFP8):
            raise ValueError(f"deepseek_state_dict: parameter {key!r} has format {fmt}; the "
                             "DeepSeek checkpoint format holds BlockFP8 weights only")
        buf, i = owner
        out[key], out[scale_name(key)] = _export(buf, i, value, fmt)
        exported += 1
    if not exported:
        raise ValueError(f"deepseek_state_dict: no parameter of {type(module).__name__} has a "
                         "BlockFP8 format (fully_shard(..., quant_fn=...) gives them)")
    return out


def _export(buf, i: int, value, fmt: BlockFP8):
    """The FP8 weight and scale_inv DTensors of tensor `i` of QuantDBuffer `buf` from its
    master `value` (the state dict's RaggedShard DTensor)."""
    e = buf.entries[i]
    S, P = buf.shard_size, buf.world
    spans = [(max(e.start, r * S) - e.start, min(e.stop, (r + 1) * S) - e.start)
             for r in range(P)]
    a, b = spans[buf.rank]
    local = value._local_tensor.detach().reshape(-1)
    data, scales = _local_quantized(local, a, b, e.shape, fmt)
    mesh, placements = buf.spec_mesh(e), buf.placements(e)
    weight = RaggedDTensor(data.view(torch.float8_e4m3fn),
                           make_spec(mesh, placements, e.shape, torch.float8_e4m3fn),
                           requires_grad=False)
    _, R, C = fmt.matrix(e.shape)
    B, Rt, Ct = fmt.tiles(e.shape)
    sshape = (Ct,) if len(e.shape) == 1 else (*tuple(e.shape)[:-2], Rt, Ct)
    counts = [_scale_rows(x, max(x, y), R, C, fmt.tile[0]) * Ct for x, y in spans]
    assert sum(counts) == math.prod(sshape) and counts[buf.rank] == scales.numel(), (
        e.name, counts, sshape, scales.shape)
    shard_dim = buf.shard_dim
    splace = tuple(RaggedShard.for_counts(sshape, counts) if d == shard_dim else p
                   for d, p in enumerate(placements))
    scale = RaggedDTensor(scales.reshape(-1), make_spec(mesh, splace, sshape, torch.float32),
                          requires_grad=False)
    return weight, scale
