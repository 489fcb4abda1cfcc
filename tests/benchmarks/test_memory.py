"""benchmarks/memory.py and veragged.tools.memory: peak memory by torch's MemTracker, veragged's
fully_shard against torch's in one run (gloo ranks), and the one-process FakeTensorMode
estimate at a large world size."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def llama_row():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--json", "--models", "llama",
           "--fake-models", "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    return row


def test_both_sides_measured_by_kind_and_phase(llama_row):
    for side in ("torch", "veragged"):
        r = llama_row[side]
        assert r["peak"] == max(r["phases"].values()) > 0
        assert r["by_kind"]["param"] > 0 and r["by_kind"]["optim"] > 0
        # the same AdamW states on both sides (fp32 exp_avg and exp_avg_sq of the shard)
    assert llama_row["veragged"]["by_kind"]["optim"] == llama_row["torch"]["by_kind"]["optim"]


@pytest.mark.xfail(strict=True, reason=(
    "issue 41 target not met yet: veragged's peak is 1.21x torch's on this llama at 2 ranks "
    "(2026-12-07): in backward it holds three unsharded groups at once and each group's "
    "gradient landing buffer until the next reduce-scatter, and keeps the sharded gradient "
    "buffer through zero_grad; see docs/benchmarks.md, Memory"))
def test_peak_not_above_torch(llama_row):
    assert llama_row["ratio"] <= 1.0, llama_row["ratio"]


_ESTIMATE = r"""
import json, warnings
from veragged.tools.memory import estimate
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    r = estimate("gpt-oss-layers", 1024, seq=128)
print(json.dumps({"report": r.as_dict(), "warnings": [str(x.message) for x in w]}))
"""


def test_fake_estimate_at_1024_ranks():
    out = subprocess.run([sys.executable, "-c", _ESTIMATE], capture_output=True, text=True,
                         timeout=280, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [m for m in res["warnings"] if "data pointer" in m or "data_ptr" in m], res
    r = res["report"]
    # In the optimizer phase only the sharded parameters are live: total / world, plus padding.
    shard = r["phase_kinds"]["optimizer"]["param"]
    even = r["params"] * 4 / 1024
    assert even <= shard <= 1.01 * even, (shard, even)
    assert r["peak"] == max(r["phases"].values()) > shard
    assert r["by_kind"]["act"] + r["by_kind"]["temp"] > 0
