"""How many threads torch's CPU kernels use: the CPUs this process may run on.

torch sizes its OpenMP pool from the machine's cores, not from the CPUs the process is
allowed (``taskset``, a container's cpuset); threads beyond those contend for the same
CPUs and spin at every barrier, and decoding ran 7-18x slower than with one thread.
``OMP_NUM_THREADS``, when set, is the user's choice and is left alone (set it to 1 on a
CPU shared with other busy work).
"""

import os

from tokenspeed.cores import allowed_cpus


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
