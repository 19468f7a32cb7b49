"""What this host gives the process: the one place defaults sized by the machine read it from."""

from __future__ import annotations

import os


def cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset, not the machine's count)."""
    return len(os.sched_getaffinity(0))
