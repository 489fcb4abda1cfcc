"""DBuffer: a parameter group in one planned flat buffer, gathered and reduced in place.

[Note: DBuffer layout]
The planner (`veragged.plan`) places the group's tensors in one global buffer of `P * S` elements
(P ranks of the shard mesh dim, S per rank): every tensor contiguous, no block cut by a rank
boundary, S a multiple of `256 / itemsize` so every rank's slot starts 256-byte aligned. Then:
- the *shard* buffer (S elements, the master dtype) is this rank's slot. The sharded parameters
  are RaggedShard DTensors whose local tensors are views into it, so optimizers and DCP see
  ordinary RaggedShard DTensors and write the buffer directly;
- the *unsharded* buffer (P * S elements, the compute dtype) is the all-gather output; the
  unsharded parameters are views into it, made once. `all_gather_into_tensor` writes it from the
  shard buffer (or, with a compute dtype, from the shard cast into this rank's slot by one fused
  kernel), so nothing is copied in before or out after the collective. `reshard()` frees its
  storage and `unshard()` reallocates the same storage object, so the views (and tensors autograd
  saved from them) stay valid;
- the *gradient* buffer (P * S elements, the reduce dtype) is where backward's gradients land,
  one write each ([Note: gradient landing]), and `reduce_scatter_tensor` reads it as is; the
  result is scaled (and cast) into the sharded gradients, views into one S-element buffer, by
  one fused kernel. The gradient side is one object the DBuffer owns, `buffer.grads`
  (`Gradients`, grads.py), given at construction what it reads of the layout here.
What modules and state dicts do to the sharded parameters (`.to()`, swaps, loads) is in
`param_ops.py` (`ParamOps`, a base of `DBuffer`).
A comm object set for a collective (torch's `set_custom_all_gather`, ...) stages that one in its
own buffers instead, with the copies torch makes: [Note: custom comms] (`comms.py`).
With CPU offload (`offload=True`, torch's `CPUOffloadPolicy`) the shard and sharded gradients
live in host memory (pinned on an accelerator mesh) and the unsharded and gradient buffers on the
mesh's device: the shard is copied (and cast) into this rank's slot of the all-gather output and
the reduced gradients are copied back before the scale, so the optimizer steps on host shards.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from veragged.dbuffer import comms, ops
from veragged.dbuffer.entries import Entry as _Entry
from veragged.dbuffer.grads import Gradients
from veragged.dbuffer.inflight import PostForwardChunk, StagedGather
from veragged.dbuffer.param_ops import ParamOps
from veragged.placement.ragged_shard import RaggedShard
from veragged.placement.tensor import RaggedDTensor, make_spec
from veragged.planner import plan
from veragged.runtime.streams import (
    current_stream_runtime,
    free_storage,
    mesh_device,
)

if TYPE_CHECKING:
    from veragged.dbuffer.tp_param import TPParam

__all__ = ["DBuffer"]


def _comm_kind(kind: str) -> str:
    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"DBuffer: a comm is for 'all_gather' or 'reduce_scatter', not {kind!r}")
    return kind


class DBuffer(ParamOps):
    """One parameter group's flat buffers on one mesh; see [Note: DBuffer layout].

    Args:
        tensors: `(name, tensor)` pairs with the full values, the same on every rank.
        mesh: the device mesh; its `shard_dim` shards the group, any other dim replicates it
            (HSDP: gradients are all-reduced over it after the reduce-scatter).
        shard_dim: the mesh dim that shards the group (default: the last); None: no dim does,
            every rank holds the whole group (`ReplicatedDBuffer`, [Note: replicated DBuffers]).
        block_sizes: per tensor, the elements a rank boundary must not cut (None: 1 each).
        param_dtype: dtype of the unsharded parameters (the all-gather); default: the tensors'.
        reduce_dtype: dtype of the reduce-scatter (gradients are cast to it first if it differs
            from `param_dtype`); default: param dtype.
        offload: keep the shard and the sharded gradients in host memory (pinned if
            `pin_memory` and the mesh is not a CPU mesh), as torch's `CPUOffloadPolicy`: the
            shard is copied to the mesh's device into its slot of the all-gather output, and
            the reduced gradients are copied back. See [Note: DBuffer layout].
        tp: per tensor, None or (for a tensor/expert-parallel DTensor, whose local block the
            buffer holds) its `TPParam`; see [Note: FSDP over TP].
        reduce_in_own_dtype: without `reduce_dtype`, reduce in the tensors' own dtype (the
            shard's, following casts; torch 2.15's FSDP2) instead of `param_dtype`.
    """

    # Collectives through comm objects, and the reduce-scatter's own process group (None: the
    # default path, the shard group): [Note: custom comms]. Set by `set_comm` and
    # `set_reduce_scatter_group`.
    all_gather_comm = None
    reduce_scatter_comm = None
    reduce_scatter_group: dist.ProcessGroup | None = None

    # The gradient buffer is the reduce-scatter input (rank-major, slots of Sg_r + F elements);
    # a subclass landing gradients in another layout sets False and overrides `rank_major`.
    GRADS_RANK_MAJOR = True

    @property
    def trace_fqn(self) -> str:
        """The suffix of its profiler ranges: the fqn of the module(s) whose fully_shard group
        it is ([Note: trace ranges]), set at the root's lazy init; empty for the root or on its
        own."""
        return self.grads.trace_fqn

    @trace_fqn.setter
    def trace_fqn(self, fqn: str) -> None:
        self.grads.trace_fqn = fqn

    def __init__(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        mesh: DeviceMesh,
        *,
        shard_dim: int | None = -1,
        block_sizes: Sequence[int] | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload: bool = False,
        pin_memory: bool = False,
        tp: Sequence["TPParam | None"] | None = None,
        reduce_in_own_dtype: bool = False,
    ):
        if not tensors:
            raise ValueError("DBuffer needs at least one tensor")
        dtypes = {t.dtype for _, t in tensors}
        if len(dtypes) != 1:
            raise ValueError(
                f"DBuffer tensors must share one dtype, got {sorted(map(str, dtypes))}"
            )
        # (id(entry), dtype) -> the spec of its sharded views (`sharded_view`); the entries
        # live as long as the buffer
        self._view_specs: dict = {}
        # What another buffer of the same kind needs for a subset of these tensors (`config`).
        self._config = dict(shard_dim=shard_dim, block_sizes=block_sizes,
                            param_dtype=param_dtype, reduce_dtype=reduce_dtype, offload=offload,
                            pin_memory=pin_memory, tp=tp,
                            reduce_in_own_dtype=reduce_in_own_dtype)
        self.mesh = mesh
        if shard_dim is None:  # the whole group on every rank: [Note: replicated DBuffers]
            self.shard_dim, self.group, self.world, self.rank = None, None, 1, 0
        else:
            self.shard_dim = shard_dim % mesh.ndim
            self.group = mesh.get_group(self.shard_dim)
            self.world = mesh.size(self.shard_dim)
            self.rank = mesh.get_coordinate()[self.shard_dim]
        self._policy = (param_dtype, reduce_dtype, reduce_in_own_dtype)
        self.offload = offload
        self._tp = list(tp) if tp is not None else [None] * len(tensors)
        if len(self._tp) != len(tensors):
            raise ValueError(f"DBuffer: {len(tensors)} tensors but {len(self._tp)} tp entries")
        # The shard and the sharded gradients in pinned host memory: [Note: offloaded gradients]
        self.pin_memory = offload and pin_memory and mesh.device_type != "cpu"
        dtype = dtypes.pop()
        # Tensors on the meta device make a meta DBuffer: `apply_` (`to_empty`) materialises it.
        meta = any(t.is_meta for _, t in tensors)
        device = torch.device("meta") if meta else self.home_device
        compute = param_dtype or dtype
        itemsize = min(d.itemsize for d in (dtype, compute, reduce_dtype or compute))
        S = self.shard_size = self._place(tensors, block_sizes, align=ops.ALIGN_BYTES // itemsize)
        # Gradient room for every tensor until told otherwise: [Note: compacted gradients].
        replica_dims = self.replica_dims()
        self.params: list[torch.nn.Parameter] = []  # the sharded parameters (`_make_buffers`)
        self.grads = Gradients(
            self, entries=self.entries, params=self.params, world=self.world, rank=self.rank,
            group=self.group, shard_size=S,
            replica_groups=[mesh.get_group(d) for d in replica_dims],
            replicas=math.prod(mesh.size(d) for d in replica_dims), itemsize=itemsize,
            rank_major=self.GRADS_RANK_MAJOR, sharded_view=self.sharded_view,
            to_rank_major=self.rank_major, offload=offload, pin_memory=self.pin_memory,
            rt=self.rt)
        shard = ops.aligned_empty(S, dtype, device, pin_memory=self.pin_memory and not meta)
        if not meta:
            shard.zero_()
            with torch.no_grad():
                for e, (_, t) in zip(self.entries, tensors):
                    b, n = e.local[0], e.local[1] - e.local[0]
                    if n:  # a TP parameter: its local block ([Note: FSDP over TP])
                        t = t._local_tensor if isinstance(t, DTensor) else t
                        shard[b : b + n].copy_(self._local_part(e, t.detach()))
        self.params.extend(self._make_buffers(shard))
        self._gather_handle = None  # the all-gather in flight (runtime Handle)
        self._gathered_params: tuple[int, ...] | None = None  # sharded versions at the gather
        self._gather_stage: StagedGather | None = None  # through a comm, until the wait

    def _place(self, tensors, block_sizes, align: int) -> int:
        """Plan where each tensor lives: sets `self.entries` (and `self.layout`), returns S."""
        numels = [t.numel() if info is None else math.prod(info.plan_shape)
                  for (_, t), info in zip(tensors, self._tp)]
        blocks = list(block_sizes) if block_sizes is not None else [1] * len(tensors)
        self.layout = plan(numels, blocks, self.world, align=align)
        S = self.layout.shard_size
        lo, hi = self.rank * S, (self.rank + 1) * S
        self.entries: list[_Entry] = []
        for (name, t), (start, end), info in zip(tensors, self.layout.ranges, self._tp):
            counts = [max(0, min(end, (r + 1) * S) - max(start, r * S)) for r in range(self.world)]
            if info is None:
                stop, placement = end, RaggedShard.for_counts(t.shape, counts)
            else:  # the TP block, maybe smaller than planned: [Note: FSDP over TP]
                stop = start + math.prod(info.local_shape)
                placement = RaggedShard.for_counts(info.plan_shape, counts)
            b, e = min(max(start, lo), hi), min(max(stop, lo), hi)  # this rank's part, maybe empty
            self.entries.append(self._entry(name, t, start, end, stop, (b - lo, e - lo),
                                            placement, info))
        return S

    def _entry(self, name, t, start, end, stop, local, placement, info) -> _Entry:
        """The record of tensor `t` at [start, end) (a TP one on the combined mesh)."""
        if info is None:
            return _Entry(name, t.shape, start, end, stop, local, placement, tuple(t.shape))
        return _Entry(name, info.shape, start, end, stop, local, placement,
                      tuple(info.local_shape), tp=info,
                      placements=info.placements(self._dp_placements(placement)))

    def _local_part(self, e: _Entry, t: torch.Tensor) -> torch.Tensor:
        """This rank's elements of tensor `t` (entry `e`), flat, in shard order."""
        b, n = e.local[0], e.local[1] - e.local[0]
        first = self.rank * self.shard_size + b - e.start
        return t.reshape(-1)[first : first + n]

    def _make_buffers(self, shard: torch.Tensor) -> list[torch.nn.Parameter]:
        """(Re)make every buffer around `shard` (dtype and device follow it); returns the new
        sharded parameters (views of `shard`)."""
        S = self.shard_size
        self.shard = shard
        self.dtype, self.device = shard.dtype, shard.device
        # Where the collectives and the unsharded tensors live: the shard's device, unless the
        # shard is offloaded to host memory.
        self.compute_device = (mesh_device(self.mesh) if self.offload and not shard.is_meta
                               else shard.device)
        param_dtype, reduce_dtype, own = self._policy
        floating = self.dtype.is_floating_point
        self.param_dtype = param_dtype if (param_dtype and floating) else self.dtype
        unset = self.dtype if own else self.param_dtype
        self.reduce_dtype = reduce_dtype if (reduce_dtype and floating) else unset
        params = [self._sharded_param(e, shard) for e in self.entries]
        self._unsharded = torch.empty(self.world * S, dtype=self.param_dtype,
                                      device=self.compute_device)
        self.unsharded_params = [self._unsharded_param(e) for e in self.entries]
        free_storage(self._unsharded)
        self._holds = False
        # Gradients land in the reduce dtype, as torch's FSDP2 copies them into its reduce-scatter
        # input (and accumulates no-sync micro-batches) in it: [Note: gradient landing].
        # Its slots end with the verdict flags: [Note: unreached parameters].
        self.grads.reset(dtype=self.dtype, device=self.device, compute_device=self.compute_device,
                         reduce_dtype=self.reduce_dtype)
        self._post_forward: PostForwardChunk | None = None  # see `reshard`
        self._gather_keep = None
        return params

    def _unsharded_param(self, e: _Entry) -> torch.Tensor:
        """Tensor `e`'s view of the unsharded buffer (a TP one: a DTensor on the TP mesh)."""
        view = self._unsharded[e.start : e.stop].view(e.view_shape)
        return view if e.tp is None else e.tp.unsharded(view)

    # --- views -------------------------------------------------------------------------------

    def placements(self, e: _Entry) -> tuple[Placement, ...]:
        if e.placements is not None:  # on the TP-combined mesh: [Note: FSDP over TP]
            return e.placements
        return self._dp_placements(e.placement)

    def _dp_placements(self, placement: Placement) -> tuple[Placement, ...]:
        """`placement` on the shard dim, Replicate on the others (HSDP)."""
        return tuple(placement if d == self.shard_dim else Replicate()
                     for d in range(self.mesh.ndim))

    def spec_mesh(self, e: _Entry) -> DeviceMesh:
        """The mesh of tensor `e`'s sharded DTensor (the TP-combined one for a TP tensor)."""
        return self.mesh if e.tp is None else e.tp.mesh

    def sharded_view(self, e: _Entry, buf: torch.Tensor,
                     local: tuple[int, int] | None = None) -> DTensor:
        """Tensor `e`'s sharded DTensor over `buf` (the shard, or the shard gradient with this
        rank's elements at `local`: [Note: compacted gradients])."""
        a, b = e.local if local is None else local
        key = (id(e), buf.dtype)  # made once per tensor and dtype: every backward binds grads
        spec = self._view_specs.get(key)
        if spec is None:
            spec = make_spec(self.spec_mesh(e), self.placements(e), e.shape, buf.dtype)
            self._view_specs[key] = spec
        return RaggedDTensor(buf[a:b], spec, requires_grad=False)

    def _sharded_param(self, e: _Entry, buf: torch.Tensor) -> torch.nn.Parameter:
        dt = self.sharded_view(e, buf)
        trainable = buf.dtype.is_floating_point or buf.dtype.is_complex
        # Without the ragged accumulation hooks of `requires_grad_` (the buffer writes the
        # gradients; autograd never accumulates into them): no weak reference to the parameter,
        # so `apply_` can swap it in place.
        with torch._C.DisableTorchFunctionSubclass():
            return torch.nn.Parameter(dt, requires_grad=trainable)

    # Whether the buffer makes its unsharded parameters at the first all-gather (instead of
    # views made once with the buffer): [Note: all-gather extensions] (extension.py).
    MAKES_UNSHARDED = False

    # The streams every collective, access and release goes through ([Note: streams and
    # events]): the caller's stream unless fully_shard gives its own (`Streams`).
    rt = current_stream_runtime()
    _unsharded_stream = None  # where the unsharded buffer's memory was allocated

    def key(self, name: str) -> tuple[int, str]:
        """The name of one of this buffer's tensors for the runtime's accesses."""
        return (id(self), name)

    def set_runtime(self, rt) -> None:
        """Run collectives, accesses and releases through `rt` (`fully_shard`'s lazy init gives
        every buffer of a tree its root's `Streams`)."""
        self.rt = self.grads.rt = rt

    def comm(self, kind: str):
        """The comm object collective `kind` ("all_gather" or "reduce_scatter") goes through,
        or None (the default path): [Note: custom comms]."""
        all_gather = _comm_kind(kind) == "all_gather"
        return self.all_gather_comm if all_gather else self.reduce_scatter_comm

    def set_comm(self, kind: str, comm) -> None:
        """Run collective `kind` through `comm` (None: the default path)."""
        if _comm_kind(kind) == "all_gather":
            self.all_gather_comm = comm
        else:
            self.reduce_scatter_comm = self.grads.rs_comm = comm

    def set_reduce_scatter_group(self, group: dist.ProcessGroup | None) -> None:
        """Reduce-scatter on `group` (the shard ranks; None: the shard group itself)."""
        self.reduce_scatter_group = self.grads.rs_group = group

    def replica_dims(self) -> list[int]:
        """The mesh dims (of more than one rank) that replicate the group: HSDP all-reduces the
        gradients over them after the reduce-scatter."""
        return [d for d in range(self.mesh.ndim) if d != self.shard_dim and self.mesh.size(d) > 1]

    # --- parameters --------------------------------------------------------------------------

    @property
    def home_device(self) -> torch.device:
        """Where the shard belongs: host memory when offloaded, else the mesh's device."""
        return torch.device("cpu") if self.offload else mesh_device(self.mesh)

    @property
    def is_meta(self) -> bool:
        """Built under `torch.device("meta")` and not materialised yet (`to_empty`, a load)."""
        return self.device.type == "meta"

    # `set_keep_unsharded_storage(True)`: reshard keeps the unsharded buffer's memory (its data
    # pointers stay the same across iterations, for CUDA graphs); its values still count as gone.
    keep_storage = False

    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded buffer holds (or is being all-gathered) the parameters."""
        return self._holds

    def set_keep_storage(self, keep: bool) -> None:
        self.keep_storage = bool(keep)
        if not keep and not self.is_unsharded:
            self._release_storage()

    def _release_storage(self) -> None:
        """Free the memory the unsharded parameters live in (once no stream still uses it)."""
        self.rt.reclaim_key(self.key("unsharded"))
        free_storage(self._unsharded)

    def unshard(self, async_op: bool = False):
        """All-gather the shards into the unsharded buffer (allocated if freed).

        On the all-gather stream ([Note: streams and events]); returns the runtime's handle
        of the collective (None once waited for); `wait_unshard()` waits.
        """
        self.wait_unshard()  # a stale gather still in flight (`gather_is_current`) ends first
        rt = self.rt
        ag = rt.stream("all_gather")  # [Note: streams and events]
        rt.alloc(self.key("unsharded"), self._unsharded, ag)
        self._unsharded_stream = ag
        self._holds = True
        with rt.use(ag):
            self._launch_gather()
        if not async_op:
            self.wait_unshard()
        return self._gather_handle

    def _launch_gather(self) -> None:
        """The all-gather's copy-in and launch, on the all-gather stream (current here)."""
        rt = self.rt
        S = self.shard_size
        # Refilling the buffer is not a change autograd must see: tensors saved from the
        # unsharded views in forward are read in backward after this all-gather restored them.
        # The version is restored after the wait, as a backend may write the output (and bump
        # its version) on its own thread any time before the wait returns (gloo copies out).
        self._gather_version = self._unsharded._version
        self._gathered_params = versions = self._params_version()
        post_forward, self._post_forward = self._post_forward, None
        out = self._gather_output()
        # Through the comm, staged in its buffer: [Note: custom comms]
        comm = self.all_gather_comm if self.world > 1 else None
        comm = comm if comms.stages(comm, out.device) else None
        dest = out if comm is None else comms.allocate(comm, out.numel(), out.dtype, out.device)
        group = self.group
        if post_forward is not None and post_forward.versions == versions:
            # reshard_after_forward=k: gather within k ranks
            source, group = post_forward.chunk, post_forward.group
            self._gather_keep = source  # alive until the wait
        elif self.param_dtype == self.dtype and not self.offload:
            source = self.shard
        else:  # cast (or copy to the device) into this rank's own slot, then gather in place
            source = dest[self.rank * S : (self.rank + 1) * S]
            if self.offload:
                source.copy_(self.shard, non_blocking=self.pin_memory)
            else:
                ops.cast_scale_(source, self.shard, 1.0)
        reads = (self.key("kept"),) if source is self._gather_keep else (self.key("shard"),)
        written = self._gathered_key(out)
        if self.world == 1:  # nothing to gather: the shard is the whole buffer
            if source is self.shard:
                ops.cast_scale_(out, self.shard, 1.0)
            rt.accesses("copy", reads=reads, writes=(written,))
            self._gather_handle = rt.handle(None)  # `wait_unshard` finishes it
        else:
            # As bytes by default, as torch's FSDP2 does: every parameter dtype (float8, uint16,
            # ...) moves, whatever dtypes the backend reduces (gloo refuses several).
            work = comms.all_gather(comm, dest, source, group)
            rt.accesses("all_gather", reads=reads,
                      writes=(self.key("staged") if comm is not None else written,))
            self._gather_handle = rt.handle(work)
            self._gather_stage = None if comm is None else StagedGather(dest, out)

    @property
    def gathering(self) -> bool:
        """Whether an all-gather was launched that `wait_unshard()` has not finished."""
        return self._gather_handle is not None

    def gather_is_current(self) -> bool:
        """Whether the unsharded buffer holds the sharded parameters' current values (no
        in-place write to them since its all-gather started)."""
        return self.is_unsharded and self._gathered_params == self._params_version()

    def wait_unshard(self) -> None:
        """Order the current stream after the all-gather (the host waits for it on the CPU)
        and copy a comm's staging buffer out."""
        handle, self._gather_handle = self._gather_handle, None
        stage, self._gather_stage = self._gather_stage, None
        if handle is None:
            return
        self.rt.wait_for(handle)
        self._gather_keep = None
        if stage is not None:  # the comm's staging buffer: [Note: custom comms]
            self.rt.accesses("copy", reads=(self.key("staged"),),
                           writes=(self._gathered_key(stage.output),))
            with torch.no_grad():
                stage.output.copy_(stage.staged)
            self.rt.release(self.key("staged"), stage.staged, self._unsharded_stream, "drop")
        self._finish_gather()

    # The rank-major layout (rank r's slot at [r * S, (r + 1) * S)) is what the collectives move;
    # here it is also the unsharded layout. `ChunkedDBuffer` overrides these three to keep its
    # unsharded tensors in their full layout instead.

    def _gather_output(self) -> torch.Tensor:
        """Where the all-gather writes (rank-major, the param dtype)."""
        return self._unsharded

    def _gathered_key(self, out: torch.Tensor) -> tuple[int, str]:
        """The runtime's name of the all-gather output `out`: the unsharded buffer, or the
        rank-major copy a subclass gathers into (`_gather_output`)."""
        return self.key("unsharded" if out is self._unsharded else "gathered")

    def _finish_gather(self) -> None:
        """After the all-gather: the unsharded views hold the values (version restored)."""
        torch._C._autograd._unsafe_set_version_counter(
            (self._unsharded,), (self._gather_version,)
        )

    def rank_major(self, full: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """`full` (a P * S buffer in the unsharded layout) in the rank-major layout, rank r's
        elements at `[r * slot, r * slot + S)` (`slot` defaults to S; only a subclass whose
        gradient buffer is not rank-major, `GRADS_RANK_MAJOR` False, is asked for a larger one,
        by `Gradients.reduce`)."""
        return full

    # [Note: shard epochs]
    # Whether a gathered (or quantised, or kept post-forward) copy still holds the sharded
    # parameters' values is decided by `_params_version`: the local tensors' version counters
    # and the buffer's epoch. Version counters alone are not enough: torch's fused optimizers
    # (`AdamW(fused=True)`, torchtitan's default) write the parameters without bumping them.
    # So fully_shard starts a new epoch for every buffer of the tree at each forward of the
    # root module (`FSDPState._wait_post_optim`, where the optimizer's writes are ordered
    # before the all-gathers; a submodule run on its own, as torchtitan's chunked loss runs
    # lm_head between forward and backward, does not) and for a module's own buffers at its
    # public `unshard()` outside forward: a copy made before the last optimizer step is never
    # taken as current, while a backward re-gather or a second use within one iteration still
    # reuses what that iteration made.
    _epoch = 0

    def new_epoch(self) -> None:
        """The sharded parameters may have changed unseen: [Note: shard epochs]."""
        self._epoch += 1

    def _params_version(self) -> tuple[int, ...]:
        """The epoch and the version counters of the sharded parameters' local tensors: an
        in-place write to any of them (optimizer step, load, init) or a new epoch changes the
        tuple ([Note: shard epochs])."""
        return (self._epoch, *(p._local_tensor._version for p in self.params))

    def reshard(self, post_forward_group: dist.ProcessGroup | None = None) -> None:
        """Free the unsharded buffer's storage (its views stay, without memory, until unshard).

        With `post_forward_group` (k consecutive ranks of the shard dim: `reshard_after_forward=k`)
        this rank first keeps its 1/k of the unsharded buffer, so that the next `unshard()`
        gathers within that smaller group, unless the shard changed in between.
        """
        self.wait_unshard()
        self._post_forward = None
        if post_forward_group is not None and self.is_unsharded:
            k = post_forward_group.size()
            j = dist.get_group_rank(post_forward_group, dist.get_rank())
            chunk = self._unsharded.numel() // k  # k divides the world, so P * S
            keep = self.rank_major(self._unsharded)[j * chunk : (j + 1) * chunk].clone()
            self.rt.accesses("copy", reads=(self.key("unsharded"),), writes=(self.key("kept"),))
            self._post_forward = PostForwardChunk(keep, post_forward_group,
                                                  self._params_version())
        if self._holds:  # its memory returns once no stream still reads it
            self.rt.release(self.key("unsharded"), self._unsharded, self._unsharded_stream,
                            "keep" if self.keep_storage else "free")
        self._holds = False
