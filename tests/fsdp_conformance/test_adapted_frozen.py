# Owner(s): ["oncall: distributed"]
#
# Adapted copy of torch's TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
# (test/distributed/_composable/fsdp/test_fully_shard_frozen.py, the version ported in
# test_fully_shard_frozen.py; BSD-3-Clause, Copyright (c) PyTorch contributors), run against both
# implementations (<Class>_torch and <Class>_veragged).
#
# torch's test asserts that every reduce-scatter's output numel equals this rank's local numel of
# the trainable parameters of one MLP (`p._local_tensor.numel()` of the biases). That equality is
# torch.chunk's layout: every rank holds an even, padded slice of every parameter, so a rank's
# reduce-scatter output is exactly its local slice. A RaggedShard layout splits the group's
# buffer unevenly (here one rank holds in_proj.bias, the other out_proj.bias) and aligns each
# tensor, while the reduce-scatter output is one equal-sized shard per rank, so the port marks it
# torch_only. What it checks, that the reduce-scatter carries the trainable parameters and not
# the frozen ones, is checked here on both implementations: each reduce-scatter's input
# (output numel x world size) must hold at least the trainable numel of an MLP and at most that
# plus the padding a layout may add (per tensor and rank, veragged's 256-byte alignment; torch's
# chunk padding is below it), far below the frozen weights' 8192 elements. Everything else (the
# subtests, the training parity, the count of post-backward calls through the implementation's
# RegisterPostBackwardFunction) is torch's text.

import copy
import functools
import itertools
from typing import Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint, replicate
from torch.testing._internal.common_fsdp import (
    MLP,
    patch_reduce_scatter,
    reduce_scatter_with_assert,
)

from tests.harness.conformance import (
    check_sharded_parity,
    device_type,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
    patch_register_post_backward_hook_backward,
    RegisterPostBackwardFunction,
)


device_type = torch.device(device_type)

_ALIGN_BYTES = 256  # the per-tensor padding bound (veragged.dbuffer.ops.ALIGN_BYTES)


class TestAdaptedFrozen(FSDPTest):
    # Harness limit per test (not torch's): 12 subtests of 10 iterations on 2 CPU cores
    conformance_timeout_s = 300.0

    @property
    def world_size(self) -> int:
        return 2

    def test_train_mixed_requires_grad_per_group(self):
        """
        Tests training parity with DDP when mixing frozen and non-frozen
        parameters in the same FSDP communication group. This checks that
        the reduce-scatters reduce the expected numel and that they are called
        via the custom autograd function backward (i.e. that they are not
        delayed until the end of backward).
        """
        self.run_subtests(
            {
                "reshard_after_forward": [False, True, 2],
                "use_activation_checkpointing": [False, True],
                "freeze_after_init": [False, True],
            },
            self._test_train_mixed_requires_grad_per_group,
        )

    def _test_train_mixed_requires_grad_per_group(
        self,
        reshard_after_forward: Union[bool, int],
        use_activation_checkpointing: bool,
        freeze_after_init: bool,
    ):
        torch.manual_seed(42)
        num_mlps, lin_dim = (3, 32)
        model = nn.Sequential(
            *[MLP(lin_dim, torch.device("cpu")) for _ in range(num_mlps)]
        )
        # Train biases only (e.g. like BitFit)
        if not freeze_after_init:
            for param_name, param in model.named_parameters():
                if "bias" not in param_name:
                    param.requires_grad_(False)
        ref_model = replicate(
            copy.deepcopy(model).to(device_type),
            device_ids=None,
            find_unused_parameters=freeze_after_init,
        )
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_activation_checkpointing:
                checkpoint(mlp)
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        orig_reduce_scatter = dist.reduce_scatter_tensor
        if freeze_after_init:
            for param_name, param in itertools.chain(
                model.named_parameters(), ref_model.named_parameters()
            ):
                if "bias" not in param_name:
                    param.requires_grad_(False)
        for mlp in model:
            assert isinstance(mlp, MLP), (
                "The reduce-scatter numel check assumes the model consists of "
                f"only the same MLP class but got {type(mlp)}"
            )
        # Adapted: bounds of the reduce-scatter input instead of torch.chunk's local numel.
        trainable = [p for n, p in model[0].named_parameters() if "bias" in n]
        trainable_numel = sum(p.numel() for p in trainable)
        align = _ALIGN_BYTES // trainable[0].element_size()
        max_numel = trainable_numel + self.world_size * len(trainable) * align

        def assert_fn(output: torch.Tensor):
            input_numel = output.numel() * self.world_size
            self.assertGreaterEqual(input_numel, trainable_numel)
            self.assertLessEqual(input_numel, max_numel)

        reduce_scatter = functools.partial(
            reduce_scatter_with_assert, self, orig_reduce_scatter, assert_fn
        )
        orig_backward = RegisterPostBackwardFunction.backward
        backward_count = 0

        def backward_with_count(*args, **kwargs):
            nonlocal backward_count
            backward_count += 1
            return orig_backward(*args, **kwargs)

        torch.manual_seed(42 + self.rank + 1)
        device = device_type
        with (
            patch_reduce_scatter(reduce_scatter),
            patch_register_post_backward_hook_backward(backward_with_count),
        ):
            for iter_idx in range(10):
                inp = torch.randn((8, lin_dim), device=device)
                losses: list[torch.Tensor] = []
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                    _optim.step()
                check_sharded_parity(self, ref_model, model)
                self.assertEqual(losses[0], losses[1])
                # Check that the post-backward hooks ran through the autograd
                # backward, not the final callback (except possibly that of the
                # first MLP, which does not have an input that requires grad)
                self.assertTrue(backward_count >= num_mlps - 1)


instantiate_conformance_tests(globals())
