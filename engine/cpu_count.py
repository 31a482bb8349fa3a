"""The CPUs this process may run on, and how many of them it may keep busy."""

from __future__ import annotations

import math
import os
from pathlib import Path

# OpenMP settings that bind threads to cores: a bound thread's own mask is one core,
# not what the process may use
_BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
_CGROUP_CPUSET = "cpuset.cpus.effective"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


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
    """The cores this process may keep busy: its usable cores, at most its cgroup's
    CPU quota (a container's `--cpus`, a Kubernetes CPU limit), which leaves every
    core in the affinity mask and throttles the process past it; at least 1."""
    cores = len(usable_cpu_set())
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.floor(quota)) if quota is not None else cores)


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period the cgroups over this process allow (the least
    of its own and its ancestors', cgroup v2's cpu.max or v1's cfs quota), or None
    where none is set or none can be read."""
    found = [_quota_v2(d) for d in _own_cgroup_v2_dirs()]
    found += [_quota_v1(_CGROUP_ROOT / folder) for folder in ("cpu", "cpu,cpuacct")]
    return min((q for q in found if q is not None), default=None)


def _own_cgroup_v2_dirs() -> list[Path]:
    """The cgroup v2 folders of this process's cgroup and its ancestors (the root
    of the namespace's hierarchy when /proc/self/cgroup names none)."""
    own = "/"
    try:
        for line in _PROC_CGROUP.read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:] or "/"
    except OSError:
        pass
    folder = _CGROUP_ROOT / own.lstrip("/")
    return [folder, *[p for p in folder.parents if p.is_relative_to(_CGROUP_ROOT)]]


def _quota_v2(folder: Path) -> float | None:
    """cpu.max's "QUOTA PERIOD" in `folder` as CPUs (None: "max", no such file)."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _quota_v1(folder: Path) -> float | None:
    """cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us in `folder` as CPUs (None: -1, no such files)."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _cgroup_cpuset() -> frozenset[int] | None:
    """The cores cgroup v2 allows this process ("0-3,6" in its own cgroup's
    cpuset.cpus.effective, else the nearest ancestor's that has one), if it says."""
    for folder in _own_cgroup_v2_dirs():
        try:
            text = (folder / _CGROUP_CPUSET).read_text().strip()
            break
        except OSError:
            continue
    else:
        return None
    cores: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return frozenset(cores) or None
