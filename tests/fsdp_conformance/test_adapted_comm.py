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
# TestAdaptedPrefetch: the six prefetch-order tests of TestFullyShardPrefetch. torch's record
# unshard / reshard / post_backward calls by patching FSDPParamGroup (`patch_unshard` etc. with
# `_get_*_with_record`); here `record_events` patches the group class of the implementation
# under test (torch's FSDPParamGroup, veragged's ParamGroup) with the same recording rules, and
# the training states are compared by name (the local `TrainingState` below). Everything else,
# the expected event lists included, is torch's text.
#
# TestAdaptedCommunication / TestAdaptedReduceOpWorldSize1: see their docstrings.

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.common_fsdp import DoubleLinear
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
)
from torch.testing._internal.distributed._tensor.common_dtensor import (
    FeedForward,
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from _conformance_adapters import (
    group_max_input_buffers,
    max_input_buffers,
    record_events,
)
from tests.harness.conformance import (
    device_type as _conformance_device_type,
    FSDPTest,
    fully_shard,
    instantiate_conformance_tests,
)


device_type = torch.device(_conformance_device_type)


class TrainingState:
    """The member names of torch's and veragged's TrainingState, as `record_events` gives
    them."""

    IDLE = "IDLE"
    FORWARD = "FORWARD"
    PRE_BACKWARD = "PRE_BACKWARD"
    POST_BACKWARD = "POST_BACKWARD"


EventType = tuple[str, str, str]


class TestAdaptedPrefetch(FSDPTest):
    # Harness limit per test (not torch's): many subtests, 2 CPU cores shared with other runs
    conformance_timeout_s = 600.0

    @property
    def world_size(self) -> int:
        return 2

    def test_fully_shard_backward_prefetch(self):
        # Activation checkpointing should not affect the expected FSDP events
        self.run_subtests(
            {
                "reshard_after_forward": [True, False, 2, None],
                "checkpoint_impl": [None, "utils", "composable"],
            },
            self._test_backward_prefetch_forward_backward,
        )
        self.run_subtests(
            {
                "reshard_after_forward": [True, False, 2, None],
                "checkpoint_impl": [None, "utils", "composable"],
            },
            self._test_backward_prefetch_multi_forward,
        )
        self._test_backward_prefetch_unused_in_backward(True)

    def _test_backward_prefetch_forward_backward(
        self,
        reshard_after_forward: bool | int | None,
        checkpoint_impl: str | None,
    ):
        n_layers = 3
        model, optim, inp = self._init_transformer(
            n_layers, reshard_after_forward, checkpoint_impl
        )
        events: list[EventType] = []
        # Check the order for normal 1 forward, 1 backward, 1 optimizer step
        with record_events(model, events, unshard=True, reshard=False, post_backward=True):
            for iter_idx in range(3):
                loss = model(inp)
                expected_events = [
                    ("unshard", "", TrainingState.FORWARD),  # root
                    ("unshard", "layers.0", TrainingState.FORWARD),
                    ("unshard", "layers.1", TrainingState.FORWARD),
                    ("unshard", "layers.2", TrainingState.FORWARD),
                ]
                self.assertEqual(events, expected_events)
                events.clear()
                loss.sum().backward()
                expected_events = []
                # Root does not reshard after forward so there is no
                # unshard event for it in backward
                if reshard_after_forward is not None:
                    expected_events.append(("unshard", "", TrainingState.PRE_BACKWARD))
                expected_events.extend(
                    [
                        ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                        # Explicit backward prefetching moves the unshards early
                        # by one module (note how swapping each unshard down one
                        # event would give the natural event order)
                        ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                        ("post_backward", "layers.2", TrainingState.POST_BACKWARD),
                        ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                        ("post_backward", "layers.1", TrainingState.POST_BACKWARD),
                        ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
                        ("post_backward", "", TrainingState.POST_BACKWARD),
                    ]
                )
                if reshard_after_forward is False:
                    # No reshard after forward means no backward unshards
                    expected_events = [e for e in expected_events if e[0] != "unshard"]
                self.assertEqual(events, expected_events)
                events.clear()
                optim.step()
                optim.zero_grad(set_to_none=(iter_idx % 2 == 0))

    def _test_backward_prefetch_multi_forward(
        self, reshard_after_forward: bool | int, checkpoint_impl: str | None
    ):
        n_layers = 3
        model, _, inp = self._init_transformer(
            n_layers, reshard_after_forward, checkpoint_impl
        )
        events: list[EventType] = []
        # Check the order for multiple forwards before 1 backward
        with record_events(model, events, unshard=True, reshard=False, post_backward=True):
            loss1 = model(inp)
            loss2 = model(inp)
            expected_events = [
                ("unshard", "", TrainingState.FORWARD),  # root
                ("unshard", "layers.0", TrainingState.FORWARD),
                ("unshard", "layers.1", TrainingState.FORWARD),
                ("unshard", "layers.2", TrainingState.FORWARD),
            ]
            if reshard_after_forward is not None:
                expected_events.append(("unshard", "", TrainingState.FORWARD))
            expected_events.extend(
                [
                    ("unshard", "layers.0", TrainingState.FORWARD),
                    ("unshard", "layers.1", TrainingState.FORWARD),
                    ("unshard", "layers.2", TrainingState.FORWARD),
                ]
            )
            if reshard_after_forward is False:
                # No reshard after forward means no second set of unshards
                expected_events = expected_events[:-4]
            self.assertEqual(events, expected_events)
            events.clear()
            (loss1 + loss2).sum().backward()
            expected_events = []
            if reshard_after_forward is not None:
                expected_events.append(("unshard", "", TrainingState.PRE_BACKWARD))
            expected_events.extend(
                [
                    # Same as the single forward/backward case except the root's
                    # post-backward does not run until the end of backward in the
                    # final callback (since the input not requiring gradient means
                    # that we do not have a tensor on which to hook for
                    # post-backward)
                    ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                    ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                    ("post_backward", "layers.2", TrainingState.POST_BACKWARD),
                    ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                    ("post_backward", "layers.1", TrainingState.POST_BACKWARD),
                    ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
                ]
            )
            if reshard_after_forward is False:
                # No reshard after forward means no backward unshards
                expected_events = [e for e in expected_events if e[0] != "unshard"]
                # However, the post-backward reshards, so the second set of
                # unshards will run as real ops
            expected_events += [
                # Repeat the same pattern except with the root's post-backward
                # at the end since the final callback runs
                ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                ("post_backward", "layers.2", TrainingState.POST_BACKWARD),
                ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                ("post_backward", "layers.1", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
                ("post_backward", "", TrainingState.POST_BACKWARD),
            ]
            self.assertEqual(events, expected_events)
            events.clear()

    def _test_backward_prefetch_unused_in_backward(
        self, reshard_after_forward: bool | int | None
    ):
        """
        Test a model with a linear module then a split into two linear modules,
        where we run backward through one path first before the other, meaning
        that (1) only one linear of the two split is used per backward and (2)
        the initial shared linear is used in both backwards.
        """
        dim = 8
        model = nn.Sequential(nn.Linear(dim, dim), DoubleLinear(dim))
        fully_shard(model[0], reshard_after_forward=reshard_after_forward)
        fully_shard(model[1].lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model[1].lin2, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randn((4, dim), device=device_type.type)
        events: list[EventType] = []
        with record_events(model, events, unshard=True, reshard=False, post_backward=True):
            loss1, loss2 = model(inp)
            expected_events = [
                # Root has no parameters, so it does not have an unshard
                ("unshard", "0", TrainingState.FORWARD),
                ("unshard", "1.lin1", TrainingState.FORWARD),
                ("unshard", "1.lin2", TrainingState.FORWARD),
            ]
            self.assertEqual(events, expected_events)
            events.clear()

            model.set_is_last_backward(False)
            loss2.sum().backward(retain_graph=True)
            expected_events = [
                ("unshard", "1.lin2", TrainingState.PRE_BACKWARD),
                # NOTE: This `1.lin1` unshard is a mistargeted prefetch.
                ("unshard", "1.lin1", TrainingState.PRE_BACKWARD),
                ("post_backward", "1.lin2", TrainingState.POST_BACKWARD),
                ("unshard", "0", TrainingState.PRE_BACKWARD),
                ("post_backward", "0", TrainingState.POST_BACKWARD),
                # `1.lin1` post-backward hook runs but is a no-op
                ("post_backward", "1.lin1", TrainingState.POST_BACKWARD),
            ]
            self.assertEqual(events, expected_events)
            events.clear()

            model.set_is_last_backward(True)
            loss1.sum().backward()
            expected_events = [
                # NOTE: `1.lin1` is already unsharded from the mistargeted
                # prefetch in the first backward.
                # Prefetch `0`
                ("unshard", "0", TrainingState.PRE_BACKWARD),
                ("post_backward", "1.lin1", TrainingState.POST_BACKWARD),
                ("post_backward", "0", TrainingState.POST_BACKWARD),
                # `1.lin2` post-backward hook runs but is a no-op
                ("post_backward", "1.lin2", TrainingState.POST_BACKWARD),
            ]
            self.assertEqual(events, expected_events)
            events.clear()

    def test_set_modules_to_forward_prefetch(self):
        n_layers = 4
        reshard_after_forward = True
        checkpoint_impl = "utils"
        model, _, inp = self._init_transformer(
            n_layers, reshard_after_forward, checkpoint_impl
        )

        def set_forward_prefetch(model: Transformer, num_to_prefetch: int) -> None:
            # Use model-specific knowledge to configure forward prefetching:
            # each transformer block (layer) prefetches for the next few
            for i, layer in enumerate(model.layers):
                if i >= len(model.layers) - num_to_prefetch:
                    break
                layers_to_prefetch = [
                    model.layers[i + j] for j in range(1, num_to_prefetch + 1)
                ]
                layer.set_modules_to_forward_prefetch(layers_to_prefetch)

        events: list[EventType] = []
        expected_backward_events = [
            # Default backward prefetching
            ("unshard", "", TrainingState.PRE_BACKWARD),
            ("unshard", "layers.3", TrainingState.PRE_BACKWARD),
            ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
            ("reshard", "layers.3", TrainingState.POST_BACKWARD),
            ("post_backward", "layers.3", TrainingState.POST_BACKWARD),
            ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
            ("reshard", "layers.2", TrainingState.POST_BACKWARD),
            ("post_backward", "layers.2", TrainingState.POST_BACKWARD),
            ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
            ("reshard", "layers.1", TrainingState.POST_BACKWARD),
            ("post_backward", "layers.1", TrainingState.POST_BACKWARD),
            ("reshard", "layers.0", TrainingState.POST_BACKWARD),
            ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
            ("reshard", "", TrainingState.POST_BACKWARD),
            ("post_backward", "", TrainingState.POST_BACKWARD),
        ]
        with record_events(model, events, unshard=True, reshard=True, post_backward=True):
            set_forward_prefetch(model, num_to_prefetch=1)
            loss = model(inp)
            expected_forward_events = [
                ("unshard", "", TrainingState.FORWARD),
                # `layers.i` prefetches `layers.i+1`
                ("unshard", "layers.0", TrainingState.FORWARD),
                ("unshard", "layers.1", TrainingState.FORWARD),
                ("reshard", "layers.0", TrainingState.FORWARD),
                ("unshard", "layers.2", TrainingState.FORWARD),
                ("reshard", "layers.1", TrainingState.FORWARD),
                ("unshard", "layers.3", TrainingState.FORWARD),
                ("reshard", "layers.2", TrainingState.FORWARD),
                ("reshard", "layers.3", TrainingState.FORWARD),
                ("reshard", "", TrainingState.FORWARD),
            ]
            self.assertEqual(events, expected_forward_events)
            events.clear()
            loss.sum().backward()
            self.assertEqual(events, expected_backward_events)
            events.clear()

            set_forward_prefetch(model, num_to_prefetch=2)
            loss = model(inp)
            expected_forward_events = [
                ("unshard", "", TrainingState.FORWARD),
                # `layers.i` prefetches `layers.i+1` and `layers.i+2`
                ("unshard", "layers.0", TrainingState.FORWARD),
                ("unshard", "layers.1", TrainingState.FORWARD),
                ("unshard", "layers.2", TrainingState.FORWARD),
                ("reshard", "layers.0", TrainingState.FORWARD),
                ("unshard", "layers.3", TrainingState.FORWARD),
                ("reshard", "layers.1", TrainingState.FORWARD),
                ("reshard", "layers.2", TrainingState.FORWARD),
                ("reshard", "layers.3", TrainingState.FORWARD),
                ("reshard", "", TrainingState.FORWARD),
            ]
            self.assertEqual(events, expected_forward_events)
            events.clear()
            loss.sum().backward()
            self.assertEqual(events, expected_backward_events)
            events.clear()

    def test_set_modules_to_backward_prefetch(self):
        n_layers = 4
        reshard_after_forward = True
        checkpoint_impl = "utils"
        model, _, inp = self._init_transformer(
            n_layers, reshard_after_forward, checkpoint_impl
        )

        def set_backward_prefetch(model: Transformer, num_to_prefetch: int) -> None:
            # Use model-specific knowledge to configure backward prefetching:
            # each transformer block (layer) prefetches for the previous few
            for i, layer in enumerate(model.layers):
                if i < num_to_prefetch:
                    continue
                layers_to_prefetch = [
                    model.layers[i - j] for j in range(1, num_to_prefetch + 1)
                ]
                layer.set_modules_to_backward_prefetch(layers_to_prefetch)

        events: list[EventType] = []
        expected_forward_events = [
            # Default forward prefetching
            ("unshard", "", TrainingState.FORWARD),  # root
            ("unshard", "layers.0", TrainingState.FORWARD),
            ("reshard", "layers.0", TrainingState.FORWARD),
            ("unshard", "layers.1", TrainingState.FORWARD),
            ("reshard", "layers.1", TrainingState.FORWARD),
            ("unshard", "layers.2", TrainingState.FORWARD),
            ("reshard", "layers.2", TrainingState.FORWARD),
            ("unshard", "layers.3", TrainingState.FORWARD),
            ("reshard", "layers.3", TrainingState.FORWARD),
            ("reshard", "", TrainingState.FORWARD),
        ]
        with record_events(model, events, unshard=True, reshard=True, post_backward=True):
            set_backward_prefetch(model, num_to_prefetch=1)
            loss = model(inp)
            self.assertEqual(events, expected_forward_events)
            events.clear()
            loss.sum().backward()
            expected_backward_events = [
                ("unshard", "", TrainingState.PRE_BACKWARD),
                # Root prefetches `layers.3` per default
                ("unshard", "layers.3", TrainingState.PRE_BACKWARD),
                # `layers.i` prefetches for `layers.i-1` (same as default)
                ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                ("reshard", "layers.3", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.3", TrainingState.POST_BACKWARD),
                ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                ("reshard", "layers.2", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.2", TrainingState.POST_BACKWARD),
                ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                ("reshard", "layers.1", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.1", TrainingState.POST_BACKWARD),
                ("reshard", "layers.0", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
                ("reshard", "", TrainingState.POST_BACKWARD),
                ("post_backward", "", TrainingState.POST_BACKWARD),
            ]
            self.assertEqual(events, expected_backward_events)
            events.clear()

            set_backward_prefetch(model, num_to_prefetch=2)
            loss = model(inp)
            self.assertEqual(events, expected_forward_events)
            events.clear()
            loss.sum().backward()
            expected_backward_events = [
                ("unshard", "", TrainingState.PRE_BACKWARD),
                # Root prefetches `layers.3` per default
                ("unshard", "layers.3", TrainingState.PRE_BACKWARD),
                # `layers.i` prefetches for `layers.i-1` and `layers.i-2`
                ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                ("reshard", "layers.3", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.3", TrainingState.POST_BACKWARD),
                ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                ("reshard", "layers.2", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.2", TrainingState.POST_BACKWARD),
                ("reshard", "layers.1", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.1", TrainingState.POST_BACKWARD),
                ("reshard", "layers.0", TrainingState.POST_BACKWARD),
                ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
                ("reshard", "", TrainingState.POST_BACKWARD),
                ("post_backward", "", TrainingState.POST_BACKWARD),
            ]
            self.assertEqual(events, expected_backward_events)
            events.clear()

    def test_set_modules_to_backward_prefetch_inside_ac(self):
        n_layers = 3
        reshard_after_forward = True
        # use checkpoint wrapper instead of torch.utils
        model_args = ModelArgs(
            n_layers=n_layers, checkpoint_activations=False, weight_tying=False
        )
        model = Transformer(model_args)
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, TransformerBlock)
        )
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, FeedForward)
        )
        fully_shard([model.tok_embeddings, model.pos_embeddings])
        for layer in model.layers:
            # mimic fully_shard(layer.moe.experts)
            fully_shard(
                layer.feed_forward.w1, reshard_after_forward=reshard_after_forward
            )
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(
            [model.norm, model.output], reshard_after_forward=reshard_after_forward
        )
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randint(
            0,
            model_args.vocab_size,
            (2, model_args.max_seq_len),
            device=device_type.type,
        )

        def set_backward_prefetch(model: Transformer) -> None:
            # tell pyre model.set_modules_to_backward_prefetch is available
            if not isinstance(model, FSDPModule):
                raise AssertionError(f"Expected FSDPModule, got {type(model)}")
            if not isinstance(model.output, FSDPModule):
                raise AssertionError(f"Expected FSDPModule, got {type(model.output)}")

            # mimic deepseek MOE
            # prefetch layer - 1 and its feedforward before cpu sync during a2a
            reversed_transformer_blocks = list(reversed(model.layers))
            prev_transformer_blocks = reversed_transformer_blocks[1:] + [None]

            if (
                model.norm is not None
                and model.output is not None
                and len(model.layers) > 0
            ):
                if not isinstance(reversed_transformer_blocks[0], FSDPModule):
                    raise AssertionError(
                        f"Expected FSDPModule, got {type(reversed_transformer_blocks[0])}"
                    )
                model.output.set_modules_to_backward_prefetch(
                    [reversed_transformer_blocks[0]]
                )

            for transformer_block, prev_transformer_block in zip(
                reversed_transformer_blocks, prev_transformer_blocks
            ):
                if not isinstance(transformer_block, FSDPModule):
                    raise AssertionError(
                        f"Expected FSDPModule, got {type(transformer_block)}"
                    )
                if prev_transformer_block is not None:
                    if not isinstance(prev_transformer_block, FSDPModule):
                        raise AssertionError(
                            f"Expected FSDPModule, got {type(prev_transformer_block)}"
                        )
                    if not hasattr(prev_transformer_block.feed_forward, "w1"):
                        raise AssertionError(
                            "Expected prev_transformer_block.feed_forward to have 'w1' attribute"
                        )
                    if not isinstance(
                        prev_transformer_block.feed_forward.w1, FSDPModule
                    ):
                        raise AssertionError(
                            f"Expected FSDPModule, got {type(prev_transformer_block.feed_forward.w1)}"
                        )
                    transformer_block.set_modules_to_backward_prefetch(
                        [
                            prev_transformer_block,
                            prev_transformer_block.feed_forward.w1,
                        ]
                    )
                elif model.tok_embeddings is not None:
                    if not isinstance(model.tok_embeddings, FSDPModule):
                        raise AssertionError(
                            f"Expected FSDPModule, got {type(model.tok_embeddings)}"
                        )
                    transformer_block.set_modules_to_backward_prefetch(
                        [model.tok_embeddings]
                    )

        events: list[EventType] = []
        with record_events(model, events, unshard=True, reshard=True, post_backward=False):
            loss = model(inp)
            events.clear()
            loss.sum().backward()
            expected_backward_events = [
                ("unshard", "norm, output", TrainingState.PRE_BACKWARD),
                ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                ("reshard", "norm, output", TrainingState.POST_BACKWARD),
                # layers.2 prefetch w1
                (
                    "unshard",
                    "layers.2._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.PRE_BACKWARD,
                ),
                # layers.2.w1 prefetch layers.1
                ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                (
                    "reshard",
                    "layers.2._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.POST_BACKWARD,
                ),
                ("reshard", "layers.2", TrainingState.POST_BACKWARD),
                (
                    "unshard",
                    "layers.1._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.PRE_BACKWARD,
                ),
                ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                (
                    "reshard",
                    "layers.1._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.POST_BACKWARD,
                ),
                ("reshard", "layers.1", TrainingState.POST_BACKWARD),
                (
                    "unshard",
                    "layers.0._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.PRE_BACKWARD,
                ),
                (
                    "unshard",
                    "tok_embeddings, pos_embeddings",
                    TrainingState.PRE_BACKWARD,
                ),
                (
                    "reshard",
                    "layers.0._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.POST_BACKWARD,
                ),
                ("reshard", "layers.0", TrainingState.POST_BACKWARD),
                (
                    "reshard",
                    "tok_embeddings, pos_embeddings",
                    TrainingState.POST_BACKWARD,
                ),
            ]
            self.assertEqual(events, expected_backward_events)
            events.clear()

            set_backward_prefetch(model)
            loss = model(inp)
            events.clear()
            loss.sum().backward()
            expected_backward_events = [
                ("unshard", "norm, output", TrainingState.PRE_BACKWARD),
                # root explicit prefetch layers.2
                ("unshard", "layers.2", TrainingState.PRE_BACKWARD),
                ("reshard", "norm, output", TrainingState.POST_BACKWARD),
                # layers.2 prefetch layers.1 and feed_forward
                ("unshard", "layers.1", TrainingState.PRE_BACKWARD),
                (
                    "unshard",
                    "layers.1._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.PRE_BACKWARD,
                ),
                # AC recompute_fn
                (
                    "unshard",
                    "layers.2._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.FORWARD,
                ),
                (
                    "reshard",
                    "layers.2._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.POST_BACKWARD,
                ),
                ("reshard", "layers.2", TrainingState.POST_BACKWARD),
                # layers.1 prefetch layers.0
                ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                (
                    "unshard",
                    "layers.0._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.PRE_BACKWARD,
                ),
                (
                    "reshard",
                    "layers.1._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.POST_BACKWARD,
                ),
                ("reshard", "layers.1", TrainingState.POST_BACKWARD),
                # layers.0 prefetch embeddings
                (
                    "unshard",
                    "tok_embeddings, pos_embeddings",
                    TrainingState.PRE_BACKWARD,
                ),
                (
                    "reshard",
                    "layers.0._checkpoint_wrapped_module.feed_forward._checkpoint_wrapped_module.w1",
                    TrainingState.POST_BACKWARD,
                ),
                ("reshard", "layers.0", TrainingState.POST_BACKWARD),
                (
                    "reshard",
                    "tok_embeddings, pos_embeddings",
                    TrainingState.POST_BACKWARD,
                ),
            ]
            self.assertEqual(events, expected_backward_events)
            events.clear()

    def test_fully_shard_multi_module_backward_prefetch(self):
        n_layers = 5
        model_args = ModelArgs(
            n_layers=n_layers, checkpoint_activations=True, weight_tying=False
        )
        model = Transformer(model_args)
        for i in range(n_layers):
            if i == 0:
                fully_shard(model.layers[i])
            elif i % 2 == 1:
                fully_shard([model.layers[i], model.layers[i + 1]])
        fully_shard([model.tok_embeddings, model.pos_embeddings])
        fully_shard([model.norm, model.output], reshard_after_forward=False)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

        events: list[EventType] = []
        inp = torch.randint(
            0,
            model_args.vocab_size,
            (2, model_args.max_seq_len),
            device=device_type.type,
        )
        with record_events(model, events, unshard=True, reshard=False, post_backward=True):
            for _ in range(3):
                loss = model(inp)
                expected_events = [
                    (
                        "unshard",
                        "tok_embeddings, pos_embeddings",
                        TrainingState.FORWARD,
                    ),
                    ("unshard", "layers.0", TrainingState.FORWARD),
                    ("unshard", "layers.1, layers.2", TrainingState.FORWARD),
                    ("unshard", "layers.3, layers.4", TrainingState.FORWARD),
                    ("unshard", "norm, output", TrainingState.FORWARD),
                ]
                self.assertEqual(events, expected_events)
                events.clear()
                loss.sum().backward()
                expected_events = [
                    # (norm, output) does not reshard after forward, so there is
                    # no unshard to begin backward
                    ("unshard", "layers.3, layers.4", TrainingState.PRE_BACKWARD),
                    ("post_backward", "norm, output", TrainingState.POST_BACKWARD),
                    ("unshard", "layers.1, layers.2", TrainingState.PRE_BACKWARD),
                    (
                        "post_backward",
                        "layers.3, layers.4",
                        TrainingState.POST_BACKWARD,
                    ),
                    ("unshard", "layers.0", TrainingState.PRE_BACKWARD),
                    (
                        "post_backward",
                        "layers.1, layers.2",
                        TrainingState.POST_BACKWARD,
                    ),
                    (
                        "unshard",
                        "tok_embeddings, pos_embeddings",
                        TrainingState.PRE_BACKWARD,
                    ),
                    ("post_backward", "layers.0", TrainingState.POST_BACKWARD),
                    (
                        "post_backward",
                        "tok_embeddings, pos_embeddings",
                        TrainingState.POST_BACKWARD,
                    ),
                ]
                events.clear()
                optim.step()
                optim.zero_grad()

    def test_fully_shard_multi_module_unused_module(self):
        class ModuleWithUnusedLinear(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.unused_lin = nn.Linear(1, 1)
                self.lin = nn.Linear(16, 16)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return nn.functional.relu(self.lin(x))

        model = nn.Sequential(
            ModuleWithUnusedLinear(), ModuleWithUnusedLinear(), nn.Linear(16, 16)
        )
        fully_shard([model[0].unused_lin, model[0].lin], reshard_after_forward=True)
        fully_shard([model[1].unused_lin, model[1].lin], reshard_after_forward=True)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

        events: list[EventType] = []
        inp = torch.randn((2, 16), device=device_type.type)
        with record_events(model, events, unshard=True, reshard=False, post_backward=True):
            for _ in range(3):
                loss = model(inp)
                expected_events = [
                    ("unshard", "", TrainingState.FORWARD),
                    ("unshard", "0.unused_lin, 0.lin", TrainingState.FORWARD),
                    ("unshard", "1.unused_lin, 1.lin", TrainingState.FORWARD),
                ]
                self.assertEqual(events, expected_events)
                events.clear()
                loss.sum().backward()
                # `_force_complete_incomplete_states` completes post-forward
                # for the incomplete groups (both `model[0]` and `model[1]`
                # have `unused_lin` that never ran forward), reshards, and
                # registers pre-backward hooks on the root output; those
                # hooks fire at backward start (unshard events). Only
                # group1's post_backward fires via autograd (model[1]'s
                # input requires grad); root and group0's post_backwards
                # fire in the final callback in all-states pre-order.
                expected_events = [
                    ("unshard", "1.unused_lin, 1.lin", TrainingState.PRE_BACKWARD),
                    ("unshard", "0.unused_lin, 0.lin", TrainingState.PRE_BACKWARD),
                    (
                        "post_backward",
                        "1.unused_lin, 1.lin",
                        TrainingState.POST_BACKWARD,
                    ),
                    ("post_backward", "", TrainingState.POST_BACKWARD),
                    (
                        "post_backward",
                        "0.unused_lin, 0.lin",
                        TrainingState.POST_BACKWARD,
                    ),
                ]
                self.assertEqual(events, expected_events)
                events.clear()
                optim.step()
                optim.zero_grad()

    def _init_transformer(
        self,
        n_layers: int,
        reshard_after_forward: bool | int | None,
        checkpoint_impl: str | None,
    ):
        model_args = ModelArgs(
            n_layers=n_layers, checkpoint_activations=(checkpoint_impl == "utils")
        )
        model = Transformer(model_args)
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                if checkpoint_impl == "composable":
                    checkpoint(module)
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        inp = torch.randint(
            0,
            model_args.vocab_size,
            (2, model_args.max_seq_len),
            device=device_type.type,
        )
        return model, optim, inp


class TestAdaptedCommunication(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

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
