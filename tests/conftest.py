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

from tokenspeed.api.cpu_threads import allowed_cpus  # noqa: E402  (after TRITON_INTERPRET)

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):   # a worker beside others
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, allowed_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per allowed CPU that memory holds, none with a GPU."""
    if torch.cuda.is_available():
        return 0
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    return max(1, min(allowed_cpus(), memory_gib // GIB_PER_WORKER))
