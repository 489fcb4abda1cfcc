"""Count the bytes that copy-like ops write, to check that a training step adds no copies."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CopyCounter"]

# aten ops that copy data, and the ops FSDP2 registers for its copy-in / copy-out.
COPY_OPS = frozenset(
    "copy_ _foreach_copy_ _to_copy cat clone split_with_sizes_copy chunk_cat "
    "all_gather_copy_in".split()
)


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy-like ops outside collectives (`copied`) and by dtype casts (`cast`).

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
