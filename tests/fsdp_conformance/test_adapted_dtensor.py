# Owner(s): ["oncall: distributed"]
#
# Adapted copies of TestFullyShardDTensor.test_sharded_param_correctness_1d and
# test_fsdp_tp_dtensor_sharded_params of torch's
# test/distributed/_composable/fsdp/test_fully_shard_dtensor.py (the version ported in
# test_fully_shard_dtensor.py; BSD-3-Clause, Copyright (c) PyTorch contributors), run against both
# implementations (<Class>_torch and <Class>_veragged). torch's text, except that "the
# data-parallel placement is a Shard on dim d" (`assertIsInstance(p, Shard)`, `p.dim == d`) is
# `_conformance_adapters.shard_dim(p) == d`, which also accepts veragged's RaggedShard layouts
# of a Shard(0) request (rank boundaries between rows of dim 0, or the tensor whole on one
# rank); the tensor-parallel placements stay torch's assertions.

import torch
import torch.nn as nn
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import (
    distribute_module,
    distribute_tensor,
    DTensor,
    init_device_mesh,
    Replicate,
    Shard,
)
from torch.testing._internal.common_fsdp import MLP

from _conformance_adapters import shard_dim
from tests.harness.conformance import (
    device_type as _conformance_device_type,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
)


device_type = torch.device(_conformance_device_type)


class TestAdaptedDTensor(FSDPTest):
    @property
    def world_size(self):
        return 4

    def test_sharded_param_correctness_1d(self, device="cpu"):
        """Verify sharded param mesh and placements for FSDP on 1D mesh."""
        mesh = init_device_mesh(
            device_type.type, (self.world_size,), mesh_dim_names=("fsdp",)
        )

        model = MLP(16, device=device_type)
        distribute_module(model, mesh)
        fully_shard(
            model,
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(shard="fsdp"),
        )

        for param in model.parameters():
            self.assertIsInstance(param, DTensor)
            self.assertEqual(param.device_mesh, mesh)
            self.assertEqual(len(param.placements), 1)
            self.assertIsNotNone(shard_dim(param.placements[0]))

    def test_fsdp_tp_dtensor_sharded_params(self, device="cpu"):
        """Verify sharded param mesh and placements for FSDP+TP on 2D mesh."""
        dp_size = 2
        tp_size = self.world_size // dp_size
        mesh = init_device_mesh(
            device_type.type,
            (dp_size, tp_size),
            mesh_dim_names=("fsdp", "tp"),
        )

        mlp_dim = 16
        model = MLP(mlp_dim, device=device_type)

        def partition_fn(name, module, device_mesh):
            if not isinstance(module, nn.Linear):
                return
            for param_name, param in list(module.named_parameters(recurse=False)):
                if param_name == "weight":
                    if "in_proj" in name:
                        placements = [Replicate(), Shard(0)]
                    else:
                        placements = [Replicate(), Shard(1)]
                else:
                    placements = [Replicate(), Replicate()]
                dist_param = nn.Parameter(
                    distribute_tensor(param, device_mesh, placements),
                    requires_grad=param.requires_grad,
                )
                module.register_parameter(param_name, dist_param)

        distribute_module(model, mesh, partition_fn)

        def shard_fn(param):
            if any(isinstance(p, Shard) and p.dim == 0 for p in param.placements):
                return Shard(1)
            return Shard(0)

        fully_shard(
            model,
            mesh=mesh,
            shard_placement_fn=shard_fn,
            dp_mesh_dims=DataParallelMeshDims(shard="fsdp"),
        )

        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor)
            self.assertEqual(param.device_mesh, mesh)
            self.assertEqual(len(param.placements), 2)
            if "in_proj.weight" in name:
                # FSDP shards dim 1 (avoiding TP dim 0), TP shards dim 0
                self.assertIsNotNone(shard_dim(param.placements[0]))
                self.assertEqual(shard_dim(param.placements[0]), 1)
                self.assertIsNotNone(shard_dim(param.placements[1]))
                self.assertEqual(shard_dim(param.placements[1]), 0)
            elif "out_proj.weight" in name:
                # FSDP shards dim 0 (default), TP shards dim 1
                self.assertIsNotNone(shard_dim(param.placements[0]))
                self.assertEqual(shard_dim(param.placements[0]), 0)
                self.assertIsNotNone(shard_dim(param.placements[1]))
                self.assertEqual(shard_dim(param.placements[1]), 1)
            elif "bias" in name:
                # FSDP shards dim 0 (default), TP replicates
                self.assertIsNotNone(shard_dim(param.placements[0]))
                self.assertEqual(shard_dim(param.placements[0]), 0)
                self.assertIsInstance(param.placements[1], Replicate)


instantiate_conformance_tests(globals())
