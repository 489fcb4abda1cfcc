"""benchmarks/trace_overlap.py: the NCCL time a GPU step hides behind compute, on made-up traces
(the profiler itself needs a GPU: tests/cuda and scripts/gpu_check.sh run it there)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from trace_overlap import overlap  # noqa: E402


def test_fully_hidden_partly_hidden_and_exposed():
    r = overlap([
        ("ncclDevKernel_AllGather_RING_LL", 0, 10),  # under the GEMM: hidden
        ("sm90_xmma_gemm", 0, 20),
        ("ncclDevKernel_ReduceScatter_Sum_f32", 15, 30),  # 5 hidden, 10 exposed
        ("ncclKernel_AllReduce", 40, 45),  # alone: exposed
    ])
    assert r["nccl_us"] == 10 + 15 + 5
    assert r["compute_us"] == 20
    assert r["hidden_us"] == 10 + 5
    assert r["exposed_us"] == 15
    assert r["hidden"] == pytest.approx(0.5)
    assert r["nccl_kernels"] == 3


def test_overlapping_kernels_on_one_side_count_once():
    # two compute streams at once, and two NCCL kernels at once: each side's union counts
    r = overlap([
        ("gemm_a", 0, 10), ("elementwise_b", 5, 15),
        ("ncclDevKernel_AllGather", 8, 20), ("nccl_ReduceScatter", 9, 12),
    ])
    assert r["compute_us"] == 15
    assert r["nccl_us"] == 12
    assert r["hidden_us"] == 7
    assert r["hidden"] == pytest.approx(7 / 12)


def test_no_nccl_and_empty_trace():
    assert overlap([("gemm", 0, 5)])["hidden"] == 1.0
    r = overlap([])
    assert (r["nccl_us"], r["compute_us"], r["hidden_us"]) == (0, 0, 0)


def test_bad_interval_names_the_kernel():
    with pytest.raises(ValueError, match="'gemm' ends"):
        overlap([("gemm", 5, 1)])
