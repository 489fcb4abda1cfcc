"""Count what the FSDP2 conformance suite runs on veragged, from pytest's own collection.

    python scripts/conformance_coverage.py            # totals per file kind and status
    python scripts/conformance_coverage.py -v         # ... and every test that does not run

Collects tests/fsdp_conformance with VERAGGED_CONFORMANCE=all (nothing runs) and classifies each
`_veragged` test the way a run would treat it: `torch_only` (skipped, the mark in
tests/harness/conformance.py), `xfail` (known_failures.txt, conftest.py), `skipped` (any other
collection-time skip) or `runs`; a module the installed torch cannot import (conftest.py's
`_Port`) is counted per test it defines, as `module skipped`. A test that skips itself while
running (e.g. one that needs Triton) counts as `runs`. Parametrized tests count once per case.
A `torch_only` port is covered when a test_adapted_*.py test of the same name runs.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import io
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "fsdp_conformance"


def _defined_tests(path: pathlib.Path) -> int:
    """Test methods a module defines on its test classes (for a module that cannot import)."""
    tree = ast.parse(path.read_text())
    return sum(
        1 for cls in tree.body if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_")
        for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")
    )


class _Classify:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []  # (kind, status, node id)
        self.skipped_modules: dict[str, str] = {}

    def pytest_collectreport(self, report) -> None:
        if report.skipped and report.nodeid.endswith(".py"):
            self.skipped_modules[report.nodeid] = str(report.longrepr[-1])

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            path, _, rest = item.nodeid.rpartition("::")[0].partition("::")
            if not rest.endswith("_veragged"):
                continue
            if getattr(item.obj, "__unittest_skip__", False):
                why = item.obj.__unittest_skip_why__
                status = "torch_only" if why.startswith("torch_only") else "skipped"
            elif item.get_closest_marker("xfail") is not None:
                status = "xfail"
            else:
                status = "runs"
            self.rows.append((_kind(path), status, item.nodeid))


def _kind(nodeid_path: str) -> str:
    return "adapted" if pathlib.Path(nodeid_path).name.startswith("test_adapted_") else "port"


def main() -> int:
    verbose = "-v" in sys.argv[1:]
    os.environ["VERAGGED_CONFORMANCE"] = "all"
    os.environ.pop("VERAGGED_CONFORMANCE_TORCH_ONLY", None)
    plugin = _Classify()
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))  # as `python -m pytest` from the root
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(SUITE)],
                         plugins=[plugin])
    if rc != 0:
        print(out.getvalue())
        return int(rc)
    counts: collections.Counter = collections.Counter((k, s) for k, s, _ in plugin.rows)
    for nodeid, reason in sorted(plugin.skipped_modules.items()):
        counts[(_kind(nodeid), "module skipped")] += _defined_tests(ROOT / nodeid)
    print(f"\nveragged variants, torch {__import__('torch').__version__}:")
    for kind in ("port", "adapted"):
        total = sum(n for (k, _), n in counts.items() if k == kind)
        parts = ", ".join(f"{s} {n}" for (k, s), n in sorted(counts.items()) if k == kind)
        print(f"  {kind:8s} {total:4d}: {parts}")
    adapted = {n.rpartition("::")[2] for k, s, n in plugin.rows if k == "adapted" and s == "runs"}
    uncovered = [n for k, s, n in plugin.rows
                 if k == "port" and s == "torch_only" and n.rpartition("::")[2] not in adapted]
    print(f"  torch_only ports without an adapted copy that runs on veragged: {len(uncovered)}")
    for nodeid in uncovered:
        print(f"    {nodeid}")
    if verbose:
        for kind, status, nodeid in sorted(plugin.rows):
            if status != "runs":
                print(f"  {status:10s} {nodeid}")
        for nodeid, reason in sorted(plugin.skipped_modules.items()):
            print(f"  module skipped {nodeid}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
