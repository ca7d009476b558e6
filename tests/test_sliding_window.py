"""Sliding windows in the engine: a model whose every layer is windowed returns the pages
behind the window while its requests run (bounded memory), never one a later row reads,
and generates exactly what it generates when it keeps every page."""

import pytest
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.backends.metadata import NULL_PAGE
from tokenspeed.entrypoints.prompts import Prompt
from tokenspeed.models.random import TINY_LLAMA, random_model

from margins import assert_decisive, decisive_model, greedy_margins

WINDOW, PAGE = 8, 4
MISTRAL = {**TINY_LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": WINDOW}
QWEN3_MIXED = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
               "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
PREEMPT_SEED = 5                  # weights whose greedy margins are clear in this test
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((3, 30, 61))]


def engine(config, **kw):
    return ts.LLM(decisive_model(3, config), page_size=PAGE, max_num_seqs=4, graphs=False,
                  max_num_batched_tokens=16, **kw)


def steps(llm, params):
    """Generate step by step; yields after every step."""
    groups = llm.add([Prompt(tuple(p)) for p in PROMPTS], [params] * len(PROMPTS))
    requests = [r for group in groups for r in group]
    while llm.engine.has_work:
        llm.step()
        yield requests
    llm.release(requests)


@settings(max_examples=12, deadline=None)
@given(window=st.integers(1, 20), page_size=st.sampled_from([1, 4, 16]), prefix_caching=st.booleans(),
       budget=st.sampled_from([8, 64]))
def test_a_windowed_model_holds_a_bounded_number_of_pages(window, page_size, prefix_caching, budget):
    """After every step: no request has dropped a page its next row reads, a decoding
    request holds at most window / page size + 2 pages, and every page is accounted for."""
    config = {**MISTRAL, "sliding_window": window}
    llm = ts.LLM(random_model(config, seed=3), page_size=page_size, max_num_seqs=4, graphs=False,
                 max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    allocator = llm.engine.scheduler.allocator
    params = ts.SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for requests in steps(llm, params):
        for r in requests:
            if r.finished or not r.pages:
                continue
            read_from = max(r.num_cached - window + 1, 0) // page_size
            assert NULL_PAGE not in r.pages[read_from:], (r.num_cached, r.pages)
            if len(r.output) >= 2:
                held = [p for p in r.pages if p != NULL_PAGE]
                assert len(held) <= window / page_size + 2, (r.num_cached, r.pages)
        held_anywhere = {p for r in requests for p in r.pages} - {NULL_PAGE}
        assert all(allocator.holders(p) for p in held_anywhere)
        assert prefix_caching or allocator.num_pages - 1 - allocator.num_free == len(held_anywhere)
    assert allocator.num_free == allocator.num_pages - 1


@pytest.mark.parametrize("config", [MISTRAL, QWEN3_MIXED], ids=["mistral", "qwen3-mixed"])
def test_dropping_pages_behind_the_window_changes_no_token(config):
    """The same engine keeping every page (a mixed model always does) gives the same tokens."""
    params = ts.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    dropping, keeping = engine(config), engine(config)
    keeping.engine.scheduler.window = 0
    assert dropping.engine.scheduler.window == (WINDOW if config is MISTRAL else 0)
    want = [o.outputs[0].token_ids for o in keeping.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in dropping.generate(PROMPTS, params, use_tqdm=False)] == want
    n = ts.SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=3, seed=4)
    assert [[c.token_ids for c in o.outputs] for o in dropping.generate(PROMPTS, n, use_tqdm=False)] == \
        [[c.token_ids for c in o.outputs] for o in keeping.generate(PROMPTS, n, use_tqdm=False)]


def test_a_windowed_model_shares_cached_prefixes_and_keeps_its_tokens(monkeypatch):
    """Prompts sharing a long system prefix, and the same prompt again: cached pages are
    taken where they still exist (those behind a window may have been dropped and
    evicted), and every token is what the engine without prefix caching generates (row
    counts differ between the two: every greedy margin is checked to be decisive)."""
    system = [(5 * j) % 400 + 1 for j in range(45)]
    prompts = [system + [11, 12, 13], system + [21, 22], system + [11, 12, 13]]
    params = ts.SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    cached, plain = engine(MISTRAL, enable_prefix_caching=True), engine(MISTRAL, enable_prefix_caching=False)
    margins = greedy_margins(monkeypatch)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    first = cached.generate(prompts[:1], params, use_tqdm=False)
    rest = cached.generate(prompts[1:], params, use_tqdm=False)
    assert_decisive(margins)
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert all(o.metrics.num_cached_tokens > 0 for o in rest)


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
    context needs 21, with the tokens of a pool that holds it all; a mixed model, which
    keeps every page, refuses the prompt and names the pages."""
    prompt = [(13 * j) % 450 + 1 for j in range(64)]
    params = ts.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    small, large = (engine(MISTRAL, num_kv_pages=pages) for pages in (9, 200))
    assert small.compiled.pool.pages_per_sequence == 8
    margins = greedy_margins(monkeypatch)
    got = small.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert_decisive(margins)
    assert got == large.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt 0: needs 21 KV pages at once, the pool has 8"):
        engine(QWEN3_MIXED, num_kv_pages=9).generate([prompt], params, use_tqdm=False)


def test_a_windowed_model_s_default_pool_holds_its_windows_not_its_contexts():
    """Every sequence at full length holds a window's pages: the pool a budget gives is that
    many for each of ``max_num_seqs``, and the null page."""
    windowed, full = engine(MISTRAL, max_model_len=256), engine(QWEN3_MIXED, max_model_len=256)
    assert windowed.compiled.num_pages == 4 * 8 + 1
    assert full.compiled.num_pages == 4 * (256 // PAGE) + 1
