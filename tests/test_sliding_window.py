"""Sliding windows in the engine: a model's windowed layers (every layer, or a cache group
of a mixed model) return the pages behind the window while its requests run (bounded
memory), never one a later row reads, and generate exactly what they generate when every
page is kept."""

import pytest
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.backends.metadata import NULL_PAGE
from tokenspeed.api.prompts import Prompt
from tokenspeed.ir.cache_groups import CacheGroup
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.random import TINY_LLAMA, random_model
from tokenspeed.testing.invariants import check_chained_rows_match_pages

from margins import assert_decisive, decisive_model, greedy_margins

WINDOW, PAGE = 8, 4
MISTRAL = {**TINY_LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": WINDOW}
QWEN3_MIXED = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
               "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
PREEMPT_SEED = 5                  # weights whose greedy margins are clear in this test
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 30, 61))]


def engine(config, **kw):
    return ts.LLM(decisive_model(3, config), page_size=PAGE, max_num_seqs=4,
                  max_num_batched_tokens=16, **{"graphs": False, **kw})


def steps(llm, params):
    """Generate step by step; yields after every step."""
    groups = llm.add([Prompt(tuple(p)) for p in PROMPTS], [params] * len(PROMPTS))
    requests = [r for group in groups for r in group]
    while llm.engine.has_work:
        llm.step()
        yield requests
    llm.release(requests)


@settings(max_examples=12, deadline=None)
@given(mixed=st.booleans(), window=st.integers(1, 20), page_size=st.sampled_from([1, 4, 16]),
       prefix_caching=st.booleans(), budget=st.sampled_from([8, 64]))
def test_a_windowed_group_holds_a_bounded_number_of_pages(mixed, window, page_size, prefix_caching, budget):
    """After every step, in each windowed cache group (Mistral's one, or a mixed model's
    second): no request has dropped a page its next row reads, a decoding request holds at
    most window / page size + 2 pages; a full group drops none; no page is in two groups;
    every page is accounted for, once."""
    config = {**(QWEN3_MIXED if mixed else MISTRAL), "sliding_window": window}
    llm = ts.LLM(random_model(config, seed=3), page_size=page_size, max_num_seqs=4, graphs=False,
                 max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    allocator, retentions = llm.engine.scheduler.allocator, llm.engine.scheduler.retentions
    assert retentions == ((0, window) if mixed else (window,))
    params = ts.SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for requests in steps(llm, params):
        check_chained_rows_match_pages(llm.engine)
        held_anywhere, by_group = [], [set() for _ in retentions]
        for r in requests:
            if r.finished or not r.pages:
                continue
            for pages, retention, group in zip(r.page_lists(), retentions, by_group):
                assert len(pages) == len(r.pages)
                read_from = max(r.num_cached - retention + 1, 0) // page_size if retention else 0
                assert NULL_PAGE not in pages[read_from:], (r.num_cached, pages)
                held = [p for p in pages if p != NULL_PAGE]
                if retention and len(r.output) >= 2:
                    assert len(held) <= retention / page_size + 2, (r.num_cached, pages)
                held_anywhere += held
                group.update(held)
        assert sum(map(len, by_group)) == len(set().union(*by_group))
        assert all(allocator.holders(p) for p in held_anywhere)
        assert prefix_caching or allocator.num_pages - 1 - allocator.num_free == len(set(held_anywhere))
    assert allocator.num_free == allocator.num_pages - 1


@pytest.mark.parametrize("config", [MISTRAL, QWEN3_MIXED], ids=["mistral", "qwen3-mixed"])
def test_dropping_pages_behind_the_window_changes_no_token(config):
    """The same engine keeping every page (a mixed model always does) gives the same tokens."""
    params = ts.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    dropping, keeping = engine(config), engine(config)
    keeping.engine.scheduler.retentions = (0,) * len(keeping.engine.scheduler.retentions)
    assert dropping.engine.scheduler.retentions == ((WINDOW,) if config is MISTRAL else (0, WINDOW))
    want = [o.outputs[0].token_ids for o in keeping.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in dropping.generate(PROMPTS, params, use_tqdm=False)] == want
    n = ts.SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=3, seed=4)
    assert [[c.token_ids for c in o.outputs] for o in dropping.generate(PROMPTS, n, use_tqdm=False)] == \
        [[c.token_ids for c in o.outputs] for o in keeping.generate(PROMPTS, n, use_tqdm=False)]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_mixed_model_s_groups_read_only_their_own_pages(monkeypatch, graphs):
    """Two cache groups, the windowed one dropping pages: with every free page overwritten
    by large values after each step (a page read after its return would show), the tokens
    equal those of the model's caches kept as one group of every page. ``graphs``: the
    segments' stand-in graphs on the CPU, over the runners' pinned inputs."""
    params = ts.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    grouped = engine(QWEN3_MIXED, graphs=graphs)
    assert len(grouped.config.cache_groups) == 2
    allocator, cache = grouped.engine.scheduler.allocator, grouped.compiled.kv_cache
    got = []
    for requests in steps(grouped, params):
        free = [p for p in range(1, allocator.num_pages) if not allocator.holders(p)]
        cache[:, :, free] = 1e4
        got = [list(r.output) for r in requests]
    monkeypatch.setattr(ModelConfig, "cache_groups",
                        property(lambda config: (CacheGroup(0, tuple(range(config.num_layers))),)))
    one = engine(QWEN3_MIXED, graphs=graphs)
    assert one.compiled.pool.page_bytes == 2 * grouped.compiled.pool.page_bytes
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [list(w) for w in want]


@pytest.mark.parametrize("config, prefix_caching", [(MISTRAL, True), (QWEN3_MIXED, True), (QWEN3_MIXED, False)],
                         ids=["mistral", "qwen3-mixed", "qwen3-mixed-samples-only"])
def test_a_windowed_model_shares_prefixes_and_keeps_its_tokens(monkeypatch, config, prefix_caching):
    """Prompts sharing a long system prefix, and the same prompt again, two samples each:
    cached (or a sample's) pages are taken where every group holds what its next row reads
    (a windowed group's behind its window may be dropped and evicted), and every token is
    what an engine keeping every page without prefix caching generates (row counts differ
    between the two: every greedy margin is checked to be decisive)."""
    system = [(5 * j) % 400 + 1 for j in range(45)]
    prompts = [system + [11, 12, 13], system + [21, 22], system + [11, 12, 13]]
    params = ts.SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2, seed=1)
    cached, plain = engine(config, enable_prefix_caching=prefix_caching), engine(config, enable_prefix_caching=False)
    plain.engine.scheduler.retentions = (0,) * len(plain.engine.scheduler.retentions)
    margins = greedy_margins(monkeypatch)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    first = cached.generate(prompts[:1], params, use_tqdm=False)
    rest = cached.generate(prompts[1:], params, use_tqdm=False)
    assert_decisive(margins)
    assert [[c.token_ids for c in o.outputs] for o in first + rest] == want
    assert all(o.metrics.num_cached_tokens > 0 for o in rest) == prefix_caching


def test_a_windowed_model_preempts_under_a_small_pool_and_keeps_its_tokens(monkeypatch):
    """Eight short prompts (one page each) admitted at once into a pool of 21 pages, then
    growing to windows of 32 positions: more than the pool, so some requests are preempted
    and recomputed; their tokens are those of a pool that never runs out."""
    prompts = [[(11 * i + 5 * j) % 450 + 1 for j in range(4)] for i in range(8)]
    params = ts.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    model = decisive_model(PREEMPT_SEED, {**MISTRAL, "sliding_window": 32})
    small, large = (ts.LLM(model, page_size=PAGE, max_num_seqs=8, graphs=False, max_num_batched_tokens=16,
                           num_kv_pages=pages) for pages in (21, None))
    preempted, original = [], small.engine.scheduler._preempt
    monkeypatch.setattr(small.engine.scheduler, "_preempt",
                        lambda request: preempted.append(request.id) or original(request))
    margins = greedy_margins(monkeypatch)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in large.generate(prompts, params, use_tqdm=False)]
    assert preempted, "the pool never ran out: nothing was preempted"
    assert_decisive(margins)
    assert got == want
    assert small.engine.scheduler.allocator.num_free == 20


def test_a_windowed_model_serves_prompts_longer_than_its_pool(monkeypatch):
    """With a window on every layer a request holds at most the window's and a chunk's pages
    ((8 + 16) / 4 + 2 = 8 here), so a pool of 8 usable pages serves a prompt whose whole
    context needs 21, with the tokens of a pool that holds it all; a mixed model, whose
    full-attention group keeps every page (21) beside its windowed group's 8, refuses the
    prompt and names the pages."""
    prompt = [(13 * j) % 450 + 1 for j in range(64)]
    params = ts.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    small, large = (engine(MISTRAL, num_kv_pages=pages) for pages in (9, 200))
    assert small.compiled.pool.pages_per_sequence == 8
    margins = greedy_margins(monkeypatch)
    got = small.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert_decisive(margins)
    assert got == large.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt 0: needs 29 KV pages at once, the pool has 8"):
        engine(QWEN3_MIXED, num_kv_pages=9).generate([prompt], params, use_tqdm=False)


def test_a_windowed_request_is_admitted_by_its_chunk_cap_not_the_step_budget(monkeypatch):
    """A request's chunk is at most ``max_chunk_tokens`` of the step's budget: its pages at
    once are (8 + 8) / 4 + 2 = 6, so 6 usable pages serve it (the check once read the budget,
    (8 + 16) / 4 + 2 = 8, and refused it)."""
    prompt = [(11 * j) % 450 + 1 for j in range(40)]
    params = ts.SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    small = engine(MISTRAL, num_kv_pages=7, max_chunk_tokens=8)
    margins = greedy_margins(monkeypatch)
    got = small.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert_decisive(margins)
    assert got == engine(MISTRAL, num_kv_pages=200).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_windowed_model_s_default_pool_holds_its_windows_not_its_contexts():
    """Every sequence at full length holds a window's pages: the pool a budget gives is that
    many for each of ``max_num_seqs``, and the null page. A mixed model's sequence holds its
    full group's pages and its windowed group's, each page a row for one layer, not two."""
    windowed, mixed = engine(MISTRAL, max_model_len=256), engine(QWEN3_MIXED, max_model_len=256)
    assert windowed.compiled.num_pages == 4 * 8 + 1
    assert mixed.compiled.num_pages == 4 * (256 // PAGE + 8) + 1
    assert mixed.compiled.pool.page_bytes * 2 == windowed.compiled.pool.page_bytes
