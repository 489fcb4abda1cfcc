"""CPU offload (`CPUOffloadPolicy`): shards and sharded gradients in host memory.

On these CPU meshes host memory is the mesh's device, yet an offloaded DBuffer still takes the
offload path ([Note: DBuffer layout]): the shard is copied into this rank's slot of the
all-gather output and the reduced gradients are copied back, so the numbers are checked against
torch's `fully_shard` with the same policy. The device transfers themselves need a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from tests.harness.pool import get_pool

from tests.fsdp.test_chunked_params import _dim1_for_matrices
from tests.fsdp.test_lifecycle import IMPLS, Net, _data, _grads, _params, _same


def _train(impl, mixed, meta, placement_fn):
    with torch.device("meta" if meta else "cpu"):
        model = Net()
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed else MixedPrecisionPolicy())
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False), mp_policy=mp,
              shard_placement_fn=placement_fn)
    fs = IMPLS[impl]
    for b in [*model.blocks, model.extra]:
        fs(b, **kw)
    fs(model, **kw)
    if meta:
        model.to_empty(device="cpu")
    with torch.no_grad():  # the same values under both implementations, sharded or not
        for i, p in enumerate(model.parameters()):
            p.fill_(0.05 * (i % 7) - 0.1)
    sources = []  # storages the all-gathers read
    if impl == "veragged":
        real = dist.all_gather_into_tensor

        def spy(out, inp, *args, **kwargs):
            sources.append(inp.untyped_storage().data_ptr())
            return real(out, inp, *args, **kwargs)

        dist.all_gather_into_tensor = spy
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    out = []
    try:
        for step in range(3):
            model(_data(step, dist.get_rank()), use_extra=step == 1).sum().backward()
            out.append(_grads(model))
            optim.step()
            optim.zero_grad()
    finally:
        if impl == "veragged":
            dist.all_gather_into_tensor = real
    devices = {p.to_local().device.type for p in model.parameters()}
    shards = {g.buffer.shard.untyped_storage().data_ptr()
              for m in model.modules() if (s := getattr(m, "_veragged_state", None))
              for g in s.groups}
    return out, _params(model), devices, (len(sources), shards & set(sources))


@pytest.mark.parametrize("mixed,meta,dim1", [(False, False, False), (True, True, False),
                                             (False, True, True)])
def test_cpu_offload_matches_torch(mixed, meta, dim1):
    fn = _dim1_for_matrices if dim1 else None
    ref = get_pool(2).run(_train, "torch", mixed, meta, fn)
    res = get_pool(2).run(_train, "veragged", mixed, meta, fn)
    atol = 1e-2 if mixed else 1e-6
    for rank in range(2):
        (g_t, p_t, _, _), (g_v, p_v, devices, (gathers, from_shard)) = ref[rank], res[rank]
        for a, b in zip(g_t, g_v):
            _same(a, b, atol=atol)
        _same(p_t, p_v, atol=atol)
        assert devices == {"cpu"}
        # every all-gather read this rank's slot of its output (the shard copied in), never
        # the host shard itself
        assert gathers > 0 and not from_shard
