# Owner(s): ["oncall: distributed"]
#
# Adapted copy of torch's TestFullyShardGradientScaler.test_gradient_scaler
# (test/distributed/_composable/fsdp/test_fully_shard_grad_scaler.py at commit
# 20d074ca8593337e4a124d6f64f478b77fdf9a24, the version ported in
# test_fully_shard_grad_scaler.py; BSD-3-Clause, Copyright (c) PyTorch contributors), run against
# both implementations (<Class>_torch and <Class>_veragged). The port's changes, and: torch
# injects the inf at `grad._local_tensor[0, 0]` of the first parameter (its 2-D Shard(0) slice)
# and then compares that parameter's local gradient before and after unscaling; a RaggedShard
# local tensor is flat and may be empty on a rank, so each rank uses the first parameter of which
# it holds elements and its first local element (a rank holding no element of any parameter has
# no local gradient to compare), and the inf goes to rank 1 if it holds an element, else to the
# last rank that does. The checks (found_inf on every rank, the
# unscaled gradient, the skipped step and the backed-off scale with an inf, the step and the
# unchanged scale without) are torch's.

import copy

import torch
import torch.distributed as dist
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
)


class TestAdaptedGradientScaler(FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

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
        # Adapted: the first parameter of which this rank holds elements, and its first local
        # element (torch: parameter 0 and `_local_tensor[0, 0]` of its Shard(0) slice).
        # A rank that holds no element of any parameter (None) has no local gradient to check.
        params = opt.param_groups[0]["params"]
        k = next((i for i, p in enumerate(params) if p.grad.to_local().numel() > 0), None)
        # torch's rank 1 if it holds an element, else the last rank that does.
        holders = [None] * self.world_size
        dist.all_gather_object(holders, k is not None)
        inf_rank = 1 if holders[1] else max(r for r, h in enumerate(holders) if h)
        if has_inf is True and self.rank == inf_rank:
            params[k].grad._local_tensor.view(-1)[0].fill_(float("inf"))
        if k is not None:
            inital_grad = params[k].grad.to_local().clone()

        scaler.unscale_(opt)
        for found_inf in scaler._per_optimizer_states[id(opt)][
            "found_inf_per_device"
        ].values():
            self.assertEqual(found_inf, has_inf)
        self.assertEqual(
            scaler._per_optimizer_states[id(opt)]["stage"].value,
            OptState.UNSCALED.value,
        )
        if k is not None:
            unscaled_grad = params[k].grad.to_local().clone()
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
