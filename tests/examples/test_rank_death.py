"""A rank that dies: examples/train_llama.py on 2 ranks (gloo, `--pg-timeout 20`), one process
per rank started here (not torchrun, which would kill the survivor itself), rank 1 SIGKILLed by
the example's test-only hook (`VERAGGED_EXAMPLE_KILL`) in the forward of step 4 (before its last
block) or in its backward (when the first block's output gradient is computed).

Rank 0 must exit, non-zero, within the process group's timeout of rank 1's death (gloo fails at
once when the dead rank's connections close; measured ~1 s), with an error that names the
collective and the group (veragged's NamedWork: gloo's own names neither). The checkpoint root
holds step 2, complete, and nothing of step 4: the failed step completed no checkpoint.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT = 20  # the process group's, seconds
STEP = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(ckpt, where: str):
    """Ranks 0 and 1 as processes of their own; rank 1 dies at `where` of step STEP."""
    cmd = [sys.executable, str(ROOT / "examples" / "train_llama.py"),
           "--steps", "6", "--dim", "32", "--layers", "2", "--seq", "16", "--batch", "2",
           "--log-every", "1", "--ckpt", str(ckpt), "--ckpt-every", "2",
           "--pg-timeout", str(TIMEOUT)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "VERAGGED_EXAMPLE_KILL": f"{where}:{STEP}:1"}
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in (0, 1)]


@pytest.mark.cpu_only("gloo with a short timeout, as issue 41 asks; under NCCL its watchdog "
                      "reports a dead peer")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_survivor_exits_naming_the_collective_and_no_checkpoint_completes(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    survivor, victim = _launch(ckpt, where)
    try:
        _, victim_err = victim.communicate(timeout=120)
        died = time.monotonic()
        assert victim.returncode == -9, (victim.returncode, victim_err)
        out, err = survivor.communicate(timeout=TIMEOUT + 30)
        took = time.monotonic() - died
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert survivor.returncode not in (0, None), (out, err)
    assert took < TIMEOUT, (took, err)
    # Named: the collective, the group and its ranks, then the backend's error.
    named = re.search(r"veragged: (all_gather|reduce_scatter|all_reduce) on process group "
                      r"\S+ \(.*global ranks \[0, 1\], rank 0 of 2\) failed: ", err)
    assert named, err
    assert f"step     {STEP - 1}" in out and f"step     {STEP} " not in out, out
    # Step 2's checkpoint is whole; step 4 was never saved, let alone completed.
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2"], list(ckpt.iterdir())
    assert (ckpt / "step-2" / ".metadata").is_file()
    print(f"{where}: rank 0 exited {took:.1f} s after rank 1 died: {named[0]}")
