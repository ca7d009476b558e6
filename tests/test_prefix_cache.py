"""Prefix caching (docs/DESIGN.md invariant 9): cached pages change no token, a held page is
never evicted or freed, page 0 is never cached or shared, every page comes back."""

import pytest
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.scheduling.block_allocator import BlockAllocator, OutOfPages

from hf_models import checkpoint, make_prompts, reference

GREEDY = ts.SamplingParams(temperature=0, max_tokens=8)
SYSTEM = make_prompts((21,), seed=31)[0]          # five full pages of 4, and a bit


def engines(**kw):
    kw = {"page_size": 4, **kw}
    return (ts.LLM(checkpoint("llama"), enable_prefix_caching=True, **kw),
            ts.LLM(checkpoint("llama"), enable_prefix_caching=False, **kw))


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_a_shared_system_prompt_is_computed_once_and_changes_no_token():
    cached, plain = engines()
    prompts = [SYSTEM + tail for tail in make_prompts((3, 9, 1, 14), seed=32)]
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert tokens(first + rest) == tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(first + rest) == [tuple(r) for r in reference("llama", prompts, 8)]
    assert first[0].metrics.num_cached_tokens == 0
    assert all(o.metrics.num_cached_tokens == 20 for o in rest)       # 5 full pages of SYSTEM


def test_a_conversation_replayed_turn_by_turn_reuses_its_history():
    cached, plain = engines()
    history, cached_tokens = list(SYSTEM), []
    for turn in make_prompts((5, 7, 2), seed=33):
        history += turn
        [a] = cached.generate([history], GREEDY, use_tqdm=False)
        [b] = plain.generate([history], GREEDY, use_tqdm=False)
        assert a.token_ids == b.token_ids
        cached_tokens.append(a.metrics.num_cached_tokens)
        history += a.token_ids
    assert cached_tokens[0] == 0 and cached_tokens[1] > 20 and cached_tokens[2] > cached_tokens[1]


@pytest.mark.parametrize("split", [5, 6, 7, 8, 9])
def test_prompts_that_diverge_inside_a_page(split):
    cached, plain = engines()
    base = make_prompts((12,), seed=34)[0]
    other = base[:split] + [(t + 1) % 300 + 3 for t in base[split:]]
    cached.generate([base], GREEDY, use_tqdm=False)
    [out] = cached.generate([other], GREEDY, use_tqdm=False)
    assert out.token_ids == plain.generate([other], GREEDY, use_tqdm=False)[0].token_ids
    assert out.metrics.num_cached_tokens == split // 4 * 4


def test_identical_prompts_in_one_batch_and_after():
    cached, plain = engines()
    prompts = [SYSTEM] * 4
    want = tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(cached.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert tokens(cached.generate(prompts, GREEDY, use_tqdm=False)) == want


def test_a_tiny_pool_evicts_and_preempts_without_changing_tokens():
    cached, plain = engines(num_kv_pages=16, max_num_seqs=4)
    prompts = [SYSTEM[:13] + tail for tail in make_prompts((2, 6, 3, 9, 4, 1), seed=35)]
    params = ts.SamplingParams(temperature=0, max_tokens=12)
    for _ in range(2):
        assert tokens(cached.generate(prompts, params, use_tqdm=False)) == \
            tokens(plain.generate(prompts, params, use_tqdm=False))
    allocator = cached.engine.scheduler.allocator
    assert allocator.num_free == 15 and allocator.num_cached <= 15


def test_graph_replays_serve_prefix_hits():
    graphed = ts.LLM(checkpoint("llama"), page_size=4, graphs=True, max_num_batched_tokens=64,
                     max_num_seqs=4)
    prompts = [SYSTEM + tail for tail in make_prompts((2, 11), seed=36)]
    graphed.generate(prompts[:1], GREEDY, use_tqdm=False)
    [hit] = graphed.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert hit.metrics.num_cached_tokens == 20
    assert hit.token_ids == tuple(reference("llama", prompts[1:], 8)[0])


# ---------------------------------------------------------------- the allocator, as a model


@settings(max_examples=80, deadline=None, derandomize=True)
@given(num_pages=st.integers(2, 12),
       ops=st.lists(st.tuples(st.sampled_from(["allocate", "free", "share", "remember", "reuse"]),
                              st.integers(0, 5), st.integers(0, 3)), max_size=80))
def test_cached_pages_are_counted_and_evicted_only_when_nobody_holds_them(num_pages, ops):
    alloc, held, digests = BlockAllocator(num_pages), [], {}
    for op, n, which in ops:
        if op == "allocate":
            try:
                pages = alloc.allocate(n)
            except OutOfPages:
                assert n > alloc.num_free
                continue
            assert not set(pages) & {p for h in held for p in h}, "a held page was handed out"
            for page in pages:
                digests.pop(page, None)                       # evicted, if it was cached
            held.append(pages)
        elif op == "free" and held:
            alloc.free(held.pop(which % len(held)))
        elif op == "share" and held:
            held.append(alloc.share(held[which % len(held)]))
        elif op == "remember" and held and held[which % len(held)]:
            page, digest = held[which % len(held)][0], bytes([n, which])
            alloc.remember(page, digest)
            if page not in digests and digest not in digests.values():   # the first is kept
                digests[page] = digest
        elif op == "reuse":
            wanted = [d for p, d in sorted(digests.items())[:n]]
            found = alloc.cached_prefix(wanted)
            if found:
                held.append(alloc.share(found))
        holding = [p for h in held for p in h]
        assert 0 not in holding and alloc.num_cached == len(digests)
        for page in set(holding):
            assert alloc.holders(page) == holding.count(page)
        assert alloc.num_free + len(set(holding)) == num_pages - 1
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == num_pages - 1


# ---------------------------------------------------------------- page digests


@settings(max_examples=60, deadline=None, derandomize=True)
@given(turns=st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, 3), max_size=30),
                                st.integers(0, 12)), min_size=1, max_size=8),
       remembered=st.integers(1, 3))
def test_digests_copied_from_an_earlier_request_are_those_its_own_tokens_give(turns, remembered):
    """Each turn keeps some of an earlier request's tokens, then goes its own way; the
    digests a request copies from an earlier one equal those of a fresh computation, page
    for page, and they grow past what was known (outputs included) as a lone request's do."""
    from tokenspeed.scheduling.page_digests import PageDigests
    from tokenspeed.scheduling.request import Request
    digests, fresh, earlier = PageDigests(4, remembered), PageDigests(4, 0), [[1, 2, 3, 4, 5]]
    for kept, tail, more in turns:
        base = earlier[kept % len(earlier)]
        prompt = tuple(base[:kept] + tail) or (7,)
        ours, alone = (Request(0, prompt, ts.SamplingParams(), 0) for _ in range(2))
        for output in ([], [9] * more):
            for request in (ours, alone):
                request.output = list(output)
            pages = (len(prompt) + len(output)) // 4
            assert digests(ours, pages) == fresh(alone, pages)
        earlier.append(list(prompt) + [9] * more)


def test_a_follow_up_copies_the_digests_of_its_history(monkeypatch):
    import hashlib
    from tokenspeed.scheduling.page_digests import PageDigests
    from tokenspeed.scheduling.request import Request
    digests = PageDigests(4)
    history = Request(0, tuple(range(40)), ts.SamplingParams(), 0)
    known = digests(history, 10)
    follow_up = Request(1, tuple(range(40)) + (5, 5, 5, 5), ts.SamplingParams(), 0)
    calls, real = [], hashlib.blake2b
    monkeypatch.setattr(hashlib, "blake2b", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert digests(follow_up, 11)[:10] == known
    assert len(calls) == 1     # its new page


def test_conversations_that_open_alike_each_find_their_own_history(monkeypatch):
    """Two conversations share a system prompt of three pages; the first one's next turn
    copies the first one's digests, though the second came after it."""
    import hashlib
    from tokenspeed.scheduling.page_digests import PageDigests
    from tokenspeed.scheduling.request import Request
    digests, system = PageDigests(4), tuple(range(100, 112))
    first, second = (Request(i, system + tuple(range(i * 50, i * 50 + 40)), ts.SamplingParams(), 0)
                     for i in range(2))
    known = digests(first, 13)
    digests(second, 13)
    follow_up = Request(2, first.prompt + (5, 5, 5, 5), ts.SamplingParams(), 0)
    calls, real = [], hashlib.blake2b
    monkeypatch.setattr(hashlib, "blake2b", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert digests(follow_up, 14)[:13] == known
    assert len(calls) == 1
