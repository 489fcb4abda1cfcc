"""Stand-in FSDP code for tests/testing/test_write_counter.py: `FSDPPaths(extra_fsdp_code=...)`
treats this file as FSDP code, so its function names decide the bucket of their writes."""

import torch


def alloc_grads(n: int) -> torch.Tensor:
    """Gradient path: a zeroed flat gradient buffer (as a DBuffer's, before autograd adds)."""
    return torch.zeros(n)


def unshard(shard: torch.Tensor) -> torch.Tensor:
    """Parameter path: a copy of the shard."""
    return shard.clone()


def setup(t: torch.Tensor) -> None:
    """Neither path: FSDP code whose name matches no rule (fsdp_other)."""
    t.fill_(1.0)
