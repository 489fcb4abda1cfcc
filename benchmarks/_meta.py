"""What every benchmark's JSON line records about the code it ran."""

from __future__ import annotations

import subprocess

__all__ = ["commit_id"]


def commit_id() -> str:
    """The short commit of the working tree, `+dirty` when tracked files differ from it."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
