"""HF transformers 5.x (+ PEFT) under torch's and veragged's fully_shard: same losses, same weights.

Tiny Llama with PEFT LoRA on q/v (base frozen) and tiny Qwen3-MoE (3-D expert parameters),
2 gloo ranks, 4 AdamW steps each; see _hf.py for what the user code does (meta init,
`init_weights()`, torch's `set_model_state_dict(full_state_dict=True)`, full state dict back).
Bitwise: with 2 ranks each gradient element is one sum of two addends in both implementations,
AdamW is element-wise and nothing reduces over a shard (no clipping), so nothing reorders.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (scripts/install_test.sh)")

from tests.clients import _hf  # noqa: E402
from tests.clients._launch import client_pool, compare  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("case", _hf.CASES)
def test_transformers_matches_torch(case):
    if case == "llama_lora":
        pytest.importorskip("peft", reason="peft is not installed (scripts/install_test.sh)")
    pool = client_pool(2)
    ref = pool.run(_hf.run, "torch", case)
    res = pool.run(_hf.run, "veragged", case)
    for rank in range(2):
        compare(f"{case} rank {rank}", ref[rank]["loss"], res[rank]["loss"])
    want, got = ref[0]["state"], res[0]["state"]
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), f"{case}: {key} differs after training"


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_moe_muon_expert_stacks_equal_one_process(case):
    """Qwen3-MoE's and Mixtral's 3-D experts in veragged's Muon under veragged.fully_shard:
    every expert a matrix (gate and up apart), mostly computed on the rank holding it, bitwise
    one process."""
    for r in client_pool(2).run(_hf.run_muon, case):
        assert all(r["equal"]), r
        assert r["experts"] == 2 * 2 * 4  # gate_up and down, 2 layers, 4 experts
        # (a few may move to keep the load within the locality slack of lpt's balance)
        assert r["at_home"] >= 0.75 * r["experts"], r
