"""The README's main job: examples/train_llama.py under torchrun trains, saves and resumes."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(ckpt, steps, *extra, nproc=2):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "examples" / "train_llama.py"),
    ]
    cmd += [
        "--steps",
        str(steps),
        "--dim",
        "32",
        "--layers",
        "2",
        "--seq",
        "16",
        "--batch",
        "2",
        "--log-every",
        "1",
    ]
    cmd += ["--ckpt", str(ckpt), *extra]
    # The checkout under test, whatever an editable install elsewhere points at.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_trains_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _run(ckpt, 3)
    assert "step     3  loss" in first and "tokens/s" in first and "MiB" in first
    assert (ckpt / ".metadata").exists()
    second = _run(ckpt, 5, "--bf16")
    assert "resumed from" in second and "at step 3" in second and "step     5  loss" in second


def test_trains_with_adamw8bit_and_torch_adamw(tmp_path):
    for optim in ("adamw8bit", "adamw"):
        out = _run(tmp_path / optim, 2, "--optim", optim)
        assert "step     2  loss" in out and "saved" in out


def test_tensor_and_expert_parallel_train_and_resume_under_another_split(tmp_path):
    # --ep with Muon (the default); --tp with 8-bit AdamW, whose absmax is placed like the
    # parameter, so it resumes under another TP size too.
    for flag, extra in (("--ep", ()), ("--tp", ("--optim", "adamw8bit", "--block-size", "8"))):
        ckpt = tmp_path / flag.strip("-")
        first = _run(ckpt, 2, flag, "2", *extra, nproc=4)
        assert "step     2  loss" in first and "saved" in first
        second = _run(ckpt, 3, flag, "4", *extra, nproc=4)
        assert "resumed from" in second and "at step 2" in second and "step     3  loss" in second
