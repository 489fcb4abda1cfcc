# Owner(s): ["oncall: distributed"]
#
# Adapted copy of torch's
# TestFullyShardMixedPrecisionTraining.test_reduce_dtype_after_frozen_first_forward
# (test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py at commit
# 003a6c0a80952ae0ecfe7827b7b0d3c0515e4d25, the version ported in
# test_fully_shard_mixed_precision.py; BSD-3-Clause, Copyright (c) PyTorch contributors), run
# against both implementations (<Class>_torch and <Class>_veragged).
#
# The port leaves that test out: it reads `fully_shard.state(model)._fsdp_param_group` and its
# `_orig_dtype`, a private attribute torch 2.15's FSDPParamGroup no longer has (AttributeError
# with torch's own fully_shard). This copy runs the same steps (everything frozen, a no-grad
# first forward, unfreeze, a forward and backward under bf16 compute / fp32 reduce) and the same
# checks, except that the resolved reduce dtype is read through `_conformance_adapters.
# reduce_dtype` (torch's `_reduce_dtype`, veragged's DBuffer reduce dtype) and the `_orig_dtype`
# check is dropped; the reduce-scatter dtype is seen through torch's patch_reduce_scatter (the
# harness routes veragged's reduce-scatters through it too).

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.testing._internal.common_fsdp import (
    patch_reduce_scatter,
    reduce_scatter_with_assert,
)

from _conformance_adapters import reduce_dtype
from tests.harness.conformance import (
    device_type as _conformance_device_type,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
)


device_type = torch.device(_conformance_device_type)


class TestAdaptedMixedPrecisionTraining(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_reduce_dtype_after_frozen_first_forward(self):
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
                self.non_float = nn.Parameter(
                    torch.ones(16, dtype=torch.int64), requires_grad=False
                )

            def forward(self, inp: torch.Tensor) -> torch.Tensor:
                return self.layers(inp)

        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
        )
        model = Model().to(device_type)
        fully_shard(model, mp_policy=mp_policy)
        model.requires_grad_(False)

        inp = torch.randn((4, 16), device=device_type.type)
        with torch.no_grad():
            model(inp)

        # Adapted: torch reads fully_shard.state(model)._fsdp_param_group and asserts its
        # _orig_dtype (gone in torch 2.15) and _reduce_dtype.
        self.assertEqual(reduce_dtype(model), torch.float32)

        model.layers.requires_grad_(True)
        # torch 2.15 reduce-scatters through reduce_scatter_single, torch 2.11 has none
        orig_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

        def assert_fn(output: torch.Tensor):
            self.assertEqual(output.dtype, torch.float32)

        reduce_scatter = functools.partial(
            reduce_scatter_with_assert, self, orig_reduce_scatter, assert_fn
        )
        with patch_reduce_scatter(reduce_scatter):
            model(inp).sum().backward()
        for param in model.parameters():
            if param.grad is not None:
                self.assertEqual(param.grad.dtype, torch.float32)


instantiate_conformance_tests(globals())
