"""ExtensionDBuffer: parameters all-gathered through their own `fsdp_pre_all_gather` /
`fsdp_post_all_gather` (torch's FSDP2 all-gather extensions: torchao's float8 weights, ...).

[Note: all-gather extensions]
A parameter whose sharded local tensor defines `fsdp_pre_all_gather` and `fsdp_post_all_gather`
(a tensor subclass, or hooks set on the local tensor object) decides itself what travels in the
all-gather and what the unsharded parameter is; torch's FSDP2 contract, followed here:
- layout: the hooks are written against torch's `Shard(0)`: rank r holds rows
  `[r * c, (r + 1) * c)` of the parameter (c = ceil(rows / P), the last ranks fewer or none),
  as a tensor of that shape: torch's chunk of the original, so a subclass stays a subclass.
  The sharded parameter is a torch DTensor with `Shard(0)` on the shard dim (`Replicate` on the
  others with HSDP). These parameters are not in a flat DBuffer (their local tensors are not
  plain data): `fully_shard` gives them an `ExtensionDBuffer` of their own per mesh and dtype;
- unshard: `fsdp_pre_all_gather(mesh)` or `(mesh, outer_size, outer_stride, module,
  mp_policy)` (the 1-D shard mesh, also with HSDP; an uneven parameter's inputs must have the
  padded chunk's size) returns `(inputs, metadata)`; every input is all-gathered over the shard
  dim (one all-gather for the whole buffer, the inputs packed as bytes, rank-major), into
  outputs of `P * numel` elements made at the first all-gather and regrown in place after;
  `fsdp_post_all_gather(outputs viewed (-1, *input.shape[1:]), metadata, param dtype)` then
  returns `(tensor, inner_tensors)` and the unsharded parameter is
  `nn.Parameter(as_strided(tensor, shape))`, made once; every later all-gather regrows the inner
  tensors and calls `fsdp_post_all_gather(..., out=that parameter)`, which writes it in place
  (autograd's saved references stay valid). The outputs' version counters are kept across the
  copy out of the collective, as torch's;
- reshard frees the outputs and the inner tensors (storage resized to 0, objects kept);
  `fsdp_should_release_all_gather_outputs_after_post_all_gather()` returning True frees the
  outputs right after the post-all-gather. `reshard_after_forward=k` reshards fully (torch
  refuses extensions there);
- gradients are the DBuffer's: the unsharded gradient lands in the full layout (a chunked
  gradient buffer, as `ChunkedDBuffer`'s, padded per chunk), is reduce-scattered with the
  verdict flags, and the sharded gradient is a `Shard(0)` DTensor of plain memory: no-sync
  accumulation, HSDP, mixed precision and unreached parameters behave as for every DBuffer.
Hooks found on a flat DBuffer parameter's local tensor at the first forward (set after
`fully_shard`, as torch allows until its lazy init) move that parameter here
(`veragged.fsdp.extensions.adopt_extensions`): the parameter object and the local tensor object
carrying the hooks are kept (`swap_tensors`, `Tensor.set_` to its chunk), but until then it is a
RaggedShard parameter, so optimizer state made before the first forward would not fit it.
Found later, they raise naming the parameter (`ParamGroup.unshard`): never ignored.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from veragged.dbuffer.buffer import DBuffer
from veragged.dbuffer.entries import Entry as _Entry
from veragged.dbuffer.ops import aligned_empty
from veragged.placement.tensor import make_spec
from veragged.runtime.streams import alloc_storage, free_storage

__all__ = ["EXTENSION_ATTRS", "ExtensionDBuffer", "has_extension"]

_RELEASE = "fsdp_should_release_all_gather_outputs_after_post_all_gather"
# The attributes of torch's all-gather extension protocol a local tensor may define.
EXTENSION_ATTRS = ("fsdp_pre_all_gather", "fsdp_post_all_gather", _RELEASE)


def has_extension(t: torch.Tensor, name: str) -> bool:
    """Whether `t` (a sharded local tensor) defines torch's all-gather extension hooks; raises
    naming parameter `name` when only one of the pair is there."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"parameter {name!r}: its local tensor defines "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} but not "
            f"{'fsdp_post_all_gather' if pre else 'fsdp_pre_all_gather'}; all-gather "
            "extensions need both"
        )
    if hasattr(t, _RELEASE) and not post:
        raise ValueError(f"parameter {name!r}: {_RELEASE} needs fsdp_pre_all_gather and "
                         "fsdp_post_all_gather")
    return pre


class ExtensionDBuffer(DBuffer):
    """Parameters sharded as torch's `Shard(0)` and all-gathered through their extension hooks.

    Args: as `DBuffer` (no `offload`, no tensor-parallel `tp`), plus `modules` (per tensor,
    the module holding it: the hooks' `module`), `mp_policy` (the hooks' `mp_policy`) and
    `locals_` (per tensor, this rank's chunk to use as the local tensor; default: chunks of the
    given tensors). See [Note: all-gather extensions].

    What differs from a DBuffer, all of it here (the gradient side, `Gradients`, is the same):
    - layout (`_place`, `_chunk`): each tensor a padded `Shard(0)` chunk per rank, not a
      planned range; `GRADS_RANK_MAJOR` False and `rank_major` give the gradient buffer in the
      full layout, the verdict flags added in its rank-major copy;
    - parameters (`_make_buffers`, `_param`, `sharded_view`): the sharded parameters are
      torch `Shard(0)` DTensors over the given local tensors (which carry the hooks), not views
      of one shard buffer; `MAKES_UNSHARDED` True: the unsharded parameters are what
      `fsdp_post_all_gather` returns, made at the first all-gather;
    - unshard (`unshard`, `_inputs`, `wait_unshard`, `_post_all_gather`, `gathering`,
      `is_unsharded`, `shard_mesh`): the hooks' inputs packed as bytes in one all-gather,
      their outputs handed to `fsdp_post_all_gather`;
    - reshard (`reshard`, `_release`, `_release_storage`): frees the outputs and inner tensors;
    - module and state-dict operations (`apply_`, `take_local_`, `holds`,
      `_full_value_local`, `_copy_local`): on the local tensors, which are not views of a
      shard buffer.
    """

    GRADS_RANK_MAJOR = False  # gradients land in the full layout; `rank_major` adds the flags
    MAKES_UNSHARDED = True

    def __init__(self, tensors, mesh, *, modules, mp_policy, locals_=None, **kwargs):
        names = [n for n, _ in tensors]
        if kwargs.get("offload"):
            raise NotImplementedError(
                f"all-gather extensions with CPUOffloadPolicy are not supported: {names}"
            )
        if any(s is not None for s in kwargs.get("tp") or ()):
            raise NotImplementedError(
                f"all-gather extensions on tensor-parallel DTensors are not supported: {names}"
            )
        if kwargs.get("block_sizes") is not None:
            raise ValueError("ExtensionDBuffer: chunks are whole rows; block_sizes does not apply")
        self._modules, self._mp_policy = list(modules), mp_policy
        self._values, self._given = [t for _, t in tensors], locals_
        # The base buffer gets shapes only: the data stays in the local tensors (`_place`).
        shapes = [(n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in tensors]
        super().__init__(shapes, mesh, **kwargs)
        del self._values, self._given

    # --- layout ------------------------------------------------------------------------------

    def _place(self, tensors, block_sizes, align: int) -> int:
        """Torch's `Shard(0)` chunks: each tensor's padded chunk (c rows) at the same offset of
        every rank's slot; this rank's chunk made from the given tensor (or taken as given)."""
        P, r = self.world, self.rank
        self.layout = None
        self.entries, self._padded, self._locals, self._rows = [], [], [], []
        off = 0
        for k, (name, t) in enumerate(tensors):
            rows, row = t.shape[0], math.prod(t.shape[1:])
            c = -(-rows // P)
            mine = max(0, min(rows, (r + 1) * c) - r * c)
            n = c * row
            self.entries.append(_Entry(name, t.shape, P * off, P * (off + n),
                                       P * off + t.numel(), (off, off + mine * row), Shard(0),
                                       tuple(t.shape)))
            self._padded.append((off, off + n))
            self._rows.append(c)
            self._locals.append(self._given[k] if self._given is not None
                                else self._chunk(self._values[k], c, mine))
            off += n
        self._used = off
        return max(align, -(-off // align) * align)

    def _chunk(self, value: torch.Tensor, c: int, mine: int) -> torch.Tensor:
        """This rank's chunk of `value` as torch makes it: a view of a zero-padded copy."""
        t = value.detach()
        if not t.is_meta and t.device != self.home_device:
            t = t.to(self.home_device)
        with torch.no_grad():
            padded = t.new_zeros((c, *t.shape[1:]))
            if mine:
                padded.narrow(0, 0, mine).copy_(t.narrow(0, self.rank * c, mine))
        return padded.narrow(0, 0, mine)

    def _make_buffers(self, shard: torch.Tensor) -> list[nn.Parameter]:
        """The gradient buffers (the base's, around a shard that holds nothing and is freed) and
        the sharded parameters around the local tensors."""
        if shard.is_meta and not any(t.is_meta for t in self._locals):
            shard = aligned_empty(self.shard_size, shard.dtype, self._locals[0].device)
        super()._make_buffers(shard)
        free_storage(shard)
        n = len(self.entries)
        self._outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # made once
        self._inner: list[tuple[torch.Tensor, ...]] = [() for _ in range(n)]
        self._ext_data: list = [None] * n  # (metadata, input sizes): pre- to post-all-gather
        self._made = [False] * n
        self._state = "sharded"  # "gathering", "unsharded"
        self._work = self._send = self._recv = None
        # Placeholders (no memory) until the first all-gather makes each parameter.
        self.unsharded_params = [
            nn.Parameter(torch.empty(e.shape, dtype=self.param_dtype, device="meta"),
                         requires_grad=False)
            for e in self.entries
        ]
        return [self._param(e, t) for e, t in zip(self.entries, self._locals)]

    def _param(self, e: _Entry, local: torch.Tensor) -> nn.Parameter:
        spec = make_spec(self.mesh, self.placements(e), e.shape, local.dtype)
        dt = DTensor(local, spec, requires_grad=False)
        trainable = local.dtype.is_floating_point or local.dtype.is_complex
        with torch._C.DisableTorchFunctionSubclass():  # as DBuffer._sharded_param
            return nn.Parameter(dt, requires_grad=trainable)

    def sharded_view(self, e: _Entry, buf: torch.Tensor, local=None) -> DTensor:
        """Tensor `e`'s sharded gradient over `buf`: this rank's rows, plain memory."""
        a, b = e.local if local is None else local
        row = math.prod(e.shape[1:])
        view = buf[a:b].view((b - a) // row if row else 0, *e.shape[1:])
        spec = make_spec(self.mesh, self.placements(e), e.shape, buf.dtype)
        return DTensor(view, spec, requires_grad=False)

    def rank_major(self, full: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """The full-layout gradients rank-major: rank r's padded chunk of each tensor at its
        offset of slot r (the padding rows were zeroed with the full buffer)."""
        P = self.world
        out = full.new_empty(P * (slot or self.shard_size))
        slots = out.view(P, -1)
        with torch.no_grad():
            slots[:, self._used :].zero_()
            for e, (a, b) in zip(self.entries, self._padded):
                slots[:, a:b].copy_(full[e.start : e.end].view(P, b - a))
        return out

    def shard_mesh(self):
        """The 1-D mesh of the shard dim, which the hooks get (torch's `shard_mesh`)."""
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        if names is None:
            raise ValueError(
                f"all-gather extensions on a {self.mesh.ndim}-D mesh need mesh_dim_names (the "
                f"hooks get the shard dim's mesh): {[e.name for e in self.entries]}"
            )
        return self.mesh[names[self.shard_dim]]

    # --- all-gather --------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._state != "sharded"

    @property
    def gathering(self) -> bool:
        return self._state == "gathering"

    def _inputs(self, i: int) -> list[torch.Tensor]:
        """Parameter i's all-gather inputs (torch's `FSDPParam.all_gather_inputs`, SHARDED)."""
        e, local = self.entries[i], self.params[i]._local_tensor
        padded_size = torch.Size((self._rows[i], *e.shape[1:]))
        if not has_extension(local, e.name):  # hooks removed: torch's default path
            self._ext_data[i] = None
            data = local.new_zeros(padded_size, dtype=self.param_dtype)
            data[: local.shape[0]].copy_(local)
            return [data.view(-1)]
        fn = local.fsdp_pre_all_gather
        sig = inspect.signature(fn)
        if len(sig.parameters) not in (1, 5):
            raise ValueError(
                f"parameter {e.name!r}: invalid fsdp_pre_all_gather{sig}: expects "
                "fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) "
                "(or the old (self, mesh))"
            )
        if len(sig.parameters) == 1:
            inputs, metadata = fn(self.shard_mesh())
        else:
            inputs, metadata = fn(self.shard_mesh(), e.shape, make_contiguous_strides_for(e.shape),
                                  self._modules[i], self._mp_policy)
            if local.size() != padded_size and any(t.size() != padded_size for t in inputs):
                raise ValueError(
                    f"parameter {e.name!r} is unevenly sharded (size {list(e.shape)}, shard "
                    f"world size {self.world}): fsdp_pre_all_gather must return all-gather "
                    f"inputs with the padded sharded size {list(padded_size)}, got "
                    f"{[list(t.size()) for t in inputs]}"
                )
        self._ext_data[i] = (metadata, [t.size() for t in inputs])
        return [t.reshape(-1) for t in inputs]

    def unshard(self, async_op: bool = False):
        """Pre-all-gather every parameter and launch one all-gather of all their inputs."""
        if self._state != "sharded":
            if self.gather_is_current():
                return self._work
            self.reshard()  # the sharded parameters changed since: gather them again
        self._gathered_params = self._params_version()
        rt = self.rt
        ag = rt.stream("all_gather")  # [Note: streams and events]
        with rt.use(ag):  # the pre-all-gather hooks run where their inputs are read, as torch's
            inputs = [self._inputs(i) for i in range(len(self.entries))]
        P = self.world
        for i, ins in enumerate(inputs):
            if not self._outputs[i]:  # torch's init_all_gather_outputs: once, then reused
                self._outputs[i] = [torch.empty(P * t.numel(), dtype=t.dtype,
                                                device=self.compute_device) for t in ins]
            outs = self._outputs[i]
            if [(o.numel(), o.dtype) for o in outs] != [(P * t.numel(), t.dtype) for t in ins]:
                raise ValueError(
                    f"parameter {self.entries[i].name!r}: fsdp_pre_all_gather returned inputs "
                    f"{[(tuple(t.shape), t.dtype) for t in ins]}, unlike the first all-gather's "
                    "(the outputs are made once and reused)"
                )
        with rt.use(ag):  # copy-in and all-gather
            flat = [t.contiguous().view(torch.uint8) for ins in inputs for t in ins]
            send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8,
                                                            device=self.compute_device)
            self._sizes = [t.numel() for t in flat]
            if P == 1:
                self._recv, work = send, None
            else:  # bytes, as DBuffer.unshard: any dtype moves, whatever the backend reduces
                self._recv = torch.empty(P * send.numel(), dtype=torch.uint8, device=send.device)
                work = dist.all_gather_into_tensor(self._recv, send, group=self.group,
                                                   async_op=True)
            rt.accesses("all_gather", reads=(self.key("shard"),), writes=(self.key("recv"),))
            self._work = rt.handle(work)
        self._send = send  # alive until the wait
        self._state = "gathering"
        if not async_op:
            self.wait_unshard()
        return self._work

    def wait_unshard(self) -> None:
        """Finish the all-gather, copy each input's rows out, post-all-gather every parameter."""
        if self._state != "gathering":
            return
        rt = self.rt
        rt.wait_for(self._work)
        recv, send = self._recv, self._send
        self._work = self._send = self._recv = None
        outs = [o for os in self._outputs for o in os]
        for o in outs:  # on the current stream, which reads and frees them
            alloc_storage(o)
        rt.accesses("copy", reads=(self.key("recv"),), writes=(self.key("unsharded"),))
        recv = recv.view(self.world, -1)
        if outs:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
                a = 0
                for o, n in zip(outs, self._sizes):
                    o.view(torch.uint8).view(self.world, n).copy_(recv[:, a : a + n])
                    a += n
        ag = rt.stream("all_gather")  # the copy-in's memory returns to its stream
        rt.release(self.key("recv"), recv, ag, "drop")
        rt.release(self.key("send"), send, ag, "drop")
        self._state = "unsharded"
        for i in range(len(self.entries)):
            self._post_all_gather(i)

    def _post_all_gather(self, i: int) -> None:
        """torch's `FSDPParam.init_unsharded_param`: make the unsharded parameter the first
        time, write it in place (`out=`) after."""
        local, e = self.params[i]._local_tensor, self.entries[i]
        data, self._ext_data[i] = self._ext_data[i], None
        hooked = data is not None and has_extension(local, e.name)
        if hooked:
            metadata, sizes = data
            outs = tuple(t.view(-1, *s[1:]) for t, s in zip(self._outputs[i], sizes))
        if self._made[i]:
            if hooked:
                for t in self._inner[i]:
                    alloc_storage(t)
                local.fsdp_post_all_gather(outs, metadata, self.param_dtype,
                                           out=self.unsharded_params[i])
                self._release(i, local)
            return
        if hooked:
            tensor, self._inner[i] = local.fsdp_post_all_gather(outs, metadata,
                                                                self.param_dtype)
        else:
            tensor = self._outputs[i][0]
        unsharded = torch.as_strided(tensor, e.shape, make_contiguous_strides_for(e.shape),
                                     storage_offset=0)
        self.unsharded_params[i] = nn.Parameter(unsharded,
                                                requires_grad=self.params[i].requires_grad)
        self._made[i] = True
        if hooked:
            self._release(i, local)

    def _release(self, i: int, local: torch.Tensor) -> None:
        fn = getattr(local, _RELEASE, None)
        release = fn() if fn is not None else False
        if not isinstance(release, bool):
            raise ValueError(f"parameter {self.entries[i].name!r}: {_RELEASE} must return a "
                             f"bool, got {type(release).__name__}")
        if release:
            for o in self._outputs[i]:
                free_storage(o)

    def reshard(self, post_forward_group=None) -> None:
        """Free the all-gather outputs and inner tensors (their objects stay for the next
        all-gather); a post-forward group is not used: [Note: all-gather extensions]."""
        self.wait_unshard()
        self._state = "sharded"
        if not self.keep_storage:
            self._release_storage()

    def _release_storage(self) -> None:
        for outs, inner in zip(self._outputs, self._inner):
            for t in (*outs, *inner):
                free_storage(t)

    # --- parameters --------------------------------------------------------------------------

    def apply_(self, fn) -> bool:
        """`Module._apply`: `fn` sees each local tensor (a subclass stays one); the parameters
        take the results in place, their gradients move with them (`DBuffer._remake`)."""
        self.grads.finish_reduce()
        self.reshard()
        old = [p._local_tensor for p in self.params]
        with torch.no_grad():
            new = [fn(t) for t in old]
        if all(a is b for a, b in zip(new, old)):
            return False
        kinds = {(t.dtype, t.device) for t in new}
        if len(kinds) != 1:
            raise ValueError(f"ExtensionDBuffer.apply_: fn gave the local tensors of "
                             f"{[e.name for e in self.entries]} several dtypes/devices {kinds}")
        dtype, device = kinds.pop()
        self._locals = new
        self._remake(aligned_empty(self.shard_size, dtype, device))
        return True

    def take_local_(self, i: int, tensor: torch.Tensor) -> None:
        """Make `tensor` (an object the caller holds, e.g. with hooks set on it) parameter i's
        local tensor, holding the current values (`Tensor.set_`: the object is kept)."""
        p = self.params[i]
        with torch.no_grad():
            tensor.set_(p._local_tensor)
        p._local_tensor = tensor
        self._locals[i] = tensor

    def holds(self, i: int) -> bool:
        p = self.params[i]
        return p.dtype == self.dtype and p.device == self.device

    # `load_` (DBuffer's) takes this rank's padded row chunk of a full value, and copies into
    # the local tensor in its own shape (a subclass keeps its layout).

    def _full_value_local(self, i: int, value: torch.Tensor) -> torch.Tensor:
        start = min(self.rank * self._rows[i], self.entries[i].shape[0])
        return value.narrow(0, start, self.params[i]._local_tensor.shape[0])

    def _copy_local(self, i: int, src: torch.Tensor) -> None:
        self.params[i]._local_tensor.copy_(src)
