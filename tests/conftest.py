"""The suite's shared setup. ``make test`` spreads the tests over the CPUs this process
may use (pytest-xdist's ``-n auto``): most tests are bound by Python's one thread, and on
CI's two cores the suite took twice as long in one process. Each worker then gets its
share of torch's threads (``OMP_NUM_THREADS``, which engines and their subprocesses
respect): threads past the CPUs spin against each other. With a GPU the tests stay in one
process, since engines size their caches from the device's free memory."""

import os

import pytest
import torch

GIB_PER_WORKER = 3   # a worker's peak (seen: 2.7 GB, with models and a Triton cache held at once)

# Triton kernels run on the CPU through the interpreter; it must be set before triton
# decorates any kernel, so before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenspeed.cores import CGROUP, allowed_cpus  # noqa: E402  (after TRITON_INTERPRET)

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):   # a worker beside others: its share of the CPUs
    share = max(1, allowed_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    if not os.environ.get("OMP_NUM_THREADS", "").isdigit():   # the user's own count stands
        os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per allowed CPU that memory holds, none with a GPU;
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it, as it does xdist's own count."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if torch.cuda.is_available():
        return 0
    return max(1, min(allowed_cpus(), _memory_bytes() // (GIB_PER_WORKER * 2**30)))


def _memory_bytes() -> int:
    """The machine's memory, or its container's limit (cgroup v2 ``memory.max``) if less."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        return min(memory, int((CGROUP / "memory.max").read_text()))
    except (OSError, ValueError):   # no such file, or "max"
        return memory
