"""benchmarks/host_profile.py runs end to end at its smallest: both parts, one JSON line, the
shares it reports are shares (smoke only: no timing targets are asserted)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_host_profile_smallest():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_profile.py"), "--part", "both",
           "--n", "4", "--reps", "2", "--rounds", "1", "--steps", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "host_profile"
    assert {"add_", "_foreach_norm", "adamw_step"} <= set(result["ops"])
    for row in result["ops"].values():
        assert 0.0 <= row["placement_python_share"] <= 1.0, row
        assert min(row["plain_us"], row["torch_us"], row["ragged_us"]) > 0, row
    step = result["step"]
    assert step["tensors"] == 1053 and step["steps"] == 1
    ours, torch_side = step["sides"]["veragged"]["step"], step["sides"]["torch"]["step"]
    # Our layers run only on our side, torch's FSDP only on torch's.
    assert 0.0 < ours["ours_py_share"] <= 1.0 and torch_side["ours_py_share"] == 0.0
    assert ours["py_ms"]["placement"] > 0 and torch_side["py_ms"]["torch fsdp"] > 0
    assert any(name.startswith("placement/") for name in step["files"])
