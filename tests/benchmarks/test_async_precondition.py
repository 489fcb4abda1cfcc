"""benchmarks/async_precondition.py --quick runs end to end: the width calibration, every config
on 4 ranks, the loss table and one JSON line (smoke only: no timing targets are asserted)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_async_precondition_quick():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "async_precondition.py"), "--quick",
           "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["rows"]
    assert "AdamW" in rows and "Shampoo f=10 k=4" in rows and "SOAP f=10 k=4" in rows
    for name, r in rows.items():
        assert r["n"] == 2 * result["steps"] and 0 < r["p50"] <= r["p99"] <= r["max"], name
        assert (r["vs_sync"] is None) == (name == "AdamW" or name.endswith("sync")), name
    assert rows["Shampoo f=10 k=4"]["stats"]["max_age"] in (0, 4)
    assert rows["Shampoo f=1 k=1"]["stats"]["installed"] > 0
    assert set(result["losses"]) == {"Shampoo f=10 k=0", "Shampoo f=10 k=1",
                                     "Shampoo f=10 k=4", "AdamW"}
    assert "target" in out.stderr and "p99/p50" in out.stderr  # the tables
