"""The CPUs this process may run on."""

from __future__ import annotations

import os

# OpenMP settings that bind threads to cores: a bound thread's own mask is one core,
# not what the process may use
_BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
_CGROUP_CPUSET = "/sys/fs/cgroup/cpuset.cpus.effective"


def usable_cpu_set() -> frozenset[int]:
    """The cores this process may run on: its affinity mask (`taskset`, a
    container's cpuset), not the machine's count, which can be far larger. Where
    OpenMP binds threads (the mask then says one core), the cgroup's cpuset, else
    every core of the machine."""
    bind_off = os.environ.get("OMP_PROC_BIND", "").strip().lower() == "false"   # whatever the others say
    if bind_off or not any(_binds(name, os.environ.get(name, "")) for name in _BINDING_VARIABLES):
        try:
            return frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):    # platforms without affinity masks
            pass
    return _cgroup_cpuset() or frozenset(range(os.cpu_count() or 1))


def _binds(variable: str, value: str) -> bool:
    """Whether this OpenMP setting binds threads: any value but an off switch
    (OMP_PROC_BIND=false, KMP_AFFINITY=disabled or none)."""
    value = value.strip().lower()
    if variable == "OMP_PROC_BIND":
        return value not in ("", "false")
    if variable == "KMP_AFFINITY":
        return bool(value) and not {"disabled", "none"} & {part.strip() for part in value.split(",")}
    return bool(value)


def usable_cpus() -> int:
    return max(1, len(usable_cpu_set()))


def _cgroup_cpuset() -> frozenset[int] | None:
    """The cores cgroup v2 allows this process ("0-3,6" in cpuset.cpus.effective), if it says."""
    try:
        with open(_CGROUP_CPUSET) as f:
            text = f.read().strip()
    except OSError:
        return None
    cores: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return frozenset(cores) or None
