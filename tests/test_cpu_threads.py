"""torch's CPU threads are the CPUs this process may run on, unless OMP_NUM_THREADS says
otherwise (threads past the allowed CPUs spin against each other)."""

import os

import pytest
import torch

from tokenspeed.api.cpu_threads import size_torch_threads
from tokenspeed.cores import allowed_cpus, cpu_quota


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity mask on this OS")
def test_threads_follow_the_affinity_mask(restore_threads):
    assert allowed_cpus() == len(os.sched_getaffinity(0))
    torch.set_num_threads(allowed_cpus() + 3)
    assert size_torch_threads({}) == allowed_cpus() == torch.get_num_threads()


def test_omp_num_threads_is_left_alone(restore_threads):
    torch.set_num_threads(1)
    assert size_torch_threads({"OMP_NUM_THREADS": "4"}) is None and torch.get_num_threads() == 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity mask on this OS")
def test_an_llm_sizes_the_threads(restore_threads, monkeypatch):
    import tokenspeed as ts
    from text_models import text_model_dir
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(allowed_cpus() + 3)
    ts.LLM(text_model_dir(), num_kv_pages=8)
    assert torch.get_num_threads() == allowed_cpus()


@pytest.mark.parametrize("cpu_max, quota", [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1),
                                            ("200000 100000\n", 2), ("garbled", None), (None, None)])
def test_a_containers_cpu_quota_bounds_the_threads(tmp_path, cpu_max, quota):
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max)
    assert cpu_quota(tmp_path) == quota
    assert allowed_cpus(tmp_path) == (allowed_cpus(tmp_path / "none") if quota is None
                                      else min(quota, allowed_cpus(tmp_path / "none")))
