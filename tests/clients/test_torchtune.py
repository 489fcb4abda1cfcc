"""torchtune 0.6.1's distributed utilities under torch's and veragged's fully_shard: bitwise equal.

torchtune needs torchao 0.13, which breaks torchtitan's import, so it lives in its own virtual
environment (build/venv-torchtune, made by scripts/install_test.sh); this test runs the launcher
_tune.py there, which runs the LoRA recipe's set-up, training, full/adapter state dict gathering
and the optimizer state round trip on 2 gloo ranks with each implementation (see _tune.py).
Bitwise: with 2 ranks each gradient element is a sum of two addends, AdamW is element-wise and
nothing reduces across a shard (no clipping).
"""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest

from tests.clients._launch import assert_same, compare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PY = os.path.join(ROOT, "build", "venv-torchtune", "bin", "python")

pytestmark = pytest.mark.timeout(600)


def _torchtune_python() -> str:
    if not os.path.exists(VENV_PY):
        pytest.skip("torchtune is not installed: no build/venv-torchtune (scripts/install_test.sh)")
    probe = subprocess.run([VENV_PY, "-c", "import torchtune"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"torchtune does not import in build/venv-torchtune: {probe.stderr[-300:]}")
    return VENV_PY


def test_torchtune_distributed_utilities_match_torch(tmp_path):
    python = _torchtune_python()
    out = str(tmp_path / "results.pkl")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([python, "-m", "tests.clients._tune", out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=550)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        results = pickle.load(f)
    ref, res = results["torch"], results["veragged"]
    assert not isinstance(ref, str), f"torch's side failed (the harness is broken):\n{ref}"
    assert not isinstance(res, str), f"veragged failed:\n{res}"
    for name, run in (("torch", ref), ("veragged", res)):
        for key, (largest, fan_in) in run[0]["init"].items():  # LoRALinear.initialize_parameters
            if "lora_b" in key:
                assert largest == 0.0, f"{name}: {key} not zero-initialised"
            else:  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                assert 0.0 < largest <= fan_in ** -0.5, f"{name}: {key} max |w| {largest}"
    for rank in range(2):
        compare(f"torchtune rank {rank}", ref[rank]["loss"], res[rank]["loss"])
    for key in ("full", "adapters", "optim", "after"):
        assert_same(ref[0][key], res[0][key], key)
