"""Known veragged failures of the conformance suite, tracked as strict xfails.

`known_failures.txt` lists the node ids (one per line, `# reason` after) of ported torch tests
that torch's `fully_shard` passes and `veragged.fully_shard` does not pass yet. Each is marked
`xfail(strict=True)`: it must fail (so the list cannot hide a regression elsewhere) and a test
that starts passing fails the run until its line is removed. The list only shrinks.
"""

from __future__ import annotations

import os
import pathlib

import pytest

_LIST = pathlib.Path(__file__).with_name("known_failures.txt")


def _known() -> dict[str, str]:
    known = {}
    if _LIST.exists():
        for line in _LIST.read_text().splitlines():
            test, _, reason = line.partition("#")
            if test.strip():
                known[test.strip()] = reason.strip() or "known veragged failure"
    return known


def pytest_collection_modifyitems(config, items):
    known = _known()
    for item in items:
        name = item.nodeid.split("tests/fsdp_conformance/")[-1]
        if name in known:
            item.add_marker(pytest.mark.xfail(strict=True, reason=known[name]))

# The suite runs when VERAGGED_CONFORMANCE=1. It is not in the default run yet: its list of known
# veragged failures has not been triaged (see README.md); the lifecycle regression tests in
# tests/fsdp/test_lifecycle.py run by default.
if os.environ.get("VERAGGED_CONFORMANCE") != "1":
    collect_ignore_glob = ["test_*.py"]
