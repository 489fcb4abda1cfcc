"""The harness's device choice (tests.harness.device): VERAGGED_TEST_DEVICE picks cpu or
cuda; a GPU run skips what it cannot hold, and collects and skips cleanly without a GPU."""

import os
import pathlib
import subprocess
import sys
import unittest

import pytest
import torch

from tests.harness import device as harness
from tests.harness.pool import get_pool

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_device_from_the_environment(monkeypatch):
    monkeypatch.delenv(harness.ENV, raising=False)
    assert harness.test_device() == "cpu"
    monkeypatch.setenv(harness.ENV, " CUDA ")
    assert harness.test_device() == "cuda"
    monkeypatch.setenv(harness.ENV, "tpu")
    with pytest.raises(ValueError, match="VERAGGED_TEST_DEVICE='tpu'"):
        harness.test_device()


def test_backends():
    assert harness.backend_for("cpu") == "gloo"
    assert harness.backend_for("cuda") == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="'xla'"):
        harness.backend_for("xla")


def _rank_device():
    return harness.rank_device_type(), torch.empty(1).device.type


def test_cpu_ranks_report_their_device():
    assert get_pool(2, device="cpu").run(_rank_device) == [("cpu", "cpu")] * 2


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="enough GPUs for 8 ranks here")
def test_more_ranks_than_gpus_is_a_skip():
    with pytest.raises(unittest.SkipTest, match="8 rank\\(s\\) need as many GPUs"):
        get_pool(8, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the suite runs on it")
def test_gpu_harness_without_a_gpu_skips_everything():
    env = {**os.environ, harness.ENV: "cuda"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/benchmarks/test_trace_overlap.py", "tests/fsdp/test_ep.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed" not in out.stdout and "failed" not in out.stdout, out.stdout
    assert "no CUDA device visible" in out.stdout, out.stdout
