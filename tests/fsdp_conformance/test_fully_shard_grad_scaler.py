# Owner(s): ["oncall: distributed"]
#
# Ported from pytorch/pytorch, test/distributed/_composable/fsdp/test_fully_shard_grad_scaler.py
# at commit 20d074ca8593337e4a124d6f64f478b77fdf9a24 (BSD-3-Clause, Copyright (c) PyTorch
# contributors). Conformance port: every test runs against torch's and veragged's `fully_shard`
# (classes <Name>_torch and <Name>_veragged). Changes from the original, and nothing else:
#   - `fully_shard` and `FSDPTest` come from tests.harness.conformance; the device is CPU
#     (`device_type`; was `torch.accelerator.current_accelerator().type`), the backend gloo;
#   - world size 4 (torch's FSDPTest default on its 4-GPU runners; the 2-D subtest needs it);
#   - `@skip_if_lt_x_gpu(4)` removed;
#   - `GradScaler(init_scale=2.0, enabled=True)` -> `GradScaler(device_type, init_scale=2.0,
#     enabled=True)`: GradScaler's device defaults to "cuda" and disables itself without CUDA;
#   - the rank that injects the inf is the one whose gradient is on device index 1
#     (`grad._local_tensor.device.index == 1`); on CPU every rank's device has no index, and
#     under torch's one-GPU-per-rank launch that is rank 1: `self.rank == 1`;
#   - `run_tests()` -> `instantiate_conformance_tests(globals())`;
#   - `@torch_only(...)` on test_gradient_scaler (adapted copy: test_adapted_grad_scaler.py).

import copy

import torch
import torch.nn as nn
from torch.amp.grad_scaler import GradScaler, OptState
from torch.distributed._tensor import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    parallelize_module,
    RowwiseParallel,
)
from torch.testing._internal.common_fsdp import MLP

from tests.harness.conformance import (
    device_type,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
    torch_only,
)


class TestFullyShardGradientScaler(FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    @torch_only(
        "injects the inf at grad._local_tensor[0, 0] of the first parameter (its 2-D Shard(0) "
        "slice; a RaggedShard local tensor is flat, and may be empty on rank 1). Adapted copy, "
        "using each rank's first local element: test_adapted_grad_scaler.py"
    )
    def test_gradient_scaler(self):
        self.run_subtests(
            {"has_inf": [True, False], "test_2d": [True, False]},
            self._test_gradient_scaler,
        )

    def _test_gradient_scaler(self, has_inf: bool, test_2d: bool):
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Linear(4, 4, device=device_type, bias=False) for _ in range(2)]
        )
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        input = torch.randn([4, 4], device=device_type)

        if test_2d:
            mesh_2d = init_device_mesh(
                device_type, (2, self.world_size // 2), mesh_dim_names=("dp", "tp")
            )
            dp_mesh, tp_mesh = mesh_2d["dp"], mesh_2d["tp"]
            model = nn.Sequential(MLP(2), MLP(2), MLP(2))
            tp_parallelize_plan = {
                "0.in_proj": ColwiseParallel(),
                "0.out_proj": RowwiseParallel(),
                "1.in_proj": ColwiseParallel(),
                "1.out_proj": RowwiseParallel(),
                "2.in_proj": ColwiseParallel(),
                "2.out_proj": RowwiseParallel(),
            }
            model = parallelize_module(
                model,
                device_mesh=tp_mesh,
                parallelize_plan=tp_parallelize_plan,
            )
            for module in model:
                fully_shard(module, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
            input = torch.randn((2,), device=device_type)

        loss = model(input).sum()
        scaler = GradScaler(device_type, init_scale=2.0, enabled=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler.scale(loss).backward()
        inv_scale = scaler._scale.double().reciprocal().float()
        if has_inf is True and self.rank == 1:
            opt.param_groups[0]["params"][0].grad._local_tensor[0, 0].fill_(
                float("inf")
            )
        inital_grad = opt.param_groups[0]["params"][0].grad.to_local().clone()

        scaler.unscale_(opt)
        for found_inf in scaler._per_optimizer_states[id(opt)][
            "found_inf_per_device"
        ].values():
            self.assertEqual(found_inf, has_inf)
        self.assertEqual(
            scaler._per_optimizer_states[id(opt)]["stage"].value,
            OptState.UNSCALED.value,
        )
        unscaled_grad = opt.param_groups[0]["params"][0].grad.to_local().clone()
        self.assertEqual(unscaled_grad, inital_grad * inv_scale)
        initial_scale = scaler.get_scale()
        initial_state = copy.copy(opt.state)

        scaler.step(opt)
        steped_state = copy.copy(opt.state)
        if has_inf:
            # assert parameters are the same before/after
            self.assertEqual(steped_state, initial_state)
        else:
            # new parameters here if no inf found during .unscale_()
            self.assertNotEqual(steped_state.items(), initial_state.items())

        scaler.update()
        updated_scale = scaler.get_scale()
        if has_inf:
            # assert scale is updated
            backoff_factor = scaler.get_backoff_factor()
            self.assertEqual(updated_scale, initial_scale * backoff_factor)
        else:
            # scale is not updated
            self.assertEqual(updated_scale, initial_scale)


instantiate_conformance_tests(globals())
