# Owner(s): ["oncall: distributed"]
#
# Ported from pytorch/pytorch, test/distributed/_composable/fsdp/test_fully_shard_state.py at
# commit 2c50e08aa5ae6e22b41460edfa5f0ccbea8859f4 (BSD-3-Clause, Copyright (c) PyTorch
# contributors). Conformance port: every test runs against torch's and veragged's `fully_shard`
# (classes <Name>_torch and <Name>_veragged). Changes from the original, and nothing else:
#   - `fully_shard` (with `fully_shard.state`, which gives the state of the implementation under
#     test) and the test base class (FSDPTestMultiThread -> FSDPTest: ranks are processes) come
#     from tests.harness.conformance; the world size stays 1;
#   - `HardwareClassification` too (torch's, or the same enum on a torch without it);
#   - `run_tests()` -> `instantiate_conformance_tests(globals())`.

import copy

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.common_fsdp import MLP

from tests.harness.conformance import (
    FSDPTest,
    fully_shard,
    HardwareClassification,
    instantiate_conformance_tests,
)

FSDPTestMultiThread = FSDPTest  # threads in torch, processes of the rank pool here


class TestFullyShardState(FSDPTestMultiThread):
    hw_classification = HardwareClassification.GENERIC

    @property
    def world_size(self) -> int:
        return 1

    def test_fully_shard_state(self):
        """
        Tests the ability to get the state object from a fully sharded module.
        """
        num_mlps = 3
        model = nn.Sequential(*[MLP(8) for _ in range(num_mlps)])
        for mlp in model:
            fully_shard(mlp)
        fully_shard(model)
        root_state = fully_shard.state(model)
        self.assertTrue(root_state is not None)
        all_states = [root_state] + [fully_shard.state(mlp) for mlp in model]
        # Check that each `fully_shard` call constructs a distinct state object
        self.assertEqual(len(set(all_states)), num_mlps + 1)

    def test_fully_shard_reapply(self):
        model = MLP(8)
        fully_shard(model)
        with self.assertRaisesRegex(
            AssertionError,
            "Each distinct composable distributed API can only be applied to a module once.",
        ):
            fully_shard(model)

    def test_fully_shard_cls(self):
        # Check that we only swap class for the module passed to `fully_shard`
        model = MLP(8)
        fully_shard(model)
        self.assertTrue(isinstance(model, MLP))
        self.assertTrue(isinstance(model, FSDPModule))
        self.assertEqual(model.__class__.__name__, "FSDPMLP")
        for module in model.modules():
            if module is model:
                continue
            self.assertFalse(isinstance(module, FSDPModule))

        # Check that slicing into a `Sequential` does not preserve FSDP
        model = nn.Sequential(*[MLP(8) for _ in range(3)])
        fully_shard(model)
        self.assertTrue(isinstance(model, nn.Sequential))
        self.assertTrue(isinstance(model, FSDPModule))
        self.assertEqual(model.__class__.__name__, "FSDPSequential")
        sliced_model = model[:2]
        self.assertTrue(isinstance(sliced_model, nn.Sequential))
        self.assertFalse(isinstance(sliced_model, FSDPModule))

    def test_fully_shard_unsupported_module_cls(self):
        regex = (
            r"fully\_shard does not support containers that do not implement forward"
        )
        model = nn.ModuleList([MLP(8) for _ in range(3)])
        with self.assertRaisesRegex(ValueError, regex):
            fully_shard(model)
        model = nn.ModuleDict({"1": MLP(8), "2": MLP(8)})
        with self.assertRaisesRegex(ValueError, regex):
            fully_shard(model)

    def test_fully_shard_deepcopy(self):
        model = MLP(8)
        fully_shard(model)
        with self.assertRaisesRegex(AssertionError, "FSDP does not support deepcopy"):
            copy.deepcopy(model)


instantiate_conformance_tests(globals())
