"""benchmarks/lora_bytes.py: a LoRA model on 2 and 4 gloo ranks, its base frozen before
fully_shard (`lora`, `lora_all_grads`) or after it and a step (`freeze_after`); backward's
reduce-scatter bytes of veragged.fully_shard against torch's ([Note: frozen parameters] in
veragged/fsdp/api.py, [Note: compacted gradients] in veragged/dbuffer/grad_layout.py). Bytes are
counted, not timed, so they are asserted."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed.fsdp

from veragged.dbuffer.grad_layout import FLAG_ALIGN_BYTES

HAS_ALL_GRADS = hasattr(torch.distributed.fsdp.FSDPModule, "set_reduce_scatter_unused_params")

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rows():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    scenarios = ["lora", "lora_all_grads", "freeze_after"] if HAS_ALL_GRADS else [
        "lora", "freeze_after"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lora_bytes.py"), "--json",
           "--scenarios", ",".join(scenarios), "--warmup", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r["world"], r["scenario"]) for r in result["rows"]] == [
        (w, s) for w in (2, 4) for s in scenarios]
    return result["rows"]


def test_lora_backward_reduces_only_the_adapters(rows):
    for r in rows:
        if r["scenario"] != "lora":
            continue
        t, v = r["torch"], r["veragged"]
        assert r["grad_names_match"] and r["grad_max_diff"] < 1e-6, r  # the same gradients
        assert t["same_on_all_ranks"] and v["same_on_all_ranks"], r
        assert v["trainable"] == t["trainable"] and t["rs_bytes"] == 4 * t["trainable"], r
        # One reduce-scatter per block, as torch; what it scatters is the gradient buffer of a
        # DBuffer holding trainable parameters, and the frozen DBuffers send nothing.
        assert len(v["rs_calls"]) == len(t["rs_calls"]) == 4, r
        assert sorted(v["rs_calls"]) == sorted(v["dbuffer_grad_bytes"]), r
        # The adapters' gradients plus each rank's slot's verdict flags ([Note: unreached
        # parameters]: 4 trainable tensors per DBuffer here, so 16 B per rank per DBuffer);
        # before cf0e5ef the whole model: 1,085,440 B on 2 ranks.
        flags = len(v["rs_calls"]) * r["world"] * FLAG_ALIGN_BYTES
        assert v["rs_bytes"] == t["rs_bytes"] + flags, r
        assert v["grad_buf_max"] == t["grad_buf_max"] + r["world"] * FLAG_ALIGN_BYTES, r
        assert v["ar_bytes"] == t["ar_bytes"] == 0, r


@pytest.mark.xfail(strict=True, reason="the verdict flags ([Note: unreached parameters]) add "
                   "16 B (FLAG_ALIGN_BYTES) per rank per trainable DBuffer of up to 4 fp32 "
                   "tensors to the reduce-scatter: 32,896 B vs torch's 32,768 B on 2 ranks, "
                   "33,024 B vs 32,768 B on 4 (issue 25 item 8)")
def test_lora_reduce_scatter_bytes_at_most_torch(rows):
    for r in rows:
        if r["scenario"] != "lora":
            continue
        assert r["veragged"]["rs_bytes"] <= r["torch"]["rs_bytes"], r
        assert r["veragged"]["grad_buf_max"] <= r["torch"]["grad_buf_max"], r


@pytest.mark.skipif(not HAS_ALL_GRADS, reason="torch's set_reduce_scatter_unused_params is new "
                    "in torch 2.15")
def test_lora_without_verdicts_sends_torchs_bytes(rows):
    """With every trainable parameter given a gradient (torch's answer to ranks reaching
    different parameters) no verdict travels: the adapters' gradients only, as torch's."""
    for r in rows:
        if r["scenario"] != "lora_all_grads":
            continue
        t, v = r["torch"], r["veragged"]
        assert r["grad_names_match"] and r["grad_max_diff"] < 1e-6, r
        assert v["rs_bytes"] <= t["rs_bytes"] == 4 * t["trainable"], r
        assert v["grad_buf_max"] <= t["grad_buf_max"], r
        assert sorted(v["rs_calls"]) == sorted(v["dbuffer_grad_bytes"]), r


def test_frozen_after_fully_shard_sends_each_ranks_share(rows):
    """Base weights frozen after fully_shard and a step: the blocks' DBuffers hold frozen and
    trainable parameters alike, and the layout leaves the adapters on whichever ranks it gave
    them. Each rank's gradient slot is its own share ([Note: compacted gradients]: slots of
    different sizes go by the list form of the reduce-scatter), so the wire carries the
    adapters' gradients and the flags of the 4 trainable tensors only, as in `lora` (before:
    every slot as large as the largest share, 66,048 B vs torch's 32,768 B on 2 ranks)."""
    for r in rows:
        if r["scenario"] != "freeze_after":
            continue
        t, v = r["torch"], r["veragged"]
        assert r["grad_names_match"] and r["grad_max_diff"] < 1e-6, r
        assert len(v["rs_calls"]) == len(t["rs_calls"]) == 4, r
        flags = len(v["rs_calls"]) * r["world"] * FLAG_ALIGN_BYTES
        # each slot rounds up to 16 bytes: at most 12 B more per rank per DBuffer
        pad = len(v["rs_calls"]) * r["world"] * (FLAG_ALIGN_BYTES - 4)
        assert t["rs_bytes"] + flags <= v["rs_bytes"] <= t["rs_bytes"] + flags + pad, r
