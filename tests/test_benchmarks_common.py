"""The benchmarks' shared pieces that decide what a figure means."""

import pytest

from benchmarks import common
from tokenspeed.backends.kernels import triton_decode


def test_skipped_kernels_launch_nothing_and_come_back():
    """A kernel named for ``--skip-kernels`` launches nothing inside the block (whatever its
    grid and arguments), and is the package's own kernel again after it, even on an error."""
    kernel = triton_decode._combine_kernel
    with common.kernels_skipped(["triton_decode._combine_kernel"]):
        assert triton_decode._combine_kernel is not kernel
        assert triton_decode._combine_kernel[(3, 2)]("any", num_warps=2) is None
    assert triton_decode._combine_kernel is kernel
    with pytest.raises(KeyError), common.kernels_skipped(["triton_decode._combine_kernel"]):
        raise KeyError("a failed run")
    assert triton_decode._combine_kernel is kernel


@pytest.mark.parametrize("name", ["triton_decode._no_such_kernel", "no_module._kernel", "bare"])
def test_skipping_an_unknown_kernel_is_refused_by_name(name):
    kernel = triton_decode._combine_kernel
    with pytest.raises(ValueError, match=name), common.kernels_skipped(["triton_decode._combine_kernel", name]):
        pass
    assert triton_decode._combine_kernel is kernel


def test_the_host_is_named_by_its_cpu_model_and_usable_cores():
    from pathlib import Path

    from tokenspeed.cores import allowed_cpus
    model, cores = common.host_name().rsplit(", ", 1)
    assert cores == f"{allowed_cpus()} cores"
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    assert model == "an unnamed CPU" or f": {model}\n" in text
