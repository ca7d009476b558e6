"""The CPUs this process may run on, which every pool of threads is sized from.

``os.cpu_count()`` counts the machine's cores, not the ones the process is allowed
(``taskset``, a container's cpuset or CPU quota); threads beyond those contend for the
same CPUs and spin while they wait (torch's intra-op pool, llguidance's workers, the
kernel compile workers).
"""

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")   # a container's own cgroup (v2, in its cgroup namespace)


def allowed_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one), fewer
    where its container's CPU quota allows less (``docker --cpus``: the affinity still
    names every core of the host)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return cpus if quota is None else max(1, min(cpus, quota))


def cpu_quota(cgroup: Path = CGROUP) -> int | None:
    """The CPUs a cgroup v2 ``cpu.max`` grants, rounded up; None without a quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
        return None if quota == "max" else -(-int(quota) // int(period))
    except (OSError, ValueError):
        return None
