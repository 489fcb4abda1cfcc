"""benchmarks/optim_matrix.py --quick runs end to end: every optimizer and mode on 4 ranks, the
MoE, batched owner compute (bitwise, fewer launches), the Qwen3 balance table, and one JSON line (smoke only: no timing targets are asserted)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_optim_matrix_quick():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "optim_matrix.py"), "--quick", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["step"]) == {"Muon", "Shampoo", "SOAP"}
    for modes in result["step"].values():
        assert set(modes) == {"owners", "local", "SC", "layer-wise"}
        assert modes["SC"]["ratio"] is None and modes["SC"]["speedup_vs_sc"] == 1.0
        assert modes["layer-wise"]["groups"] == 1  # one exchange for the whole model
        for r in modes.values():
            assert r["step_s"] > 0 and len(r["steps_s"]) == r["steps"]
    moe = result["moe"]["rows"]
    assert set(moe) == {"local", "lpt", "layer-wise", "SC"}
    # experts mostly computed where they lie (a few may move for balance: the locality slack)
    assert moe["local"]["expert_elements_moved"] < moe["lpt"]["expert_elements_moved"]
    assert moe["local"]["bytes"] < moe["lpt"]["bytes"]
    assert moe["SC"]["expert_elements_moved"] is None
    batch = result["batched"]  # part 4: batching changes launches, never bits
    assert set(batch) == {"Muon", "Shampoo", "SOAP"}
    for r in batch.values():
        assert r["bitwise"], r
        assert r["batched"]["products"] < r["one by one"]["products"], r
        assert r["batched"]["launches"] < r["one by one"]["launches"], r
    assert "optimizer" in out.stderr and "lpt target" in out.stderr  # the tables
    rows = result["balance"]
    assert {r["optimizer"] for r in rows} == {"Muon", "Shampoo", "SOAP"}
    for r in rows:
        assert 1.0 <= r["bound"] <= r["tight"] <= r["lpt"] * (1 + 1e-12)
