# Owner(s): ["oncall: distributed"]
#
# Adapted copies of the tests of torch's test/distributed/_composable/fsdp/test_fully_shard_comm.py
# (the version ported in test_fully_shard_comm.py; BSD-3-Clause, Copyright (c) PyTorch
# contributors) that the port marks torch_only because they read or patch FSDP2's private
# classes. Each runs the same steps and the same expected values against both implementations
# (<Class>_torch and <Class>_veragged); where torch's test reads a private attribute or patches
# a private method, this copy goes through _conformance_adapters, which gives torch's private
# value for the torch variant and veragged's value of the same meaning for the veragged one.
#
# TestAdaptedCommunication / TestAdaptedReduceOpWorldSize1: see their docstrings. (The
# prefetch-order tests run as ported on both: tests.harness.conformance's `patch_unshard` etc.
# patch the group class of the implementation under test.)

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
)
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from _conformance_adapters import group_max_input_buffers, max_input_buffers
from tests.harness.conformance import (
    device_type as _conformance_device_type,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
    torch_fails,
)


device_type = torch.device(_conformance_device_type)


# The installed torch's own fully_shard cannot pass these ports from 2.15 (skipped on its
# `_torch` variant below 2.15; the `_veragged` variant runs):
_NO_MAX_INPUT_BUFFERS = (
    "torch 2.11's FSDPModule has no set_reduce_scatter_max_input_buffers"
)

class TestAdaptedCommunication(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    @torch_fails(_NO_MAX_INPUT_BUFFERS, before="2.15")
    def test_reduce_scatter_max_input_buffers_resolves_to_max(self):
        """
        Per-module reduce-scatter input-buffer caps share one pipeline (a single
        ``comm_ctx.reduce_scatter_states`` list), so mixed caps must resolve to
        the max on the shared comm context: a lower-cap module cannot silently
        undo a higher-cap module's retention. The per-group values stay as set.

        (Adapted: the tree's resolved cap and each call's own cap are read through
        `max_input_buffers` / `group_max_input_buffers`: torch's comm context and
        FSDPParamGroup, veragged's StateContext.max_reducing and
        FSDPState.max_reduce_scatter_buffers.)
        """
        torch.manual_seed(42)
        model_args = ModelArgs(dropout_p=0.0)
        model = Transformer(model_args)
        blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
        self.assertGreaterEqual(len(blocks), 2)
        for block in blocks:
            fully_shard(block)
        model = fully_shard(model)
        # Set a non-default cap on a single block only (recurse=False); every
        # other group (including the root) keeps the default of 1.
        expected_max = 3
        blocks[0].set_reduce_scatter_max_input_buffers(expected_max, recurse=False)

        # Resolution runs in lazy init on the first forward.
        inp = torch.randint(0, model_args.vocab_size, (2, 16), device=device_type.type)
        model(inp).sum().backward()

        self.assertEqual(max_input_buffers(model), expected_max)
        # Resolution leaves the per-group input values untouched.
        self.assertEqual(group_max_input_buffers(blocks[0]), expected_max)
        self.assertEqual(group_max_input_buffers(blocks[1]), 1)


@instantiate_parametrized_tests
class TestAdaptedReduceOpWorldSize1(FSDPTest):
    @property
    def world_size(self) -> int:
        return 1

    @parametrize("divide_factor", [None, 1.0, 2.0])
    def test_singleton_copy_division(self, divide_factor):
        """torch's test_singleton_copy_division without what only FSDP2's layout and kernels
        give: the gradient is compared as a full tensor (torch's compares `to_local()` with
        the [4, 8] Shard(0) shard, which in a world of one is the full tensor; a RaggedShard
        local shard is flat), and the count of aten.div.Tensor kernels in FSDP2's gradient
        copy-out is not asserted (veragged scales in its own reduce path)."""
        model = nn.Linear(8, 4, bias=False, device=device_type)
        fully_shard(model, mesh=init_device_mesh(device_type.type, (1,)))
        if divide_factor is not None:
            model.set_gradient_divide_factor(divide_factor)
        inp = torch.ones(3, 8, device=device_type)
        loss = model(inp).sum()
        loss.backward()
        expected = torch.full_like(inp[:1].expand(4, -1), 3 / (divide_factor or 1))
        self.assertEqual(model.weight.grad.full_tensor(), expected)

    def test_size1_reduceop(self):
        """torch's test_size1_reduceop without its last check, which reads the reduce op
        FSDP2 picks for the size-1 group from its private state (the parity loop is
        torch's)."""
        model = nn.Linear(1024, 1025)
        ref_model = copy.deepcopy(model).to(device_type)
        ref_optim = torch.optim.Adam(ref_model.parameters())
        fully_shard(
            model,
            mesh=init_device_mesh(device_type.type, (1,)),
            reshard_after_forward=False,
        )
        optim = torch.optim.Adam(model.parameters())

        inp = torch.randn(1025, 1024, device=device_type.type)
        for _ in range(3):
            ref_optim.zero_grad()
            ref_loss = ref_model(inp).sum()
            ref_loss.backward()
            for param in ref_model.parameters():
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            ref_optim.step()

            optim.zero_grad()
            loss = model(inp).sum()
            loss.backward()
            optim.step()
            self.assertEqual(loss, ref_loss)
            self.assertEqual(
                model.bias.grad.full_tensor(),
                ref_model.bias.grad,
            )


instantiate_conformance_tests(globals())
