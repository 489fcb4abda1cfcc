"""Count the bytes every op writes during a training step, and who wrote them.

[Note: what WriteCounter counts]
`WriteCounter` is a `TorchDispatchMode`: every op that reaches the dispatcher while it is active
(on this thread, and in backward on the autograd engine's threads, see below) is counted from
its schema, with the bytes (`numel * element_size`) of the tensors it writes:
- a functional op's outputs, unless the schema marks the output as an alias (views: `view`,
  `split`, `detach`, ...) or the output shares storage with an input (ops whose schema does not
  say they return a view, e.g. `aten._unsafe_view`): 0 bytes;
- every argument the schema marks as written (`Tensor(a!)`, `Tensor(a!)[]`: in-place ops, `out=`
  variants, `_foreach_*_`, and custom ops such as `veragged::cast_scale_`, `accumulate_`,
  `land_`, `zero_ranges_` and FSDP2's `fsdp::chunk_cat_mixed_dtype`, `split_with_sizes_copy`),
  each at its full size: ops that write only part of their destination (`index_put_`,
  `scatter_`, ...) are counted as writing all of it, except the two below;
- `veragged::zero_ranges_(dst, ranges)`: the elements of its ranges only;
- `fsdp::all_gather_copy_in`: its copy-in, `all_gather_input_numel` elements (its schema marks
  no argument written and returns views of the all-gather output it fills).
Not counted, on purpose:
- collectives: ops of the `c10d`, `_c10d_functional`, `_c10d_functional_autograd` and
  `c10d_functional` namespaces (their calls are tallied in `collectives`), and one `aten.copy_`
  into exactly a collective's output tensor after it: gloo's reduce-scatter is an all-reduce
  whose result `Work.wait()` copies into the output through the dispatcher, on the waiting
  thread (seen with gloo in torch 2.15; its all-gather and all-reduce dispatch nothing); that
  copy is the collective's work (tallied in `collective_copies`, bytes, not in `bytes`). The
  collective's own size is tallied in `collective_bytes` (op -> bytes): per call, the larger of
  its first two arguments (c10d's output and input: the gathered or to-be-scattered buffer for
  an all-gather or a reduce-scatter, the tensor for an all-reduce);
- allocations (`empty`, `empty_strided`, `new_empty`, `empty_like`, `veragged::aligned_empty`,
  ...) and metadata-only mutations (`set_`, `resize_`, `as_strided_`, `squeeze_`, `t_`,
  `record_stream`, ...);
- tensors on the meta device and fake tensors (DTensor's sharding propagation runs ops on fake
  tensors first): they hold no memory;
- ops on tensor subclasses with their own `__torch_dispatch__` (DTensor, RaggedDTensor): the
  mode declines them (`NotImplemented`), so the subclass runs and the ops it issues on its local
  tensors are counted instead: bytes are this rank's, not the global tensor's.
Bytes are what the ops write, not what they read. They are counted per op, in the process that
runs the mode: a GPU run counts the ops the same Python code issues there.

Backward: the autograd engine runs each node, `AccumulateGrad` included (its in-place `add_`
into an existing `.grad`), under the thread-local state captured when `backward()` was called,
and that state holds the dispatch-mode stack (`at::ThreadLocalState::torch_dispatch_mode_state_`
in ATen/ThreadLocalState.h; torch/csrc/autograd/engine.cpp wraps every node it evaluates, and
the final callbacks, in `at::ThreadLocalStateGuard(graph_task->thread_locals_)`). So a counter
active around `loss.backward()` sees backward's writes on CPU (the calling thread runs the CPU
queue: tests/testing/test_write_counter.py checks it) and on CUDA's per-device autograd threads
(not run here: no GPU). `phase()` tags are shared by all threads.

Attribution (`FSDPPaths`, the default): each write goes to one bucket:
- `param` (parameter path): writes FSDP makes to produce unsharded parameters: the copy-in
  before the all-gather, the copy-out after it, mixed-precision casts of the shard, the 1/k
  copy kept by `reshard_after_forward=k`;
- `grad` (gradient path): writes FSDP makes to turn autograd's gradients into sharded
  gradients: zeroing, landing/accumulating unsharded gradients, casts, the reduce-scatter
  input's copy-in (`chunk_cat`) and scaling, the -0.0 marks, the scale/cast/accumulation into
  the sharded gradients; plus every write *during backward* (an autograd node is running) by
  code outside FSDP into storage that FSDP's gradient path allocated or wrote earlier in the
  window: autograd's `AccumulateGrad` adding into `.grad` views of an FSDP gradient buffer;
- `fsdp_other`: writes in FSDP code matching neither (input/output casts of
  `MixedPrecisionPolicy`, lazy init, state-dict loads);
- `rest`: everything else: the model's forward and backward kernels, the loss, clipping, the
  optimizer (the same work with or without FSDP).
"FSDP code" is torch's `torch/distributed/fsdp/_fully_shard/` and veragged's `veragged/fsdp/`
and `veragged/dbuffer/`. The Python stack at the op decides: walking outwards from the op,
frames in torch itself (outside `_fully_shard`), the Python standard library, `veragged/placement`
(DTensor op implementations) and this file are skipped; the first other frame decides. If it is
not FSDP code the write is `rest` (unless the backward rule above applies). If it is, its
qualified function name decides: any of `grad`, `reduce`, `backward`, `accumulat`, `stash` ->
`grad`; else any of `unshard`, `gather`, `reshard`, `copy_in`, `copy_out` -> `param`; else the
walk goes on outwards through FSDP frames (helpers such as `ops.cast_scale_`, `_alloc`), and
FSDP code with no matching frame is `fsdp_other`. On an autograd device thread the stack holds
the Python hook that the engine called, so FSDP's hooks are attributed the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
from collections import Counter
from typing import Callable, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["CopyCounter", "FSDPPaths", "LaunchCounter", "WriteCounter"]

COLLECTIVE_NAMESPACES = frozenset(
    {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
)
ALLOCATIONS = frozenset(  # (`aligned_empty`: veragged's, [Note: aligned buffers])
    "empty empty_strided new_empty new_empty_strided empty_like empty_permuted "
    "aligned_empty".split()
)
METADATA_ONLY = frozenset(
    "set_ resize_ resize_as_ as_strided_ squeeze_ unsqueeze_ transpose_ t_ swapdims_ "
    "swapaxes_ detach_ record_stream _coalesced_ _resize_output_".split()
)

# Attribution: one bucket per write.
PARAM, GRAD, FSDP_OTHER, REST = "param", "grad", "fsdp_other", "rest"
BUCKETS = (PARAM, GRAD, FSDP_OTHER, REST)

Attribute = Callable[[torch._ops.OpOverload, list], tuple]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _real(t) -> bool:
    """A tensor holding memory: not meta, not fake."""
    return (
        isinstance(t, torch.Tensor)
        and not isinstance(t, FakeTensor)
        and t.device.type != "meta"
    )


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor):
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


class WriteCounter(TorchDispatchMode):
    """Bytes written by every op while active; see [Note: what WriteCounter counts].

    Args:
        attribute: `attribute(func, written) -> (bucket, site)` for each op that writes or
            allocates (`written`: its written or allocated tensors; `site`: a short string
            saying where, or None). Default `"fsdp"`: a fresh `FSDPPaths()`. None: all `rest`.
            An active `phase(name)` overrides it.

    Results: `bytes` (total), `buckets` (bucket -> bytes), `ops` ((bucket, op, site) -> bytes),
    `collectives` (op -> calls), `collective_bytes` (op -> bytes of the larger of each call's
    output and input), `collective_copies` (bytes of backend copies into collective outputs,
    not in `bytes`).
    """

    def __init__(self, attribute: Optional[Attribute] | str = "fsdp"):
        super().__init__()
        self.attribute = FSDPPaths() if attribute == "fsdp" else attribute
        self.bytes = 0
        self.buckets: Counter = Counter()
        self.ops: Counter = Counter()
        self.collectives: Counter = Counter()
        self.collective_bytes: Counter = Counter()
        self.collective_copies = 0
        self._phase: Optional[str] = None
        self._pending: dict = {}  # collective outputs a backend may still copy into
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Writes made inside (on any thread) go to bucket `name`."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def bucket(self, name: str) -> int:
        return self.buckets.get(name, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in _tensors((args, kwargs))):
            return NotImplemented  # the subclass runs; its ops on local tensors are counted
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        return out

    # --- counting ----------------------------------------------------------------------------

    def _count(self, func, args, kwargs, out) -> None:
        schema = func._schema
        namespace, name = schema.name.split("::")
        if namespace in COLLECTIVE_NAMESPACES:
            self._note_collective(func, args, kwargs)
            return
        if name in METADATA_ONLY:
            return
        if name in ALLOCATIONS:
            allocated = [t for t in _tensors(out) if _real(t)]
            if allocated and self.attribute is not None and self._phase is None:
                self.attribute(func, allocated)  # lets it follow storage it owns; 0 bytes
            return
        if func is torch.ops.aten.copy_.default and self._pending:
            dst = args[0]
            if _real(dst) and self._pending.pop(_key(dst), None) is not None:
                with self._lock:
                    self.collective_copies += _nbytes(dst)
                return
        written, nbytes = self._written(func, schema, args, kwargs, out)
        if not written:
            return
        if self._phase is not None:
            bucket, site = self._phase, None
        elif self.attribute is not None:
            bucket, site = self.attribute(func, written)
        else:
            bucket, site = REST, None
        with self._lock:
            self.bytes += nbytes
            self.buckets[bucket] += nbytes
            self.ops[(bucket, str(func), site)] += nbytes

    def _written(self, func, schema, args, kwargs, out) -> tuple[list, int]:
        """The tensors `func` wrote and how many bytes."""
        name = schema.name
        if name == "veragged::zero_ranges_":
            dst, ranges = args[0], args[1]
            n = sum(ranges[i + 1] - ranges[i] for i in range(0, len(ranges), 2))
            return ([dst], n * dst.element_size()) if _real(dst) else ([], 0)
        if name == "fsdp::all_gather_copy_in":
            agout, numel = args[1], int(args[3])
            return ([agout], numel * agout.element_size()) if _real(agout) else ([], 0)
        written: list[torch.Tensor] = []
        inputs: list[torch.Tensor] = []
        for i, a in enumerate(schema.arguments):
            if i < len(args):
                value = args[i]
            elif a.name in kwargs:
                value = kwargs[a.name]
            else:
                continue
            ts = _tensors(value)
            if a.alias_info is not None and a.alias_info.is_write:
                written.extend(ts)
            else:
                inputs.extend(ts)
        if schema.returns:
            values = (out,) if len(schema.returns) == 1 else tuple(out)
            storages = {t.untyped_storage()._cdata for t in inputs + written if _real(t)}
            for r, value in zip(schema.returns, values):
                if r.alias_info is not None:
                    continue  # a view, or the mutated argument returned again
                written.extend(
                    t for t in _tensors(value)
                    if _real(t) and t.untyped_storage()._cdata not in storages
                )
        written = [t for t in written if _real(t)]
        return written, sum(_nbytes(t) for t in written)

    def _note_collective(self, func, args, kwargs) -> None:
        sizes = [sum(_nbytes(t) for t in _tensors(a) if _real(t)) for a in args[:2]]
        with self._lock:
            self.collectives[str(func)] += 1
            self.collective_bytes[str(func)] += max(sizes, default=0)
        first = args[0] if args else None
        for t in _tensors(first):  # by convention a c10d op's first argument is its output
            if _real(t):
                self._pending[_key(t)] = StorageWeakRef(t.untyped_storage())

    def summary(self) -> str:
        """One line per (bucket, op, site), largest first, and the bucket totals."""
        lines = [f"{b:10} {n:>14,d}  {op}  {site or ''}"
                 for (b, op, site), n in sorted(self.ops.items(), key=lambda kv: -kv[1])]
        lines.append("  ".join(f"{b}={n:,d}" for b, n in sorted(self.buckets.items())))
        return "\n".join(lines)


class LaunchCounter(TorchDispatchMode):
    """Counts the ops that would launch a kernel on a device, per (phase, where): every
    dispatched op except views, metadata changes and bare allocations, below the tensor-subclass
    layer (a DTensor's local ops); `where` is "fsdp" when FSDP's own code issued it (`FSDPPaths`:
    its parameter or gradient path, or other FSDP code), else "rest"; collectives are counted
    apart as "colls". Set `phase` to label what follows."""

    def __init__(self):
        super().__init__()
        self.paths = FSDPPaths()
        self.phase = ""
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in _tensors((args, kwargs))):
            return NotImplemented  # counted on the local tensors
        out = func(*args, **kwargs)
        namespace, name = func._schema.name.split("::")
        if namespace in COLLECTIVE_NAMESPACES:
            self.counts[(self.phase, "colls")] += 1
            return out
        returns = func._schema.returns
        view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                     for r in returns)
        if view or name in METADATA_ONLY or name in ALLOCATIONS:
            return out
        bucket, _ = self.paths(func, [t for t in _tensors(out) if _real(t)])
        self.counts[(self.phase, "rest" if bucket == REST else "fsdp")] += 1
        return out


class FSDPPaths:
    """The default attribution of `WriteCounter`: FSDP's parameter path, gradient path, other
    FSDP work, or the rest; see [Note: what WriteCounter counts] for exactly what each holds.

    Returns `(bucket, site)`: `site` is the qualified name of the deciding FSDP frame,
    `"autograd <node>"` for the backward rule, None for `rest`.

    Args:
        extra_fsdp_code: more files or directories to treat as FSDP code (for tests).
    """

    GRAD_WORDS = ("grad", "reduce", "backward", "accumulat", "stash")
    PARAM_WORDS = ("unshard", "gather", "reshard", "copy_in", "copy_out")

    def __init__(self, extra_fsdp_code: tuple[str, ...] = ()):
        self._grad_storages: dict[int, StorageWeakRef] = {}  # keeps cdata unique while held
        self._frames: dict = {}  # code object -> "skip" | "user" | (bucket or None, qualname)
        torch_dir = os.path.dirname(torch.__file__)
        veragged_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._torch = torch_dir + os.sep
        self._fsdp = (
            os.path.join(torch_dir, "distributed", "fsdp", "_fully_shard") + os.sep,
            os.path.join(veragged_dir, "fsdp") + os.sep,
            os.path.join(veragged_dir, "dbuffer") + os.sep,
            *(os.path.abspath(p) + ("" if p.endswith(".py") else os.sep) for p in extra_fsdp_code),
        )
        self._skip = (os.path.join(veragged_dir, "placement") + os.sep,)
        self._this = os.path.abspath(__file__)
        paths = sysconfig.get_paths()
        self._stdlib = paths["stdlib"] + os.sep
        self._site = tuple({paths["purelib"] + os.sep, paths["platlib"] + os.sep})

    def _classify(self, code):
        kind = self._frames.get(code)
        if kind is not None:
            return kind
        path = os.path.abspath(code.co_filename)
        qualname = getattr(code, "co_qualname", code.co_name)
        if path.startswith(self._fsdp):
            low = qualname.lower()
            if any(w in low for w in self.GRAD_WORDS):
                kind = (GRAD, qualname)
            elif any(w in low for w in self.PARAM_WORDS):
                kind = (PARAM, qualname)
            else:
                kind = (None, qualname)
        elif (
            path == self._this
            or path.startswith(self._skip)
            or path.startswith(self._torch)
            or (path.startswith(self._stdlib) and not path.startswith(self._site))
            or path.startswith("<")  # <frozen ...>, <string>
        ):
            kind = "skip"
        else:
            kind = "user"
        self._frames[code] = kind
        return kind

    def _from_stack(self) -> tuple[str, Optional[str]]:
        frame = sys._getframe(1)
        in_fsdp = None
        while frame is not None:
            kind = self._classify(frame.f_code)
            if kind == "user":
                break
            if kind != "skip":
                bucket, qualname = kind
                if bucket is not None:
                    return bucket, qualname
                in_fsdp = in_fsdp or qualname
            frame = frame.f_back
        if in_fsdp is not None:
            return FSDP_OTHER, in_fsdp
        return REST, None

    def __call__(self, func, written: list[torch.Tensor]) -> tuple[str, Optional[str]]:
        bucket, site = self._from_stack()
        if bucket == GRAD:
            for t in written:
                s = t.untyped_storage()
                self._grad_storages.setdefault(s._cdata, StorageWeakRef(s))
        elif bucket == REST and self._grad_storages:
            node = torch._C._current_autograd_node()
            if node is not None and any(
                t.untyped_storage()._cdata in self._grad_storages for t in written
            ):
                return GRAD, f"autograd {node.name()}"
        return bucket, site


# --- legacy --------------------------------------------------------------------------------

# aten ops that copy data, and the ops FSDP2 registers for its copy-in / copy-out.
COPY_OPS = frozenset(
    "copy_ _foreach_copy_ _to_copy cat clone split_with_sizes_copy chunk_cat "
    "all_gather_copy_in".split()
)


class CopyCounter(TorchDispatchMode):
    """Legacy: bytes written by copy-like ops outside collectives (`copied`) and by dtype casts
    (`cast`). It misses zeroing, `accumulate_`, autograd's `add_` and every other write: use
    `WriteCounter` to measure what a step writes. Kept for the tests that check the all-gather
    copies nothing (tests/dbuffer, tests/fsdp).

    Gloo emulates reduce-scatter with an all-reduce plus a copy of this rank's chunk into the
    output: a copy into a buffer that a collective received is the collective's own work and is
    not counted. veragged's `cast_scale_` counts as a cast when it changes the dtype (a mixed-
    precision cast) and as nothing when it only scales.
    """

    def __init__(self):
        super().__init__()
        self.copied = 0
        self.cast = 0
        self._collective_buffers: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        namespace, name = func._schema.name.split("::")
        if namespace == "c10d":
            for a in args:
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(t, torch.Tensor):
                        self._collective_buffers.add(t.untyped_storage().data_ptr())
        elif name in COPY_OPS:
            dst = args[0] if name == "copy_" else None
            if dst is None or dst.untyped_storage().data_ptr() not in self._collective_buffers:
                outs = out if isinstance(out, (list, tuple)) else [out]
                if name == "_foreach_copy_":
                    outs = args[0]
                self.copied += sum(
                    t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor)
                )
        elif name == "cast_scale_" and args[0].dtype != args[1].dtype:
            self.cast += args[0].numel() * args[0].element_size()
        return out
