"""torchtitan 0.3.0 under torch's and veragged's fully_shard: the same losses and gradient norms.

torchtitan's own Trainer, config registry and command line (`--module ... --config ...`), on
gloo ranks through the launcher in _titan.py (its CPU patches are listed there; nothing in
site-packages changes). Each test makes its own tokenizer and corpus (_data.py), writes
torchtitan's seed checkpoint, then trains from it read-only with torch's fully_shard and with
veragged's: torch's FSDP2 initialises each rank's Shard(0) piece from one local RNG stream on
CPU, so the two implementations are compared from the same checkpoint, not from their inits.

- Llama3 debug model, default configuration: fused QKV (its init calls `param.new_empty` on the
  sharded parameter), the `spmd_types` backend (`dp_mesh_dims=` to every fully_shard), selective
  activation checkpointing, chunked loss (reshard flags toggled on the lm_head group), clipping.
- DeepSeek-V3 debug model with `--parallelism.expert_parallel_degree 2`: routed experts are
  Shard(0) over `ep` and sharded by FSDP over `efsdp` of the sparse `(efsdp, ep)` mesh, the rest
  over `fsdp`, via `shard_placement_fn` returning `ShardPlacementResult` per parameter.

Gradient clipping is left on but never binds (`--training.max_norm 1e9`: the coefficient clamps
to exactly 1.0), so the losses must be bitwise equal: with 2 ranks every gradient element is a
sum of two addends in both implementations, and the default bf16 compute with fp32 reduction and
AdamW are element-wise. With a binding max_norm the total norm, a sum over each rank's local
shard whose boundaries differ (torch: equal Shard(0) chunks; veragged: whole rows), changes the
clip coefficient in its last bits, and through the bf16 casts of the next forward the losses by
~1e-4; the gradient norms here are compared to 1e-5 relative for that reason.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/install.sh)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (scripts/install.sh)")

from tests.clients import _titan  # noqa: E402
from tests.clients._data import make_assets  # noqa: E402
from tests.clients._launch import client_pool, compare  # noqa: E402

pytestmark = pytest.mark.timeout(900)
NORM_RTOL = 1e-5
STEPS = 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(str(tmp_path_factory.mktemp("titan_assets")))


def _args(assets: dict, extra: list[str]) -> list[str]:
    return ["--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets["data"],
            "--training.local_batch_size", "2", "--training.seq_len", "64",
            "--training.steps", str(STEPS), "--training.max_norm", "1e9", *extra]


def _compare_runs(name, world, module, config, args, folder):
    pool = client_pool(world)
    pool.run(_titan.make_seed, module, config, args, folder)
    ref = pool.run(_titan.train, "torch", module, config, args, folder)
    res = pool.run(_titan.train, "veragged", module, config, args, folder)
    assert any("RaggedShard" in k for k in res[0]["shards"]), res[0]["shards"]
    assert not any("RaggedShard" in k for k in ref[0]["shards"]), ref[0]["shards"]
    assert len(ref[0]["loss"]) == STEPS
    compare(f"{name} loss", ref[0]["loss"], res[0]["loss"])
    compare(f"{name} grad norm", ref[0]["grad_norm"], res[0]["grad_norm"], NORM_RTOL)


def test_torchtitan_llama3_debugmodel(assets, tmp_path):
    _compare_runs("llama3", 2, "llama3", "llama3_debugmodel", _args(assets, []), str(tmp_path))


def test_torchtitan_deepseek_v3_expert_parallel(assets, tmp_path):
    args = _args(assets, ["--parallelism.expert_parallel_degree", "2",
                          "--training.disable_cuda_graphs"])
    _compare_runs("deepseek_v3 ep2", 2, "deepseek_v3", "deepseek_v3_debugmodel", args,
                  str(tmp_path))
