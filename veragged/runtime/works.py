"""Works whose failed `wait` names the collective and its group.

[Note: failed collectives]
The DBuffer's collectives (veragged/dbuffer/comms.py, and the HSDP all-reduce in grads.py)
return `NamedWork`s: when waiting fails (a
peer died, gloo's connection closed or the process group's timeout passed), the error is
raised again as the same type with the collective and its group in front, e.g.
`veragged: all_gather on process group 1 ("default_pg", global ranks [0, 1], rank 0 of 2)
failed: <the backend's error>`, since gloo's own names neither. Nothing else changes.
They live in the runtime, which waits on every collective, so what a backend runs inside its
`wait` (gloo's emulation of reduce-scatter, say) is counted where it was before by
`LaunchCounter`/`WriteCounter`: not as FSDP's own work.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["NamedWork", "describe", "named"]


class NamedWork:
    """A collective's work whose failed `wait` names the collective and its group
    ([Note: failed collectives]); everything else goes to the work."""

    __slots__ = ("work", "collective", "group")

    def __init__(self, work, collective: str, group: dist.ProcessGroup):
        self.work, self.collective, self.group = work, collective, group

    def wait(self, *args, **kwargs):
        try:
            return self.work.wait(*args, **kwargs)
        except RuntimeError as err:
            msg = f"veragged: {self.collective} on {describe(self.group)} failed: {err}"
            try:
                named_err = type(err)(msg)
            except Exception:  # an error type that takes other arguments
                named_err = RuntimeError(msg)
            raise named_err from err

    def __getattr__(self, name):
        return getattr(self.work, name)


def describe(group: dist.ProcessGroup) -> str:
    """`process group <name> ("<desc>", global ranks [...], rank r of n)`, as far as known."""
    parts = []
    try:
        desc = group.group_desc
        if desc and desc != "undefined":
            parts.append(f'"{desc}"')
    except Exception:
        pass
    try:
        parts.append(f"global ranks {dist.get_process_group_ranks(group)}")
    except Exception:
        pass
    try:
        parts.append(f"rank {group.rank()} of {group.size()}")
    except Exception:
        pass
    try:
        name = group.group_name
    except Exception:
        name = "?"
    return f"process group {name} ({', '.join(parts)})"


def named(work, collective: str, group: dist.ProcessGroup):
    """`work` (None stays None) as a `NamedWork`."""
    return None if work is None else NamedWork(work, collective, group)
