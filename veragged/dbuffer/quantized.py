"""QuantDBuffer: a DBuffer whose all-gather moves block-scaled 8-bit weights.

See [Note: block-scaled weights] (veragged/quant/__init__.py): the planner keeps each quantised
tensor's tile-rows whole, every rank quantises its own tiles into a packed uint8 slot, one
all-gather moves the slots, and the unsharded parameters are dequantised from the gathered bytes.
The shard, the sharded parameters, the gradients and everything after the all-gather's output
are the base DBuffer's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from veragged.dbuffer import comms
from veragged.dbuffer.buffer import DBuffer
from veragged.dbuffer.entries import Entry as _Entry
from veragged.placement.ragged_shard import RaggedShard
from veragged.planner import plan
from veragged.quant.formats import QUANTIZABLE_DTYPES, RAW, BlockFormat
from veragged.quant.layout import Packing
from veragged.quant.ops import dequantize_tiles_, quantize_tiles_
from veragged.quant.reference import scale_inv
from veragged.quant.tensor import BlockScaledWeight
from veragged.runtime import trace as tr

__all__ = ["QuantDBuffer", "QuantStats"]

#: Every rank's packed slot is a multiple of this many bytes: each rank's region of the
#: all-gather output starts 16-byte aligned (NCCL's vector width), and at most 15 padding bytes
#: per rank travel ([Note: block-scaled weights]).
SLOT_ALIGN = 16


@dataclass
class QuantStats:
    """What a QuantDBuffer's all-gathers did: `formats` (tensor name -> format, or "raw"),
    `slot_bytes` (Q), `gather_bytes` (P * Q, what one all-gather writes on each rank),
    `elements` (the tensors' elements), `all_gathers` (launched, a world of one counts none),
    `quantizations` (`quantize_tiles_` calls: at most one per change of the shard)."""

    formats: dict[str, str]
    slot_bytes: int = 0
    gather_bytes: int = 0
    elements: int = 0
    all_gathers: int = 0
    quantizations: int = 0
    rank_bytes: list[int] = field(default_factory=list)

    @property
    def bytes_per_element(self) -> float:
        """Gathered bytes per tensor element (padding and scales included)."""
        return self.gather_bytes / self.elements if self.elements else 0.0


class QuantDBuffer(DBuffer):
    """A DBuffer all-gathering its tensors in block-scaled 8 bits.

    Args: as `DBuffer`, plus `formats`: per tensor, a `BlockFormat` or None (that tensor is sent
    raw, in the param dtype, in the same packed slot). `block_sizes` (granularity_fn, rows) must
    divide the format's tile-row block. No tensor-parallel `tp` entries.
    """

    def __init__(self, tensors, mesh, *, formats, **kwargs):
        self._formats = list(formats)
        names = [n for n, _ in tensors]
        if len(self._formats) != len(tensors):
            raise ValueError(f"QuantDBuffer: {len(tensors)} tensors but {len(self._formats)} "
                             "formats")
        quantized = [n for n, f in zip(names, self._formats) if f is not None]
        for (name, t), f in zip(tensors, self._formats):
            if f is not None and not isinstance(f, BlockFormat):
                raise TypeError(f"quant_fn({name!r}) returned {f!r}: expected a veragged "
                                "BlockFP8 or MXFP8, or None")
            if f is not None and t.dtype not in QUANTIZABLE_DTYPES:
                raise ValueError(f"quant_fn({name!r}) = {f}: parameter {name!r} has dtype "
                                 f"{t.dtype}; block-scaled weights need one of "
                                 f"{[str(d) for d in QUANTIZABLE_DTYPES]}")
            if f is not None and f.compute == "fp8" and t.dim() != 2:
                raise ValueError(f"quant_fn({name!r}) = {f}: compute='fp8' needs a 2-D "
                                 f"weight (F.linear's), parameter {name!r} has shape "
                                 f"{list(t.shape)}; use compute='bf16' for it")
        if any(s is not None for s in kwargs.get("tp") or ()):
            raise NotImplementedError(
                f"block-scaled weights on tensor-parallel DTensors are not supported: "
                f"{quantized} (a TP block's tiles are not the full weight's)")
        if not quantized:
            raise ValueError("QuantDBuffer: no tensor has a format (use a DBuffer)")
        self.stats = QuantStats({n: str(f) if f else "raw" for n, f in zip(names, self._formats)})
        super().__init__(tensors, mesh, **kwargs)
        self._config["formats"] = self._formats

    def config(self, indices):
        cfg = super().config(indices)
        cfg["formats"] = [self._formats[i] for i in indices]
        return cfg

    # --- layout ------------------------------------------------------------------------------

    def _place(self, tensors, block_sizes, align: int) -> int:
        """The base plan, with each quantised tensor's tile-row block (and its padded numel when
        its last tile-row is partial: the padding rows follow it, `Entry.stop`)."""
        numels, blocks = [], []
        given = list(block_sizes) if block_sizes is not None else [1] * len(tensors)
        for (name, t), f, g in zip(tensors, self._formats, given):
            if f is None:
                numels.append(t.numel())
                blocks.append(g)
                continue
            planned, block = f.plan_shape(t.shape)
            if block % g:
                raise ValueError(
                    f"{name!r}: its granularity {g} elements does not divide the {f} tile-row "
                    f"block of {block} elements (shape {list(t.shape)}); drop the "
                    "granularity_fn entry for it, the format's block keeps it whole"
                )
            numels.append(planned)
            blocks.append(block)
        self.layout = plan(numels, blocks, self.world, align=align)
        S = self.layout.shard_size
        lo, hi = self.rank * S, (self.rank + 1) * S
        self.entries: list[_Entry] = []
        for (name, t), (start, end) in zip(tensors, self.layout.ranges):
            stop = start + t.numel()
            counts = [max(0, min(stop, (r + 1) * S) - max(start, r * S))
                      for r in range(self.world)]
            b, e = min(max(start, lo), hi), min(max(stop, lo), hi)
            self.entries.append(_Entry(name, t.shape, start, end, stop, (b - lo, e - lo),
                                       RaggedShard.for_counts(t.shape, counts), tuple(t.shape)))
        return S

    def _make_buffers(self, shard: torch.Tensor):
        params = super()._make_buffers(shard)
        if self.param_dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(
                f"block-scaled weights {[e.name for e, f in zip(self.entries, self._formats) if f]}"
                f" need a param dtype in {[str(d) for d in QUANTIZABLE_DTYPES]}, got "
                f"{self.param_dtype}")
        self._quantized_at = None  # the sharded versions the quantised slot was made from
        self._packed = None  # the gathered bytes, from the launch to the dequantisation
        self._gemm: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # [Note: FP8 compute]
        fp8 = [i for i, f in enumerate(self._formats) if f is not None and f.compute == "fp8"]
        owner = weakref.ref(self)
        for i in fp8:  # presented as BlockScaledWeights ([Note: FP8 compute])
            self.unsharded_params[i] = BlockScaledWeight(
                self.unsharded_params[i], self._formats[i], owner, i, self.entries[i].name)
        if shard.is_meta:
            self.packing, self._fp8_pieces = None, {}
            return params
        p = self.packing = Packing(self.entries, self._formats, self.shard_size, self.world,
                                   self.rank, self.param_dtype, SLOT_ALIGN)
        self._qtable = p.quantize.to(shard.device)
        self._dqtable = p.dequantize.to(self.compute_device)
        self._qslot = torch.empty(p.slot_bytes, dtype=torch.uint8, device=shard.device,
                                  pin_memory=self.pin_memory)
        self._qslot.zero_()  # alignment gaps are sent: never uninitialised memory
        s = self.stats
        s.slot_bytes, s.gather_bytes, s.rank_bytes = p.slot_bytes, p.gather_bytes, p.rank_bytes
        s.elements = p.elements
        # Where each compute="fp8" tensor's pieces lie in the gathered bytes, found once:
        # (first row, rows, data offset, scale offset) per rank holding some of it.
        self._fp8_pieces = {
            i: [((off - self.entries[i].start) // cols, rows, d, sc)
                for fmt, off, rows, cols, _, _, d, sc in p.segments
                if fmt != RAW and self.entries[i].start <= off < self.entries[i].stop]
            for i in fp8}
        return params

    # --- FP8 compute operands ([Note: FP8 compute]) --------------------------------------------

    def _unpack(self, packed: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor `i`'s E4M3 data [R, C] and fp32 scales [R/tr, round_up(C/tc, 4)] (the GEMM's
        layout: K blocks padded to 4, zeros) copied out of the gathered bytes, rank by rank."""
        e, f = self.entries[i], self._formats[i]
        R, C = e.shape
        tr, tc = f.tile
        Rt, Ct = -(-R // tr), -(-C // tc)
        sb = f.scale_bytes
        dev = packed.device
        data = torch.empty(R, C, dtype=torch.uint8, device=dev)
        scales = torch.zeros(Rt, -(-Ct // 4) * 4, dtype=torch.float32, device=dev)
        for r0, rows, d, sc in self._fp8_pieces[i]:
            data[r0 : r0 + rows].copy_(packed[d : d + rows * C].view(rows, C))
            t0, n = r0 // tr, -(-rows // tr)
            raw = packed[sc : sc + n * Ct * sb]
            raw = raw.view(torch.float32) if sb == 4 else raw
            scales[t0 : t0 + n, :Ct] = scale_inv(raw.view(n, Ct), f)
        return data.view(torch.float8_e4m3fn), scales

    def gemm_operands(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor `i`'s gathered FP8 operands, while the buffer is unsharded."""
        if i not in self._gemm:
            raise RuntimeError(
                f"{self.entries[i].name!r}: its FP8 operands exist between an unshard and the "
                "next reshard; the weight was used while its group was resharded")
        return self._gemm[i]

    # --- all-gather --------------------------------------------------------------------------

    def _launch_gather(self) -> None:
        """Quantise this rank's tiles (unless the slot is current), then one all-gather of every
        rank's packed slot, as bytes ([Note: block-scaled weights])."""
        rt, p = self.rt, self.packing
        self._gather_version = self._unsharded._version
        self._gathered_params = versions = self._params_version()
        self._post_forward = None
        if self._quantized_at != versions:
            with tr.trace(tr.QUANTIZE, self.trace_fqn):
                quantize_tiles_(self._qslot, self.shard, self._qtable, p.quantize_tiles,
                                self.param_dtype)
            rt.accesses("quantize", reads=(self.key("shard"),), writes=(self.key("quantized"),))
            self._quantized_at = versions
            self.stats.quantizations += 1
        n = p.gather_bytes
        comm = self.all_gather_comm if self.world > 1 else None
        comm = comm if comms.stages(comm, self.compute_device) else None
        if comm is not None:  # its buffer is the output: [Note: custom comms]
            packed = comms.allocate(comm, n, torch.uint8, self.compute_device)
        else:
            packed = torch.empty(n, dtype=torch.uint8, device=self.compute_device)
        source = self._qslot
        if source.device != packed.device:  # offloaded shard: the slot goes to the device
            Q, r = p.slot_bytes, self.rank
            source = packed[r * Q : (r + 1) * Q]
            source.copy_(self._qslot, non_blocking=self.pin_memory)
        self._packed = packed
        if self.world == 1:
            if source is not packed:
                packed.copy_(source)
            rt.accesses("copy", reads=(self.key("quantized"),), writes=(self.key("packed"),))
            self._gather_handle = rt.handle(None)
            return
        work = comms.all_gather(comm, packed, source, self.group)
        rt.accesses("all_gather", reads=(self.key("quantized"),), writes=(self.key("packed"),))
        self._gather_handle = rt.handle(work)
        self.stats.all_gathers += 1

    def _finish_gather(self) -> None:
        """After the all-gather: dequantise every rank's tiles into the unsharded buffer, drop
        the gathered bytes, restore the buffer's version."""
        packed, self._packed = self._packed, None
        if packed is not None:
            self.rt.accesses("dequantize", reads=(self.key("packed"),),
                           writes=(self.key("unsharded"),))
            with torch.no_grad(), tr.trace(tr.DEQUANTIZE, self.trace_fqn):
                dequantize_tiles_(self._unsharded, packed, self._dqtable,
                                  self.packing.dequantize_tiles)
                self._gemm = {i: self._unpack(packed, i) for i in self._fp8_pieces}
            self.rt.release(self.key("packed"), packed, self._unsharded_stream, "drop")
        super()._finish_gather()

    def reshard(self, post_forward_group=None) -> None:
        """Free the unsharded buffer. `reshard_after_forward=k` reshards fully here: the next
        all-gather re-sends the kept 8-bit slot ([Note: block-scaled weights])."""
        super().reshard(None)
        self._gemm = {}
