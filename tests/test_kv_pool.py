"""KV pool sizing and rebinding (issue 15): a byte budget sizes the pool, a rebind over a pool
of another size is a fresh compile over it, and a pool of another geometry is refused before
anything moves."""

import re
import weakref

import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed import stages
from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.execution import kv_pool
from tokenspeed.execution.compile_config import CompileConfig
from tokenspeed.execution.sampler import RowSampling

from margins import decisive_model

ROW = RowSampling(ts.SamplingParams(temperature=0.0), seed=0)
PAGE = 4


@pytest.fixture(scope="module")
def model():
    return decisive_model(seed=3)


@pytest.fixture(scope="module")
def llm(model):
    return ts.LLM(model, max_num_seqs=4, max_num_batched_tokens=64, page_size=PAGE, max_model_len=64,
                  num_kv_pages=40, graphs=True)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 1 << 22), max_num_seqs=st.integers(1, 64), pages_per_sequence=st.integers(1, 64))
def test_a_byte_budget_takes_the_most_pages_it_holds_up_to_every_sequence_at_full_length(
        budget, max_num_seqs, pages_per_sequence):
    geometry = kv_pool.PoolGeometry(2, PAGE, 2, 8, torch.float32, "cpu")
    config = CompileConfig(max_num_seqs=max_num_seqs, kv_cache_memory_bytes=budget)
    wanted = kv_pool.wanted_pages(max_num_seqs, pages_per_sequence)
    fits = budget // geometry.page_bytes
    if min(wanted, fits) < 2:
        with pytest.raises(ValueError, match=f"kv_cache_memory_bytes={budget}.*2 pages"):
            kv_pool.sized_by_bytes(config, geometry, pages_per_sequence)
        return
    sizing = kv_pool.sized_by_bytes(config, geometry, pages_per_sequence)
    assert sizing.num_pages * geometry.page_bytes <= budget and sizing.num_pages <= wanted
    assert sizing.num_pages == wanted or (sizing.num_pages + 1) * geometry.page_bytes > budget
    assert sizing.max_full_length_sequences == (sizing.num_pages - 1) // pages_per_sequence


@given(pages=st.integers(2, 10**9), max_num_seqs=st.integers(1, 64), pages_per_sequence=st.integers(1, 64))
def test_a_page_count_is_kept_up_to_every_sequence_at_full_length(pages, max_num_seqs, pages_per_sequence):
    """``num_kv_pages=10**9`` allocated 8 TB on a probe; no pool is larger than the engine uses."""
    geometry = kv_pool.PoolGeometry(2, PAGE, 2, 8, torch.float32, "cpu")
    config = CompileConfig(max_num_seqs=max_num_seqs, num_kv_pages=pages)
    sizing = kv_pool.sized_by_bytes(config, geometry, pages_per_sequence)
    assert sizing.num_pages == min(pages, kv_pool.wanted_pages(max_num_seqs, pages_per_sequence))


@pytest.mark.parametrize("options, rule", [
    (dict(num_kv_pages=10**6), "by max_num_seqs=4 sequences at full length; num_kv_pages=1000000 allows more"),
    (dict(kv_cache_memory_bytes=1 << 30),
     "by max_num_seqs=4 sequences at full length; kv_cache_memory_bytes=1073741824 allows more"),
    (dict(), "by max_num_seqs=4 sequences at full length; the CPU's default budget of 512.00 MiB allows more"),
    (dict(num_kv_pages=20), "by num_kv_pages=20)"),
    (dict(kv_cache_memory_bytes=20 * 256), "by kv_cache_memory_bytes=5120)"),
])
def test_the_report_names_what_set_the_pools_size(options, rule):
    """A pool cut to every sequence at full length is reported so: "2049 pages, by the
    CPU's default budget" misread a 16 MiB pool as the 512 MiB budget's."""
    geometry = kv_pool.PoolGeometry(2, PAGE, 2, 8, torch.float32, "cpu")   # 256-byte pages
    sizing = kv_pool.sized_by_bytes(CompileConfig(max_num_seqs=4, **options), geometry, pages_per_sequence=8)
    assert rule in sizing.as_text()


@pytest.mark.parametrize("options, fragment", [
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0: must be in (0, 1]"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5: must be in (0, 1]"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes=0: must be >= 1"),
    (dict(kv_cache_memory_bytes=1000), "kv_cache_memory_bytes=1000 leaves"),
    (dict(num_kv_pages=8, kv_cache_memory_bytes=10**6), "num_kv_pages=8 and kv_cache_memory_bytes=1000000 both "
                                                      "size the KV pool: give one"),
])
def test_bad_pool_budgets_are_named(model, options, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        ts.LLM(model, page_size=PAGE, max_model_len=64, **options)


def test_the_startup_report_says_what_the_pool_holds(model):
    llm = ts.LLM(model, page_size=PAGE, max_num_seqs=3, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    pool = llm.compiled.pool
    assert pool.num_pages == llm.compiled.num_pages == 3 * 16 + 1   # every sequence at full length
    assert pool.max_full_length_sequences == 3
    assert "49 pages" in llm.compiled.as_text() and "3 sequences at full length" in llm.compiled.as_text()


def snapshot(compiled) -> dict:
    """Every buffer a step reads or writes, by address, and the cache's contents."""
    decode, prefill = compiled.decode, compiled.prefill
    buffers = {"kv_cache": compiled.kv_cache, "decode.slots": decode.slots.device_bytes,
               "decode.sampling": decode.sampling.device_bytes, "decode.out": decode.out,
               "prefill.slots": prefill.slots.device_bytes}
    return {"addresses": {n: t.data_ptr() for n, t in buffers.items()},
            "graphs": (dict(decode.graphs), dict(prefill.graphs.graphs)),
            "views": {n: v.data_ptr() for n, v in decode.slots.view(4).items()},
            "cache": compiled.kv_cache.clone()}


BAD_GEOMETRY = {"page_size": 2 * PAGE, "num_kv_heads": 1, "head_dim": 4, "num_layers": 1,
                "dtype": torch.float64}


@pytest.mark.parametrize("field", sorted(BAD_GEOMETRY))
def test_a_rejected_rebind_moves_nothing(llm, field):
    rows = decode_tokens(llm.compiled, 2)            # the cache holds requests' keys now
    before = snapshot(llm.compiled)
    geometry = attrs.evolve(llm.compiled.binding.geometry, **{field: BAD_GEOMETRY[field]})
    with pytest.raises(ValueError, match=f"does not fit this cache group: {field} "):
        llm.compiled.rebind(kv_pool.allocate(geometry, 40))
    after = snapshot(llm.compiled)
    assert after["addresses"] == before["addresses"] and after["views"] == before["views"]
    assert after["graphs"][0] == before["graphs"][0] and after["graphs"][1] == before["graphs"][1]
    assert torch.equal(after["cache"], before["cache"])
    assert decode_tokens(llm.compiled, 2) == rows     # and it serves as before


def test_a_pool_without_the_null_page_and_another_is_refused(llm):
    with pytest.raises(ValueError, match="at least 2 pages"):
        llm.compiled.rebind(kv_pool.allocate(llm.compiled.binding.geometry, 1))


@pytest.mark.parametrize("num_pages", [17, 90])
def test_a_rebound_engine_generates_what_a_fresh_one_does(model, llm, num_pages):
    rebound = llm.compiled.rebind(kv_pool.allocate(llm.compiled.binding.geometry, num_pages))
    fresh = ts.LLM(model, max_num_seqs=4, max_num_batched_tokens=64, page_size=PAGE, max_model_len=64,
                   num_kv_pages=num_pages, graphs=True).compiled
    assert rebound.num_pages == rebound.pool.num_pages == num_pages
    assert rebound.kv_cache.data_ptr() != llm.compiled.kv_cache.data_ptr()
    assert set(rebound.decode.graphs) == set(fresh.decode.graphs) and rebound.decode.graphs
    assert set(rebound.prefill.graphs) == set(fresh.prefill.graphs)
    assert decode_tokens(rebound, 3) == decode_tokens(fresh, 3)


@torch.inference_mode()
def decode_tokens(compiled, n: int, steps: int = 5) -> list[list[int]]:
    """``n`` prompts prefilled and decoded ``steps`` times through the runners (graphs where
    captured); every request's tokens."""
    pages_each = -(-(12 + steps) // PAGE)
    rows, out = [], []
    for i in range(n):
        prompt = tuple((5 + 7 * i + j) % 300 for j in range(9 + i))
        pages = tuple(range(1 + i * pages_each, 1 + (i + 1) * pages_each))
        [token] = compiled.prefill.run([ExtendChunk(prompt, 0, pages, True)], [ROW])
        rows.append(DecodeRow(token, len(prompt), pages))
        out.append([token])
    for _ in range(steps):
        tokens = compiled.decode.run(rows, [ROW] * n)
        rows = [DecodeRow(t, r.position + 1, r.pages) for t, r in zip(tokens, rows)]
        for seq, t in zip(out, tokens):
            seq.append(t)
    return out


class FakeDevice:
    """The GPU's memory as ``mem_get_info`` reports it, on the CPU: ``total`` bytes, of which
    ``base`` are held (weights, graphs) plus every KV pool still alive."""

    def __init__(self, monkeypatch, total: int, base: int, captured: int = 0):
        """``captured``: bytes the device holds besides ``base`` after the first question
        (what the graphs take, unknown before they are captured)."""
        self.total, self.base, self.pools, self.asked = total, base, weakref.WeakSet(), 0
        self.captured = captured
        allocate = kv_pool.allocate
        monkeypatch.setattr(kv_pool, "allocate", lambda *a: self._keep(allocate(*a)))
        monkeypatch.setattr(kv_pool, "sized_by_bytes", lambda config, *a, **kw: None if config.num_kv_pages is None
                            else kv_pool.PoolSizing(config.num_kv_pages, 1, 1, "num_kv_pages"))
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)

    def _keep(self, pool):
        self.pools.add(pool)
        return pool

    def mem_get_info(self, device):
        held = self.base + (self.captured if self.asked else 0)
        self.asked += 1
        return self.total - held - sum(p.numel() * p.element_size() for p in self.pools), self.total


OPTIONS = dict(max_num_seqs=200, max_num_batched_tokens=64, page_size=PAGE, max_model_len=64, graphs=True)


def test_a_pool_sized_by_utilization_is_rebound_after_a_probe(model, monkeypatch):
    """The GPU's sequence, on the CPU stand-in with a pretend device: the probe pool holds
    one full-length request; measured while it lives, what the device holds besides it is
    what the engine holds besides any pool; the pool bound after the captures fills the
    share that leaves, and generates as a fresh engine of that many pages."""
    device = FakeDevice(monkeypatch, total=1 << 30, base=610 << 20)   # 0.6 leaves ~4.4 MiB
    llm = ts.LLM(model, gpu_memory_utilization=0.6, **OPTIONS)
    pool = llm.compiled.pool
    assert device.asked == 2 and pool.probe_pages == 64 // PAGE + 1
    assert pool.non_kv_bytes == device.base and list(device.pools) == [llm.compiled.kv_cache]
    assert pool.num_pages == int(device.total * 0.6 - device.base) // pool.page_bytes < 200 * 16 + 1
    assert "sized after a probe pool of 17 pages" in llm.compiled.as_text()
    monkeypatch.undo()
    fresh = ts.LLM(model, num_kv_pages=pool.num_pages, **OPTIONS).compiled
    assert decode_tokens(llm.compiled, 3) == decode_tokens(fresh, 3)


SMALL = dict(OPTIONS, max_num_seqs=4)


def test_a_first_pool_of_every_sequence_that_the_measurement_keeps_is_bound_once(model, monkeypatch):
    """Where every sequence at full length takes at most half of the free share, that pool
    is bound first; measured after the captures it is what the share allows, so it is kept:
    no second binding, and it generates as a fresh engine of that many pages."""
    device = FakeDevice(monkeypatch, total=1 << 30, base=100 << 20)
    binds = count_binds(monkeypatch)
    llm = ts.LLM(model, gpu_memory_utilization=0.6, **SMALL)
    pool, wanted = llm.compiled.pool, 4 * (64 // PAGE) + 1
    assert len(binds) == 1 and device.asked == 2
    assert pool.num_pages == pool.probe_pages == wanted and pool.rebind_seconds == 0
    assert pool.non_kv_bytes == device.base and "kept after its graphs were captured" in llm.compiled.as_text()
    monkeypatch.undo()
    fresh = ts.LLM(model, num_kv_pages=wanted, **SMALL).compiled
    assert decode_tokens(llm.compiled, 3) == decode_tokens(fresh, 3)


def test_a_first_pool_the_measurement_does_not_keep_is_rebound_to_the_share(model, monkeypatch):
    """The captures took more than the first pool left room for: the pool is rebound to what
    the share allows beside them, as after a probe."""
    geometry = kv_pool.geometry_for(model.config, PAGE, torch.float32, "cpu")
    wanted = 4 * (64 // PAGE) + 1
    share = int((1 << 30) * 0.6)
    base = share - 3 * wanted * geometry.page_bytes      # the first pool is every sequence ...
    captured = 3 * wanted * geometry.page_bytes - 10 * geometry.page_bytes   # ... then 10 pages fit
    device = FakeDevice(monkeypatch, total=1 << 30, base=base, captured=captured)
    binds = count_binds(monkeypatch)
    llm = ts.LLM(model, gpu_memory_utilization=0.6, **SMALL)
    pool = llm.compiled.pool
    assert binds == [wanted, 10] and pool.probe_pages == wanted and pool.num_pages == 10
    assert pool.non_kv_bytes == base + captured
    assert f"sized after a probe pool of {wanted} pages" in llm.compiled.as_text()


def count_binds(monkeypatch) -> list[int]:
    """The pages of every pool bound, in order."""
    pages, bind = [], stages.Binding.bind
    monkeypatch.setattr(stages.Binding, "bind",
                        lambda self, pool, *a: pages.append(pool.shape[2]) or bind(self, pool, *a))
    return pages


def test_a_draft_model_s_pool_holds_as_many_pages_as_the_target_s_from_one_budget(model, monkeypatch):
    """The budget pays for a page of both pools at once: the target's probe (with the draft's
    stand-in pool of 2 pages alive) leaves room for as many draft pages as target pages, and
    the draft's pool is rebound to that many. Sized one after the other, the first would
    take the whole share and the second fail."""
    draft_model = decisive_model(seed=4)
    device = FakeDevice(monkeypatch, total=1 << 30, base=0)
    target_bytes = kv_pool.geometry_for(model.config, PAGE, torch.float32, "cpu").page_bytes
    draft_bytes = kv_pool.geometry_for(draft_model.config, PAGE, torch.float32, "cpu").page_bytes
    device.base = int(device.total * 0.6) - 100 * (target_bytes + draft_bytes)   # the share: 100 pages of each
    draft = ts.SpeculativeConfig(method="draft", num_tokens=2, draft_model=draft_model)
    llm = ts.LLM(model, gpu_memory_utilization=0.6, speculative=draft, **OPTIONS)
    assert llm.compiled.pool.non_kv_bytes == device.base + 2 * draft_bytes   # the draft's stand-in
    assert llm.compiled.num_pages == llm.engine.drafter.allocator.num_pages == 99
    live = sum(p.numel() * p.element_size() for p in device.pools)
    assert device.base + live <= device.total * 0.6


def test_a_windowed_draft_model_s_pool_holds_whole_contexts(monkeypatch):
    """The drafter keeps every page of a request, so with a draft model both pools are sized
    for whole contexts even when the target is windowed: every request gets drafts."""
    from test_sliding_window import MISTRAL
    target = decisive_model(3, MISTRAL)
    draft = ts.SpeculativeConfig(method="draft", num_tokens=2, verify_cost=1.0, draft_model=target)
    llm = ts.LLM(target, page_size=PAGE, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=16,
                 graphs=False, speculative=draft)
    assert llm.compiled.num_pages == llm.engine.drafter.allocator.num_pages == 4 * (256 // PAGE) + 1
    params = ts.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[(5 * i + 3 * j) % 400 + 1 for j in range(150)] for i in range(4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.metrics.mean_accept_length is not None for o in outputs)


