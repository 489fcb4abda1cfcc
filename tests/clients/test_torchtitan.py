"""torchtitan 0.3.0 under torch's and veragged's fully_shard: same losses, norms and weights.

torchtitan's own Trainer, config registry and command line (`--module ... --config ...`), on
gloo ranks through the launcher in _titan.py (its CPU patches are listed there; nothing in
site-packages changes). Each test makes its own tokenizer and corpus (_data.py), writes
torchtitan's seed checkpoint, then trains from it read-only with torch's fully_shard and with
veragged's: torch's FSDP2 initialises each rank's Shard(0) piece from one local RNG stream on
CPU, so the two implementations are compared from the same checkpoint, not from their inits.

- Llama3 debug model, default configuration, 2 ranks: fused QKV (its init calls
  `param.new_empty` on the sharded parameter), the `spmd_types` backend (`dp_mesh_dims=` to every
  fully_shard), bf16 compute with fp32 reduction, selective activation checkpointing, chunked
  loss (reshard flags toggled on the lm_head group). Gradient clipping is left on but never binds
  (`--training.max_norm 1e9`: the coefficient clamps to exactly 1.0), so losses and trained
  parameters must be bitwise equal: with 2 ranks every gradient element is a sum of two addends
  in both implementations, and the casts and AdamW are element-wise. (A binding max_norm would
  change the clip coefficient in its last bits, since the total norm sums each rank's local
  shard and the shard boundaries differ, and through the next bf16 forward the losses by ~1e-4.)
- DeepSeek-V3 debug model with `--parallelism.expert_parallel_degree 2` on 4 ranks: routed
  experts Shard(0) over `ep` and sharded by FSDP over `efsdp` (2) of the sparse `(efsdp, ep)`
  mesh, the rest over `fsdp` (4), via `shard_placement_fn` returning `ShardPlacementResult`;
  token exchange by all-to-all. Not bitwise: the dense gradients are sums of 4 ranks' addends,
  whose order in gloo's reduce-scatter can depend on an element's position in the communication
  buffer, and the implementations lay the parameters out differently (measured: up to 2e-8
  relative in the first step's gradients). fp32 parameters
  (`--training.mixed_precision_param float32`) keep that round-off from flipping bf16 roundings,
  so losses agree to 1e-5 relative (a wrong gradient moves them by 1e-3 or more in 4 steps).
- Llama3 debug model with 8-bit weight gathers (`quant_fn`, _titan.py's `quant=`): BlockFP8
  128x128 on the blocks' Linear weights against the same veragged run without a format. Not
  bitwise (the forward uses the dequantised weights), so losses agree to `FP8_LOSS_RTOL`.
  torchtitan's default fused AdamW does not bump the parameters' version counters; each step
  still re-quantises ([Note: shard epochs]).

Gradient norms are compared to 1e-5 relative (each implementation sums its own shards).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/install_test.sh)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (scripts/install_test.sh)")

from tests.clients import _titan  # noqa: E402
from tests.clients._data import make_assets  # noqa: E402
from tests.clients._launch import assert_same, client_pool, compare  # noqa: E402

pytestmark = pytest.mark.timeout(900)
NORM_RTOL = 1e-5
LOSS_RTOL_4 = 1e-5
STEPS = 4
# BlockFP8 128x128 against unquantised gathers, llama3 debugmodel, 4 steps: measured 2.3e-4
# relative at most (5e-5 at step 1, from the same master weights; MXFP8: 4.4e-4). E4M3 keeps 3
# mantissa bits, so each weight moves by up to 2^-4 of itself, but the errors are unbiased
# and average out over a 256-wide dot product. A forward on step 0's weights (gathers that
# are never re-quantised) is 7e-2 off by step 4, and one step lowers the loss by 4-6%.
FP8_LOSS_RTOL = 2e-3
# The blocks' Linear weights, as `_titan.block_linear_quant_fn` names them.
TITAN_LINEARS = ("attention.qkv_linear.wqkv.weight", "attention.wo.weight",
                 "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def _unwrapped(name: str) -> str:
    """A parameter name without activation checkpointing's wrapper module."""
    return name.replace("_checkpoint_wrapped_module.", "")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(str(tmp_path_factory.mktemp("titan_assets")))


def _args(assets: dict, extra: list[str], steps: int = STEPS) -> list[str]:
    return ["--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets["data"],
            "--training.local_batch_size", "2", "--training.seq_len", "64",
            "--training.steps", str(steps), "--training.max_norm", "1e9", *extra]


def _run_both(world, module, config, args, folder, full_params=False):
    pool = client_pool(world)
    pool.run(_titan.make_seed, module, config, args, folder)
    ref = pool.run(_titan.train, "torch", module, config, args, folder, full_params)[0]
    res = pool.run(_titan.train, "veragged", module, config, args, folder, full_params)[0]
    assert any("RaggedShard" in k for k in res["shards"]), res["shards"]
    assert not any("RaggedShard" in k for k in ref["shards"]), ref["shards"]
    assert len(ref["loss"]) == STEPS
    return ref, res


def test_torchtitan_llama3_debugmodel(assets, tmp_path):
    ref, res = _run_both(2, "llama3", "llama3_debugmodel", _args(assets, []), str(tmp_path),
                         full_params=True)
    compare("llama3 loss", ref["loss"], res["loss"])
    compare("llama3 grad norm", ref["grad_norm"], res["grad_norm"], NORM_RTOL)
    assert_same(ref["params"], res["params"], "llama3 trained parameters")


def test_torchtitan_deepseek_v3_expert_parallel(assets, tmp_path):
    args = _args(assets, ["--parallelism.expert_parallel_degree", "2",
                          "--training.disable_cuda_graphs",
                          "--training.mixed_precision_param", "float32"])
    try:
        ref, res = _run_both(4, "deepseek_v3", "deepseek_v3_debugmodel", args, str(tmp_path))
    finally:
        client_pool(4).shutdown()  # no other client test uses 4 ranks: free them now
    assert any("StridedRaggedShard" in k for k in res["shards"]), res["shards"]  # (efsdp, ep)
    compare("deepseek_v3 ep2 loss", ref["loss"], res["loss"], LOSS_RTOL_4)
    compare("deepseek_v3 ep2 grad norm", ref["grad_norm"], res["grad_norm"], NORM_RTOL)


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_torchtitan_async_checkpoint_resumes_bitwise(assets, tmp_path, mode):
    """torchtitan's `--checkpoint.async_mode` (DCP's async_save: a thread with the default
    stager, or DefaultStager with shared memory and asynchronous staging; _titan.py patch 9):
    10 steps saving at 5 and 10, then a run that resumes from step 5. The resumed steps must be
    the uninterrupted run's, bitwise, and both runs torch's fully_shard's."""
    folder, pool = str(tmp_path), client_pool(2)
    args = _args(assets, [], steps=10)
    pool.run(_titan.make_seed, "llama3", "llama3_debugmodel", args, folder)
    saving = args + ["--checkpoint.interval", "5", "--checkpoint.async_mode", mode]
    runs = {}
    for impl in ("torch", "veragged"):
        run = f"run_{impl}"
        whole = pool.run(_titan.train_saving, impl, "llama3", "llama3_debugmodel", saving,
                         folder, run)[0]
        steps = sorted(os.listdir(os.path.join(folder, run, "checkpoint")))
        assert steps == ["step-10", "step-5"], steps
        resumed = pool.run(_titan.train_saving, impl, "llama3", "llama3_debugmodel",
                           saving + ["--checkpoint.load_step", "5"], folder, run)[0]
        assert len(whole["loss"]) == 10 and len(resumed["loss"]) == 5, (whole, resumed)
        compare(f"{impl} {mode}: resumed loss", whole["loss"][5:], resumed["loss"])
        compare(f"{impl} {mode}: resumed grad norm", whole["grad_norm"][5:],
                resumed["grad_norm"])
        runs[impl] = whole, resumed
    assert any("RaggedShard" in k for k in runs["veragged"][0]["shards"])
    compare(f"{mode}: loss", runs["torch"][0]["loss"], runs["veragged"][0]["loss"])
    compare(f"{mode}: resumed loss", runs["torch"][1]["loss"], runs["veragged"][1]["loss"])


def test_torchtitan_llama3_block_fp8_gathers(assets, tmp_path):
    """torchtitan's llama3 debugmodel (2 ranks, 6 blocks, dim 256, SwiGLU 768: whole 128x128
    tiles) under veragged's fully_shard with `BlockFP8()` on every block's wqkv, wo, w1, w2 and
    w3, against the same run with no format: the losses stay finite and within
    FP8_LOSS_RTOL, each block's group gathers in ~1 byte per element (bf16 gathers 2), is
    re-quantised once per step and all-gathered at least twice (forward, backward), and every
    quantised weight trains to other values than the unquantised run's (the forward saw the
    dequantised weights). torchtitan's default optimizer, fused AdamW, writes the parameters
    without bumping their version counters: the per-step re-quantisation is [Note: shard
    epochs]'s (before it, step 0's bytes were gathered every step, 7e-2 off by step 4)."""
    import veragged

    folder, pool = str(tmp_path), client_pool(2)
    args = _args(assets, [])
    pool.run(_titan.make_seed, "llama3", "llama3_debugmodel", args, folder)
    ref = pool.run(_titan.train, "veragged", "llama3", "llama3_debugmodel", args, folder,
                   True)[0]
    res = pool.run(_titan.train, "veragged", "llama3", "llama3_debugmodel", args, folder,
                   True, veragged.BlockFP8())[0]
    assert ref["quant_stats"] == [], ref["quant_stats"]
    assert len(res["loss"]) == STEPS and all(map(math.isfinite, res["loss"])), res["loss"]
    compare("llama3 BlockFP8 loss vs unquantised", ref["loss"], res["loss"], FP8_LOSS_RTOL)

    stats = res["quant_stats"]
    assert len(stats) == 6, stats  # one group per block; embedding, norm and lm_head raw
    for s in stats:
        quantised = sorted(_unwrapped(n) for n, f in s["formats"].items() if f != "raw")
        assert quantised == sorted(TITAN_LINEARS), s["formats"]
        assert {f for f in s["formats"].values() if f != "raw"} == {"BlockFP8(128x128, fp32)"}
        # Scales (4 bytes per 16384 elements), 16-byte alignment, the raw bf16 norms: 1.0012.
        assert 1.0 < s["gather_bytes"] / s["elements"] < 1.01, s
        assert s["quantizations"] == STEPS and s["all_gathers"] >= 2 * STEPS, s

    for name, want in ref["params"].items():
        if _unwrapped(name).endswith(TITAN_LINEARS):
            assert not torch.equal(want, res["params"][name]), f"{name}: same as unquantised"

