# Owner(s): ["oncall: distributed"]
#
# Adapted copies of the tests of torch's
# test/distributed/_composable/fsdp/test_fully_shard_training.py (the version ported in
# test_fully_shard_training.py; BSD-3-Clause, Copyright (c) PyTorch contributors) that the port
# marks torch_only, run against both implementations (<Class>_torch and <Class>_veragged).
# torch's text, except:
#   - test_modules_to_run_forward_empty_for_single_module reads the set through
#     `_conformance_adapters.modules_to_run_forward` (torch's
#     `FSDPState._modules_to_run_forward`, veragged's `FSDPState.modules_to_run`);
#   - test_partial_group_reshard_toggle takes the head's group through
#     `_conformance_adapters.groups_of` (torch: `_get_fsdp_state()._fsdp_param_group`); both
#     group classes have `is_unsharded`;
#   - test_partial_group_forward_then_standalone and
#     test_partial_group_forward_grad_accum_chunked compare the grouped and the ungrouped
#     model's parameters and gradients as full tensors (`full_tensor()` where torch compares
#     `to_local()`): a Shard(0) local shard does not depend on how modules are grouped into
#     fully_shard calls, a RaggedShard one does (one DBuffer plans a group's tensors together).

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import MLP

from _conformance_adapters import groups_of, modules_to_run_forward
from tests.harness.conformance import (
    check_sharded_parity,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
)


device_type = torch.device("cpu")


class ChunkedHeadModel(nn.Module):
    # At module scope so ``compiled_fsdp_test(compile_compute_on_module=...)``
    # can reference the type at decoration time.
    def __init__(self, dim: int, vocab_size: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.body(h)
        h = self.norm(h)
        if skip_head:
            return h
        return self.head(h)


class TestAdaptedRegisteredParams(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_modules_to_run_forward_empty_for_single_module(self):
        # ``_force_complete_incomplete_states`` guards on
        # ``_modules_to_run_forward`` being non-empty. Single-module
        # ``fully_shard(m)`` registers the raw pre/post hooks instead of
        # the group wrapper (see ``FSDPState.init``), so the set must
        # remain empty for its lifetime — otherwise force-complete would
        # spuriously fire on ungrouped states.
        device = torch.device(device_type.type, 0)
        model = MLP(8, device)
        fully_shard(model.in_proj)
        fully_shard(model.out_proj)
        fully_shard(model)
        for submod in (model, model.in_proj, model.out_proj):
            self.assertEqual(modules_to_run_forward(submod), set())
        inp = torch.randn((2, 8), device=device_type.type)
        model(inp).sum().backward()
        for submod in (model, model.in_proj, model.out_proj):
            self.assertEqual(modules_to_run_forward(submod), set())


class TestAdaptedTrainingCompose(FSDPTest):
    conformance_timeout_s = 480  # many subtests on 2 CPU cores

    @property
    def world_size(self) -> int:
        return 2

    @staticmethod
    def _snapshot_grad(grad: torch.Tensor) -> torch.Tensor:
        # Used for per-chunk snapshots where ``param.grad`` accumulates across
        # chunks: each snapshot needs an independent copy.
        if isinstance(grad, DTensor):
            return grad.full_tensor()  # full_tensor() already returns a new tensor
        return grad.clone()

    def test_partial_group_forward_then_standalone(self):
        """Chunked-loss pattern: model forward skips one module in a grouped
        ``fully_shard([norm, head])``, then that module is called standalone
        per-chunk. Validates ``_force_complete_incomplete_states`` +
        ``mp_policy`` casts across resharding / weight-tying / AC axes.
        """
        self.run_subtests(
            {
                "reshard_after_forward": [True, False],
                "weight_tying": [False, True],
                "mp_policy_mode": ["none", "bf16_everywhere", "bf16_inner_only"],
                "ac": [False],
            },
            self._test_partial_group_forward_then_standalone,
        )
        # Targeted coverage for axes dropped above; combined with the main
        # sweep these preserve AC + partial-forward and reshard-to-smaller-
        # mesh + partial-forward interactions without paying the full
        # cartesian product.
        self._test_partial_group_forward_then_standalone(
            reshard_after_forward=True,
            weight_tying=False,
            mp_policy_mode="none",
            ac=True,
        )
        self._test_partial_group_forward_then_standalone(
            reshard_after_forward=1,
            weight_tying=False,
            mp_policy_mode="none",
            ac=False,
        )

    def _test_partial_group_forward_then_standalone(
        self,
        reshard_after_forward: bool | int,
        weight_tying: bool,
        mp_policy_mode: str,
        ac: bool,
    ) -> None:
        dim, vocab_size, n_chunks = 32, 128, 4

        bf16_out = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}
        if mp_policy_mode == "bf16_everywhere":
            inner_mp = root_mp = MixedPrecisionPolicy(**bf16_out)
            expected_h_dtype = torch.bfloat16
        elif mp_policy_mode == "bf16_inner_only":
            # Root has no output_dtype so it cannot mask the inner
            # force-complete cast.
            inner_mp = MixedPrecisionPolicy(**bf16_out)
            root_mp = MixedPrecisionPolicy(param_dtype=torch.float32)
            expected_h_dtype = torch.bfloat16
        else:
            inner_mp = root_mp = MixedPrecisionPolicy()
            expected_h_dtype = torch.float32
        do_parity = mp_policy_mode == "none"
        # Skip grouped-vs-ungrouped parity when weight_tying forces embed +
        # head into one group with no ungrouped equivalent.
        do_grouping_parity = not weight_tying
        fsdp_kwargs: dict = {"reshard_after_forward": reshard_after_forward}

        def _run_chunked(model: nn.Module, h_dtype: torch.dtype):
            """Returns (total_loss, snapshot of head.weight.grad after the
            chunk loop but before h.backward); the snapshot isolates chunk-
            accumulation failures from h.backward propagation."""
            h = model(tokens, skip_head=True)
            self.assertEqual(h.dtype, h_dtype)
            chunks = torch.chunk(h.detach().to(torch.float32), n_chunks, dim=1)
            h_grads: list[torch.Tensor] = []
            total_loss = torch.tensor(0.0, device=h.device)
            per_chunk_head_grads: list[torch.Tensor] = []
            for chunk in chunks:
                chunk = chunk.contiguous().detach().requires_grad_(True)
                out = model.head(chunk)
                self.assertEqual(out.dtype, h_dtype)
                loss = out.sum()
                total_loss += loss.detach()
                loss.backward()
                h_grads.append(chunk.grad.detach())
                per_chunk_head_grads.append(self._snapshot_grad(model.head.weight.grad))
            # Each chunk must contribute a non-zero delta — catches chunks
            # 2+ silently dropped due to unregistered post_backward hooks.
            for i in range(1, len(per_chunk_head_grads)):
                delta = per_chunk_head_grads[i] - per_chunk_head_grads[i - 1]
                self.assertGreater(
                    delta.norm().item(),
                    0.0,
                    f"chunk {i} did not contribute to head.weight.grad",
                )
            h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
            return total_loss, per_chunk_head_grads[-1]

        def _new_model() -> nn.Module:
            torch.manual_seed(42)
            m = ChunkedHeadModel(dim, vocab_size, weight_tying).to(device_type)
            with torch.no_grad():
                for p in m.parameters():
                    dist.broadcast(p, src=0)
            if ac:
                checkpoint(m.body)
            return m

        def _shard(m: nn.Module, grouped: bool) -> torch.optim.Optimizer:
            if grouped and weight_tying:
                fully_shard(m.body, mp_policy=root_mp, **fsdp_kwargs)
                fully_shard(
                    [m.embed, m.norm, m.head], mp_policy=inner_mp, **fsdp_kwargs
                )
            else:
                fully_shard(m.embed, mp_policy=root_mp, **fsdp_kwargs)
                fully_shard(m.body, mp_policy=root_mp, **fsdp_kwargs)
                if grouped:
                    fully_shard([m.norm, m.head], mp_policy=inner_mp, **fsdp_kwargs)
                else:
                    fully_shard(m.norm, mp_policy=inner_mp, **fsdp_kwargs)
                    fully_shard(m.head, mp_policy=inner_mp, **fsdp_kwargs)
            fully_shard(m, mp_policy=root_mp, **fsdp_kwargs)
            return torch.optim.Adam(m.parameters(), lr=1e-2)

        torch.manual_seed(42)
        tokens = torch.randint(0, vocab_size, (2, 16), device=device_type.type)

        # Reference: plain model (no FSDP, no mp_policy).
        ref_model = _new_model()
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        model = _new_model()
        optim = _shard(model, grouped=True)
        if do_grouping_parity:
            ungrouped_model = _new_model()
            ungrouped_optim = _shard(ungrouped_model, grouped=False)

        for iter_idx in range(10):
            fsdp_loss, fsdp_head_grad = _run_chunked(model, expected_h_dtype)

            if do_grouping_parity:
                ug_loss, ug_head_grad = _run_chunked(ungrouped_model, expected_h_dtype)
                ctx = f"grouped-vs-ungrouped iter {iter_idx}"
                self.assertEqual(ug_loss, fsdp_loss, msg=f"Loss {ctx}")
                self.assertEqual(
                    ug_head_grad, fsdp_head_grad, msg=f"head.weight.grad {ctx}"
                )
                for (name, ug_p), (_, fsdp_p) in zip(
                    ungrouped_model.named_parameters(), model.named_parameters()
                ):
                    self.assertEqual(
                        ug_p.grad.full_tensor(),
                        fsdp_p.grad.full_tensor(),
                        msg=f"Grad mismatch for {name} ({ctx})",
                    )

            if do_parity:
                ref_loss, ref_head_grad = _run_chunked(ref_model, torch.float32)
                for p in ref_model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(self.world_size)
                dist.all_reduce(ref_head_grad)
                ref_head_grad.div_(self.world_size)
                ctx = f"iter {iter_idx}"
                self.assertEqual(
                    fsdp_head_grad, ref_head_grad, msg=f"head.weight.grad {ctx}"
                )
                self.assertEqual(ref_loss, fsdp_loss, msg=f"Loss {ctx}")
                check_sharded_parity(self, ref_model, model)
                ref_optim.step()
                ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))

            optim.step()
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            if do_grouping_parity:
                ungrouped_optim.step()
                ungrouped_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                for (name, ug_p), (_, fsdp_p) in zip(
                    ungrouped_model.named_parameters(), model.named_parameters()
                ):
                    self.assertEqual(
                        ug_p.full_tensor(),
                        fsdp_p.full_tensor(),
                        msg=f"Param mismatch grouped-vs-ungrouped for {name} at iter {iter_idx}",
                    )

    def test_partial_group_forward_grad_accum_chunked(self):
        """Chunked-loss + grad accumulation via set_requires_gradient_sync /
        set_is_last_backward: grouped [norm, head] and ungrouped variants
        produce identical accumulated grads."""
        self.run_subtests(
            {"reshard_after_forward": [True, False]},
            self._test_partial_group_forward_grad_accum_chunked,
        )

    def _test_partial_group_forward_grad_accum_chunked(
        self, reshard_after_forward: bool
    ) -> None:
        dim, vocab_size, n_chunks, n_microbatches = 32, 128, 2, 3
        kwargs = {"reshard_after_forward": reshard_after_forward}

        def _setup(grouped: bool) -> nn.Module:
            torch.manual_seed(42)
            m = ChunkedHeadModel(dim, vocab_size, tie=False).to(device_type)
            with torch.no_grad():
                for p in m.parameters():
                    dist.broadcast(p, src=0)
            fully_shard(m.embed, **kwargs)
            fully_shard(m.body, **kwargs)
            if grouped:
                fully_shard([m.norm, m.head], **kwargs)
            else:
                fully_shard(m.norm, **kwargs)
                fully_shard(m.head, **kwargs)
            fully_shard(m, **kwargs)
            return m

        ref_model, model = _setup(grouped=False), _setup(grouped=True)
        tokens_list = [
            torch.randint(0, vocab_size, (2, 16), device=device_type.type)
            for _ in range(n_microbatches)
        ]
        for m in (ref_model, model):
            for i, tokens in enumerate(tokens_list):
                is_last = i == n_microbatches - 1
                m.set_requires_gradient_sync(is_last)
                m.set_is_last_backward(is_last)
                h = m(tokens, skip_head=True)
                h_grads: list[torch.Tensor] = []
                for chunk in torch.chunk(h.detach(), n_chunks, dim=1):
                    chunk = chunk.contiguous().detach().requires_grad_(True)
                    m.head(chunk).sum().backward()
                    h_grads.append(chunk.grad.detach())
                h.backward(torch.cat(h_grads, dim=1))

        for (name, ref_p), (_, fsdp_p) in zip(
            ref_model.named_parameters(), model.named_parameters()
        ):
            self.assertEqual(
                ref_p.grad.full_tensor(),
                fsdp_p.grad.full_tensor(),
                msg=f"grad mismatch for {name} after grad-accum + chunks",
            )

    def test_partial_group_reshard_toggle(self):
        """Reshard-flag toggle pattern used by torchtitan's ``ChunkedCELoss``:
        disable reshard_after_forward/backward for the chunk loop, then
        restore + call ``head.reshard()`` explicitly. Exercises force-complete
        with reshard-off, per-chunk post_backward with reshard-off, and
        explicit group reshard after the loop.
        """
        # initial_reshard=False: real torchtitan chunked-loss path (group
        # stays unsharded through main forward + chunks).
        # initial_reshard=True: force-complete reshards in model post-forward,
        # then the toggle kicks in for the loop.
        self.run_subtests(
            {
                "weight_tying": [False, True],
                "initial_reshard": [False, True],
            },
            self._test_partial_group_reshard_toggle,
        )

    def _test_partial_group_reshard_toggle(
        self, weight_tying: bool, initial_reshard: bool
    ) -> None:
        dim, vocab_size, n_chunks = 32, 128, 4
        torch.manual_seed(42)
        model = ChunkedHeadModel(dim, vocab_size, weight_tying).to(device_type)
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0)
        if weight_tying:
            fully_shard(model.body)
            fully_shard(
                [model.embed, model.norm, model.head],
                reshard_after_forward=initial_reshard,
            )
        else:
            fully_shard(model.embed)
            fully_shard(model.body)
            fully_shard([model.norm, model.head], reshard_after_forward=initial_reshard)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, vocab_size, (2, 16), device=device_type.type)
        (param_group,) = groups_of(model.head)
        self.assertIsNotNone(param_group)

        for iter_idx in range(5):
            h = model(tokens, skip_head=True)
            model.head.set_reshard_after_forward(False)
            model.head.set_reshard_after_backward(False)
            h_grads: list[torch.Tensor] = []
            for chunk in torch.chunk(h.detach(), n_chunks, dim=1):
                chunk = chunk.contiguous().detach().requires_grad_(True)
                model.head(chunk).sum().backward()
                h_grads.append(chunk.grad.detach())
                # If the group resharded mid-loop, the next chunk's
                # pre_forward would re-all-gather — defeats the toggle.
                self.assertTrue(
                    param_group.is_unsharded,
                    f"head group resharded mid-chunk at iter {iter_idx}",
                )
            # Restore + explicit reshard (matches ChunkedCELoss exit).
            model.head.set_reshard_after_forward(True)
            model.head.set_reshard_after_backward(True)
            model.head.reshard()
            self.assertFalse(
                param_group.is_unsharded,
                f"head.reshard() did not reshard at iter {iter_idx}",
            )
            h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
            for name, p in model.named_parameters():
                self.assertIsNotNone(p.grad, f"grad None for {name}")
            optim.step()
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))


instantiate_conformance_tests(globals())
