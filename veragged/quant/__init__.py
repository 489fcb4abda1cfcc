"""Block-scaled 8-bit weights under fully_shard: FP8 E4M3 tiles (DeepSeek-V3 style) and MXFP8,
quantised where the rank holds the tile and all-gathered in 8 bits with no scale exchange.

[Note: block-scaled weights]
`fully_shard(..., quant_fn=lambda fqn, p: veragged.BlockFP8() or None)` gives parameters a
format (`formats.py`); a group holding any is a `QuantDBuffer` (veragged/dbuffer/quantized.py):
- planning: the planner gets each quantised parameter's granularity from its format
  (`BlockFormat.plan_shape`): whole tile-rows of a matrix (its last two dims), so every rank holds
  whole tiles and computes their amax alone. A matrix whose last tile-row is partial is planned
  as if padded to whole tile-rows; those padding rows are buffer padding (zero, never sent, never
  read as gradients). No rule on row or column counts beyond the tile itself.
- master: the shard (the optimizer's RaggedShard parameters, checkpoints) stays in the
  parameters' dtype, unchanged. Nothing is quantised in place.
- packed slot (`layout.py`, csrc/quant/layout.h): every rank's slot of the all-gather has the
  same Q bytes; in it, for each of the rank's pieces in buffer order, the E4M3 bytes (one per
  element, row-major) then the tile scales (row-major over tile-rows x tile-cols; fp32 or one
  E8M0 byte), each piece 16-byte aligned; a parameter without a format travels raw in the param
  dtype in the same slot. Q is the largest rank's bytes, rounded up to 16: the planner's
  padding between tensors is not sent. Each rank computes every rank's offsets from the plan,
  so scales need no exchange.
- unshard: `quantize_tiles_` (one op per group, csrc/quant/tiles.cpp and cuda/tiles.cu) writes
  this rank's slot from the shard (rounded to the param dtype first) into a persistent Q-byte
  buffer, only when a sharded parameter changed since it last did (a backward re-gather reuses
  the forward's bytes); one all-gather of uint8 moves every slot (never a dtype the backend
  lacks); `dequantize_tiles_` then writes the param-dtype unsharded buffer, and the gathered
  bytes are freed. compute="fp8" tensors also keep their E4M3 data and GEMM-layout scales,
  copied out of the gathered bytes, and are presented as `BlockScaledWeight`s until the
  reshard ([Note: FP8 compute] in linear.py). No amax, scale or any other collective: a tile's scale
  depends on its own elements only, and they are all on one rank.
- exact: the rules are [Note: block-scaled rules] (csrc/quant/rules.h), the same inline code on
  CPU and CUDA; `reference.py` implements them in torch ops, and the gathered bytes equal its
  output for the full weight, whatever the world size or the tile ownership.
- `reshard_after_forward=k` (int) reshards fully (the 8-bit gather is already half of a bf16
  one); CPU offload quantises on the host and copies the slot to the device.
"""

from veragged.quant.formats import BlockFP8, BlockFormat, MXFP8
from veragged.quant.layout import Packing
from veragged.quant import ops  # noqa: F401  (fake kernels)
from veragged.quant.export import deepseek_state_dict
from veragged.quant.tensor import BlockScaledWeight

__all__ = ["BlockFP8", "BlockFormat", "BlockScaledWeight", "MXFP8", "Packing",
           "deepseek_state_dict"]
