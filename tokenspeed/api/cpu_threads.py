"""How many threads torch's CPU kernels use: the CPUs this process may run on.

torch sizes its OpenMP pool from the machine's cores, not from the CPUs the process is
allowed (``taskset``, a container's cpuset); threads beyond those contend for the same
CPUs and spin at every barrier, and decoding ran 7-18x slower than with one thread.
``OMP_NUM_THREADS``, when set, is the user's choice and is left alone (set it to 1 on a
CPU shared with other busy work).
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


def size_torch_threads(environ=os.environ) -> int | None:
    """Set torch's intra-op threads to ``allowed_cpus()`` unless ``OMP_NUM_THREADS`` is
    set; returns the count it set (None when it left torch alone)."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    import torch
    threads = allowed_cpus()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
