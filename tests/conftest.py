"""The suite's device: `VERAGGED_TEST_DEVICE=cpu` (default) or `cuda` (tests.harness.device).

On `cuda` the ranks of every pool run on GPUs with NCCL, and this process makes new tensors on
GPU 0. Tests that only make sense on the CPU say why here (`CPU_ONLY`, by path) or with
`@pytest.mark.cpu_only("why")`, and are skipped; with no GPU visible every test is skipped, so
the GPU harness collects and skips cleanly on a CPU machine.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.device import ENV, test_device

# Path (relative to tests/, a prefix) -> why it only makes sense on the CPU.
CPU_ONLY = {
    "clients/": "the client stacks run in CPU pools of their own (torchtitan's CPU patches, "
                "gloo), launched as their users launch them on a CPU machine",
    "benchmarks/test_lora_bytes.py": "runs benchmarks/lora_bytes.py, a CPU benchmark",
    "benchmarks/test_optim_matrix.py": "runs benchmarks/optim_matrix.py, a CPU benchmark",
    "benchmarks/test_host_profile.py": "runs benchmarks/host_profile.py, a CPU profile",
    "benchmarks/test_async_precondition.py": "runs benchmarks/async_precondition.py, a CPU "
                                             "benchmark",
    "runtime/test_happens_before.py": "the recorder stands in for the streams to prove their "
                                      "orderings on the CPU; on a GPU the streams themselves "
                                      "run (tests/cuda)",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_only(reason): the test only makes sense on the CPU; skipped under "
                   f"{ENV}=cuda")
    if test_device() == "cuda" and torch.cuda.is_available():
        torch.set_default_device("cuda:0")


def pytest_collection_modifyitems(config, items):
    if test_device() != "cuda":
        return
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason=f"{ENV}=cuda: no CUDA device visible")
        for item in items:
            item.add_marker(skip)
        return
    root = config.rootpath / "tests"
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        reason = marker and (marker.args[0] if marker.args else "CPU only")
        if reason is None:
            try:
                rel = item.path.relative_to(root).as_posix()
            except ValueError:
                continue
            reason = next((why for prefix, why in CPU_ONLY.items() if rel.startswith(prefix)),
                          None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}"))
