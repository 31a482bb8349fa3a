"""The CPUs this process may run on."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on: its affinity mask (`taskset`, a
    container's cpuset), not the machine's count, which can be far larger."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):    # platforms without affinity masks
        return os.cpu_count() or 1
