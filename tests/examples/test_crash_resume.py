"""examples/train_llama.py's checkpoints: one directory per step, the newest kept, and a save
that a killed rank did not finish is never loaded.

Three runs of the same tiny model under torchrun (2 ranks, gloo), saving every 2 steps and
keeping 2: an uninterrupted one to step 6; one whose rank 1 SIGKILLs itself
(`VERAGGED_EXAMPLE_KILL=save:4`, the example's test-only hook) after writing its part of step 4's
checkpoint, before the save completes, so torchrun fails; and a rerun to step 6, which must
resume from step 2 (the newest complete checkpoint, not the half-written step 4) and log, for
steps 3 to 6, losses bitwise equal to the uninterrupted run's (`--log-exact`: float.hex).
"""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS, EVERY, KILLED = 6, 2, 4


def _run(ckpt, *extra, kill=None, ok=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_llama.py"),
           "--steps", str(STEPS), "--dim", "32", "--layers", "2", "--seq", "16", "--batch", "2",
           "--log-every", "1", "--log-exact", "--ckpt", str(ckpt),
           "--ckpt-every", str(EVERY), "--keep", "2", *extra]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("VERAGGED_EXAMPLE_KILL", None)
    if kill:
        env["VERAGGED_EXAMPLE_KILL"] = kill
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode == 0) == ok, (out.returncode, out.stdout + out.stderr)
    return out.stdout + out.stderr


def _exact(out: str) -> dict[int, str]:
    """Step -> the exact loss (float.hex) rank 0 logged at it."""
    return {int(step): loss for step, loss in
            re.findall(r"^step +(\d+) +loss .* exact (\S+)$", out, re.MULTILINE)}


def _dirs(ckpt) -> list[str]:
    return sorted(p.name for p in pathlib.Path(ckpt).iterdir())


def test_killed_save_is_ignored_and_the_resume_is_bitwise(tmp_path):
    clean = _run(tmp_path / "clean")
    ref = _exact(clean)
    assert sorted(ref) == list(range(1, STEPS + 1)), clean
    assert _dirs(tmp_path / "clean") == ["step-4", "step-6"], clean  # --keep 2
    for d in ("step-4", "step-6"):
        assert (tmp_path / "clean" / d / ".metadata").is_file()

    ckpt = tmp_path / "crash"
    crashed = _run(ckpt, kill=f"save:{KILLED}", ok=False)
    assert "rank 1: VERAGGED_EXAMPLE_KILL, SIGKILL" in crashed, crashed
    assert f"saved {ckpt}/step-2 at step 2" in crashed, crashed
    assert f"saved {ckpt}/step-{KILLED} " not in crashed, crashed
    # The steps before the kill are the clean run's too.
    assert _exact(crashed) == {s: ref[s] for s in range(1, KILLED + 1)}, crashed
    # Step 4 was being written (rank 1's part is on disk) but never completed: only its .tmp.
    assert _dirs(ckpt) == ["step-2", f"step-{KILLED}.tmp"], crashed
    assert (ckpt / "step-2" / ".metadata").is_file()

    resumed = _run(ckpt)
    assert f"resumed from {ckpt}/step-2 at step 2" in resumed, resumed
    got = _exact(resumed)
    assert sorted(got) == list(range(3, STEPS + 1)), resumed
    assert got == {s: ref[s] for s in got}, (got, ref)
    assert _dirs(ckpt) == ["step-4", "step-6"], resumed  # the .tmp removed, step-2 rotated out


def test_old_single_checkpoint_layout_is_refused(tmp_path):
    """A --ckpt holding one checkpoint directly (the layout before step-<N>) is not trained
    over: the run stops at argument parsing (argparse's exit status 2, before any process group)
    and says how to move it."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / ".metadata").write_bytes(b"")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), "--ckpt",
                          str(tmp_path / "old")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "old layout" in out.stderr and "step-<N>" in out.stderr, out.stderr
