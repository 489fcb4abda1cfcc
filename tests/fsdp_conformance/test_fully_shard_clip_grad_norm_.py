# Owner(s): ["oncall: distributed"]
#
# Ported from pytorch/pytorch, test/distributed/_composable/fsdp/
# test_fully_shard_clip_grad_norm_.py, to CPU/gloo, run against both torch's fully_shard and
# veragged.fully_shard (tests.harness.conformance).
# Source text: the versions of pytorch/pytorch in the search index
# (0f31e61295ea6ab54df9279d4fd1e4c32599e81b, f20bd3a3dca54b9430a1c142351fe36f57fc028a) import
# torch.distributed._tensor.debug, which torch 2.15 no longer has; this port follows the newer
# upstream text, taken from the fork whitephilomel/pytorch at commit
# e870186f5835d65c774e91fa42ec347cec166496 (the fork's added "FUZZ_TESTING_CANDIDATE" comment
# line dropped). All its imports exist in torch 2.15.
# Changes from the original, and only these:
#   - `fully_shard`, `FSDPTest` and `device_type` come from tests.harness.conformance
#     (device_type = torch.device("cpu"); was torch.device(get_devtype()));
#   - world_size 2 (was min(device_count, 2));
#   - @skip_if_lt_x_gpu(2) removed;
#   - run_tests() -> instantiate_conformance_tests(globals());
#   - @torch_only on test_clip_grad_norm_1d (the reason is in the decorator).
# Left out: TestClipGradNormWorldSize4.test_clip_grad_norm_2d (2-D dp x tp mesh, MLPStack with
# sequence parallelism). It fails with torch's own fully_shard on CPU on float32 tolerances only:
# the gradient of 2.out_proj.bias (analytically ~0 ahead of the LayerNorm; 5.7e-6 vs -1.1e-5,
# atol 1e-5) and the total norm (rel. diff 3.8e-6 > 1.3e-6) differ from the DDP reference by
# reduction order. (Its veragged variant would not test veragged anyway: MLPStack.parallelize
# calls torch's fully_shard from common_fsdp.) Upstream xfails it on XPU for numerics too.

import copy
import functools
from typing import Optional, Union

import torch
import torch.nn as nn
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from tests.harness.conformance import (
    FSDPTest,
    device_type,
    fully_shard,
    instantiate_conformance_tests,
    torch_only,
)


device_type = torch.device(device_type)


class _TestClipGradNormBase(FSDPTest):
    def _test_clip_grad_norm(
        self,
        max_norm: Union[float, int],
        norm_type: Union[float, int],
        ref_model: nn.Module,
        ref_optim: torch.optim.Optimizer,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        inp: torch.Tensor,
        dp_mesh: Optional[DeviceMesh] = None,
    ):
        vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
        dp_mesh = dp_mesh or init_device_mesh(device_type.type, (self.world_size,))
        torch.manual_seed(42 + dp_mesh.get_local_rank() + 1)
        for _ in range(10):
            ref_optim.zero_grad()
            ref_model(inp).sum().backward()
            optim.zero_grad()
            model(inp).sum().backward()

            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [
                p.grad.to_local().detach().clone() for p in model.parameters()
            ]
            for ref_grad, param in zip(ref_grads, model.parameters()):
                self.assertEqual(ref_grad, param.grad.full_tensor())

            # Check that at least one gradient has norm greater than the max
            # norm before clipping to ensure the clipping is not vacuous
            self.assertTrue(any(vector_norm_fn(g).item() > max_norm for g in ref_grads))
            self.assertTrue(
                any(vector_norm_fn(g).item() > max_norm for g in local_grads)
            )

            # Check gradient norm clipping via total norm and individual
            # gradient norms post-clipping
            ref_total_norm = torch.nn.utils.clip_grad_norm_(
                ref_model.parameters(), max_norm=max_norm, norm_type=norm_type
            )
            comm_mode = CommDebugMode()
            with comm_mode:
                # foreach is default to turn on so we don't need to specify it.
                total_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(),
                    max_norm=max_norm,
                    norm_type=norm_type,
                )
            self.assertEqual(ref_total_norm, total_norm.full_tensor())
            # Expect one all-reduce per mesh dim for partial -> replicate
            expected_all_reduces = len(total_norm.placements)
            self.assertEqual(
                comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce],
                expected_all_reduces,
            )
            # For zero gradients, clipping has no effect
            for param, grad in zip(ref_model.parameters(), ref_grads):
                self.assertTrue(vector_norm_fn(param.grad).item() <= max_norm)
                if torch.count_nonzero(grad):
                    self.assertFalse(torch.equal(param.grad, grad))
            for param, grad in zip(model.parameters(), local_grads):
                self.assertTrue(
                    vector_norm_fn(param.grad.to_local()).item() <= max_norm
                )
                if torch.count_nonzero(grad):
                    self.assertFalse(torch.equal(param.grad.to_local(), grad))


class TestClipGradNormWorldSize2(_TestClipGradNormBase):
    @property
    def world_size(self) -> int:
        return 2

    @torch_only(
        "computes vector_norm(p.grad.to_local(), inf) on every rank and asserts some local shard "
        "exceeds max_norm: torch.chunk gives every rank part of every parameter; RaggedShard keeps "
        "small parameters whole on one rank, so other ranks' local tensors are empty (torch raises "
        "for the inf norm of an empty tensor). Adapted copy, skipping empty local tensors in "
        "those two checks: test_adapted_clip_grad_norm_.py"
    )
    def test_clip_grad_norm_1d(self):
        for norm_type in (2, 1, float("inf")):
            torch.manual_seed(42)
            model_args = ModelArgs(dropout_p=0.0)
            model = Transformer(model_args)
            ref_model = replicate(copy.deepcopy(model).to(device_type))
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    fully_shard(module)
            fully_shard(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            inp = torch.randint(
                0, model.model_args.vocab_size, (3, 16), device=device_type
            )
            self._test_clip_grad_norm(
                1, norm_type, ref_model, ref_optim, model, optim, inp
            )


instantiate_conformance_tests(globals())
