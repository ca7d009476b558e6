"""Speculative decoding: whatever the drafts (scripted, n-grams, a draft model), the outputs
are plain decoding's, token for token, greedy and seeded sampling alike, with graphs,
preemption and prefix caching, and sampled outputs keep the target's distribution
(chi-square); the n-gram proposer proposes what followed an earlier occurrence; bad
configurations are refused."""

import collections
import functools
import random
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.backends.metadata import DecodeRow
from tokenspeed.models.random import TINY_LLAMA, random_model
from tokenspeed.execution.sampler import RowSampling
from tokenspeed.engine.speculative import PerRequestDrafts, propose_ngram

from margins import decisive_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8], list(range(30, 60))]


@functools.lru_cache(maxsize=None)
def engines(graphs: bool, num_kv_pages: int | None = None, decisive: bool = True):
    """Plain and speculative engines of one model; ``decisive``: its greedy choices are
    clear (windows and plain steps run other row counts, which round differently on other
    CPUs), else the small-weight model whose continuations repeat (the n-gram test)."""
    model = decisive_model(3) if decisive else random_model(TINY_LLAMA)
    kw = dict(max_num_seqs=4, graphs=graphs, num_kv_pages=num_kv_pages, page_size=4)
    return ts.LLM(model, **kw), ts.LLM(model, speculative=ts.SpeculativeConfig(num_tokens=3, verify_cost=1.0), **kw)


class ScriptedDrafts(PerRequestDrafts):
    """Drafts that follow plain decoding's output with probability ``right``, else random
    tokens: windows that are kept whole, in part and not at all."""

    def __init__(self, truth: list[list[int]], right: float, seed: int):
        self.truth, self.right, self.rng = truth, right, random.Random(seed)

    def propose(self, tokens, limit: int) -> tuple[int, ...]:
        k = self.rng.randint(0, min(3, limit)) if limit > 0 else 0
        for full in self.truth:
            if full[:len(tokens)] == list(tokens) and self.rng.random() < self.right:
                return tuple(full[len(tokens):len(tokens) + k])
        return tuple(self.rng.randrange(TINY_LLAMA["vocab_size"]) for _ in range(k))


class Proposer(PerRequestDrafts):
    def __init__(self, propose):
        self.propose = propose


def outputs(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(temperature=st.sampled_from([0.0, 1.0]), right=st.sampled_from([0.0, 0.5, 0.9]),
       graphs=st.booleans(), stop=st.booleans(), seed=st.integers(0, 3))
def test_any_drafts_give_plain_decodings_tokens(temperature, right, graphs, stop, seed):
    plain, speculative = engines(graphs)
    params = ts.SamplingParams(temperature=temperature, max_tokens=24, seed=seed, ignore_eos=True)
    want = outputs(plain, params)
    if stop:   # a stop token inside some window: the request ends there, as plainly
        params = ts.SamplingParams(temperature=temperature, max_tokens=24, seed=seed, ignore_eos=True,
                                   stop_token_ids=[want[0][5]])
        want = outputs(plain, params)
    truth = [p + list(w) for p, w in zip(PROMPTS, want)]
    speculative.engine.drafter = ScriptedDrafts(truth, right, seed)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(1 <= o.metrics.mean_accept_length <= 4 for o in got if o.metrics.mean_accept_length)
    assert speculative.engine.scheduler.allocator.num_free == speculative.compiled.num_pages - 1


def test_ngram_drafts_are_kept_on_text_that_repeats():
    plain, speculative = engines(False, decisive=False)
    speculative.engine.drafter = ts.SpeculativeConfig(num_tokens=3, verify_cost=1.0)
    params = ts.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == outputs(plain, params)
    assert max(o.metrics.mean_accept_length or 1.0 for o in got) > 1.5


def test_a_tiny_pool_preempts_and_caches_alike():
    plain, speculative = engines(False, num_kv_pages=24)
    params = ts.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = outputs(plain, params)
    speculative.engine.drafter = ScriptedDrafts([p + list(w) for p, w in zip(PROMPTS, want)], 0.8, 1)
    assert outputs(speculative, params) == want
    assert outputs(speculative, params) == want      # again, from the prefix cache


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=30), k=st.integers(1, 4), n_max=st.integers(1, 4))
def test_ngram_proposals_continue_an_earlier_occurrence(tokens, k, n_max):
    draft = propose_ngram(tokens, k, n_max)
    assert len(draft) <= k
    if draft:
        matches = [(n, s) for n in range(1, n_max + 1) for s in range(len(tokens) - n)
                   if tokens[s:s + n] == tokens[len(tokens) - n:] and tuple(tokens[s + n:s + n + len(draft)]) == draft]
        assert matches
    if len(set(tokens)) == len(tokens):
        assert draft == ()


def test_ngram_prefers_the_longest_and_latest_match():
    assert propose_ngram([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2, 3) == (9, 2)    # [1, 2, 3] beats [2, 3]
    assert propose_ngram([5, 1, 5, 2, 5], 1, 1) == (2,)                      # the latest 5
    assert propose_ngram([256, 1, 256], 2, 1) == (1, 256)                   # whole tokens only


@pytest.mark.parametrize("options, error, match", [
    (dict(num_tokens=0), ValueError, "num_tokens=0"),
    (dict(method="medusa"), ValueError, "method='medusa'"),
    (dict(method="draft"), ValueError, "draft_model=None"),
    (dict(draft_model="some/path"), ValueError, "method='ngram' with draft_model"),
    (dict(ngram_min=3, ngram_max=2), ValueError, "ngram_min=3 > ngram_max=2"),
    (dict(verify_cost=0.5), ValueError, "verify_cost=0.5"),
    (dict(verify_cost=float("nan")), ValueError, "verify_cost=nan"),
    (dict(verify_cost=float("inf")), ValueError, "verify_cost=inf: must be a finite number >= 1"),
    (dict(num_tokens=10**9), ValueError, r"num_tokens=1000000000: must be in \[1, 128\]"),
    (dict(num_tokens=2.5), TypeError, r"num_tokens=2.5: must be an integer in \[1, 128\]"),
    (dict(num_tokens="3"), TypeError, "num_tokens='3'"),
    (dict(num_tokens=True), TypeError, "num_tokens=True"),
    (dict(ngram_max=4.0), TypeError, "ngram_max=4.0: must be an integer >= 1"),
    (dict(verify_cost="2"), TypeError, "verify_cost='2'"),
])
def test_bad_speculative_configs_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        ts.SpeculativeConfig(**options)


def test_speculative_must_be_a_config():
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        ts.LLM(random_model(TINY_LLAMA), speculative="ngram")


def test_a_verify_runner_needs_its_config():
    from tokenspeed.errors import InternalError
    with pytest.raises(InternalError, match="both"):
        from tokenspeed.engine.core import Engine
        Engine(None, prefill=None, decode=None, model_config=types.SimpleNamespace(eos_token_ids=(), vocab_size=1),
               max_model_len=8, verify=object())


def test_a_request_whose_drafts_keep_failing_backs_off():
    """Drafts that are always wrong: proposals get rarer (2, 4, 8.. tokens apart), and the
    output is still plain decoding's."""
    plain, speculative = engines(False)
    params = ts.SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = plain.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids
    wrong = next(t for t in range(TINY_LLAMA["vocab_size"]) if t not in want)
    engine, windows = speculative.engine, []
    engine.drafter = Proposer(lambda tokens, limit: (wrong,) * min(3, limit))
    verify = engine._verify
    engine._verify = lambda requests, drafts: windows.append(requests[0].num_tokens) or verify(requests, drafts)
    try:
        got = speculative.generate(PROMPTS[2], params, use_tqdm=False)[0]
    finally:
        del engine._verify
    assert got.outputs[0].token_ids == want and got.metrics.mean_accept_length == 1.0
    gaps = [b - a for a, b in zip(windows, windows[1:])]
    assert len(windows) <= 7 and gaps == sorted(gaps) and gaps[-1] >= 16, windows


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_graphs_on_the_gpu_give_plain_decodings_tokens(temperature):
    """Captured verify graphs (Triton kernels, CUDA graphs) against plain decoding's, in float32
    so that the rounding by which batch shapes differ stays below every argmax margin."""
    model = random_model(TINY_LLAMA, device="cuda")
    kw = dict(device="cuda", max_num_seqs=8, page_size=4, graphs=True)
    plain = ts.LLM(model, **kw)
    speculative = ts.LLM(model, speculative=ts.SpeculativeConfig(num_tokens=3, verify_cost=1.0), **kw)
    params = ts.SamplingParams(temperature=temperature, max_tokens=32, seed=5, ignore_eos=True)
    want = outputs(plain, params)
    speculative.engine.drafter = ScriptedDrafts([p + list(w) for p, w in zip(PROMPTS, want)], 0.7, 2)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert max(o.metrics.mean_accept_length or 1.0 for o in got) > 1.5


def test_only_windows_with_drafts_count_towards_the_accept_length():
    """A request without drafts runs as a one-row window beside those with drafts: it has
    no speculative window, so no accept length."""
    plain, speculative = engines(False)
    params = ts.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = outputs(plain, params)
    first = PROMPTS[0] + list(want[0])

    def propose(tokens, limit):
        known = list(tokens) == first[:len(tokens)]
        return tuple(first[len(tokens):len(tokens) + min(3, limit)]) if known else ()

    speculative.engine.drafter = Proposer(propose)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert got[0].metrics.mean_accept_length > 3 and got[1].metrics.mean_accept_length is None


@pytest.mark.parametrize("params", [ts.SamplingParams(temperature=0.0), ts.SamplingParams(top_k=1),
                                    ts.SamplingParams(temperature=1.0, top_p=0.9)])
def test_windows_of_one_row_sample_what_plain_decoding_samples(params):
    """N = 1: the verify runner over windows without drafts is a plain decode step (same
    rows, seeds and cache), greedy, top_k = 1 and sampled. An engine of its own: the rows
    write into pages that a shared engine's prefix cache may hold."""
    speculative = ts.LLM(random_model(TINY_LLAMA), max_num_seqs=4, graphs=False, page_size=4,
                         speculative=ts.SpeculativeConfig(num_tokens=3))
    rows = [DecodeRow(11 + i, 5 + 3 * i, (1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i)) for i in range(4)]
    sampling = [RowSampling(params, seed) for seed in range(4)]
    with torch.inference_mode():
        assert speculative.compiled.verify.run(rows, sampling) == speculative.compiled.decode.run(rows, sampling)


def test_a_batch_verifies_only_drafts_expected_to_pay_for_the_step():
    """At a verify cost of two plain steps, a lone request whose drafts are right verifies;
    beside two requests without drafts the same drafts cannot pay for three rows' step, so
    that batch decodes plainly (no windows at all), with plain decoding's tokens."""
    plain, speculative = engines(False)
    params = ts.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = outputs(plain, params)
    want_alone = plain.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    known = [PROMPTS[0] + list(want_alone), PROMPTS[0] + list(want[0])]

    def propose(tokens, limit):
        for full in known:
            if list(tokens) == full[:len(tokens)]:
                return tuple(full[len(tokens):len(tokens) + min(3, limit)])
        return ()

    engine = speculative.engine
    engine.drafter, engine.verify_cost = Proposer(propose), 2.0
    try:
        alone = speculative.generate(PROMPTS[0], params, use_tqdm=False)[0]
        together = speculative.generate(PROMPTS, params, use_tqdm=False)
    finally:
        engine.verify_cost = 1.0
    assert alone.outputs[0].token_ids == want_alone and alone.metrics.mean_accept_length > 3
    assert [o.outputs[0].token_ids for o in together] == want
    assert all(o.metrics.mean_accept_length is None for o in together)


@pytest.mark.gpu
def test_a_draft_model_with_graphs_on_the_gpu_gives_plain_decodings_tokens():
    """The draft model's captured decode graphs and the target's verify graphs, float32."""
    target, draft = random_model(TINY_LLAMA, device="cuda"), random_model(TINY_LLAMA, device="cuda", seed=1)
    kw = dict(device="cuda", max_num_seqs=8, page_size=4, graphs=True)
    plain = ts.LLM(target, **kw)
    for temperature, model in ((0.0, target), (1.0, draft)):   # drafts all kept, then few
        params = ts.SamplingParams(temperature=temperature, max_tokens=24, seed=5, ignore_eos=True)
        config = ts.SpeculativeConfig(method="draft", num_tokens=3, verify_cost=1.0, draft_model=model)
        assert outputs(ts.LLM(target, speculative=config, **kw), params) == outputs(plain, params)


@functools.lru_cache(maxsize=None)
def draft_engines(draft_seed: int, graphs: bool = False):
    """Plain decoding, and drafts from a random model: the target itself (seed 0: every
    draft kept) or another (seed 1: few kept)."""
    kw = dict(max_num_seqs=4, page_size=4, graphs=graphs)
    target = random_model(TINY_LLAMA)
    config = ts.SpeculativeConfig(method="draft", num_tokens=3, verify_cost=1.0,
                                  draft_model=random_model(TINY_LLAMA, seed=draft_seed))
    return ts.LLM(target, **kw), ts.LLM(target, speculative=config, **kw)


@pytest.mark.parametrize("draft_seed", [0, 1])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_model_gives_plain_decodings_tokens(draft_seed, temperature):
    plain, speculative = draft_engines(draft_seed)
    params = ts.SamplingParams(temperature=temperature, max_tokens=20, seed=3, ignore_eos=True)
    got = speculative.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == outputs(plain, params)
    lengths = [o.metrics.mean_accept_length for o in got if o.metrics.mean_accept_length]
    if draft_seed == 0 and temperature == 0.0:   # the target drafting for itself: all kept
        assert min(lengths) > 3
    drafter = speculative.engine.drafter
    assert not drafter.states and drafter.allocator.num_free == drafter.allocator.num_pages - 1


def test_a_draft_model_with_another_vocabulary_is_refused():
    other = random_model({**TINY_LLAMA, "vocab_size": TINY_LLAMA["vocab_size"] + 8})
    config = ts.SpeculativeConfig(method="draft", draft_model=other)
    with pytest.raises(ValueError, match="vocabulary"):
        ts.LLM(random_model(TINY_LLAMA), speculative=config)


def test_a_hybrid_draft_model_is_refused_as_a_hybrid_target_is():
    from hf_models import checkpoint
    config = ts.SpeculativeConfig(method="draft", draft_model=str(checkpoint("qwen3_next")))
    with pytest.raises(ValueError, match="draft model .Qwen3NextForCausalLM. has recurrent layers"):
        ts.LLM(str(checkpoint("llama")), speculative=config)


def test_a_draft_model_under_a_tiny_pool_preempts_alike():
    model = random_model(TINY_LLAMA)
    kw = dict(max_num_seqs=4, page_size=4, num_kv_pages=24)
    config = ts.SpeculativeConfig(method="draft", num_tokens=2, verify_cost=1.0, draft_model=model)
    params = ts.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = outputs(ts.LLM(model, **kw), params)
    assert outputs(ts.LLM(model, speculative=config, **kw), params) == want


def _chi_square(a: list, b: list, vocab: int) -> float:
    """Two-sample chi-square statistic of two equally many draws over ``vocab`` tokens."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    return sum((ca[t] - cb[t]) ** 2 / (ca[t] + cb[t]) for t in range(vocab) if ca[t] + cb[t])


@pytest.mark.parametrize("draft_seed", [0, 1])
def test_speculative_sampling_keeps_the_targets_distribution(draft_seed):
    """2000 sampled continuations (temperature 0.3, a 16-token vocabulary) with a draft
    model's drafts against 2000 of plain sampling under other seeds: at every position the
    tokens are alike (chi-square, 15 degrees of freedom, below the 0.1% critical value
    37.7), while the draft model's own sampling is told apart. Seeds fixed: deterministic."""
    config, n, prompt = {**TINY_LLAMA, "vocab_size": 16}, 2000, [1, 5, 9, 3, 7]
    target, draft = random_model(config), random_model(config, seed=draft_seed)
    kw = dict(max_num_seqs=256, page_size=4)
    speculative = ts.LLM(target, speculative=ts.SpeculativeConfig(method="draft", num_tokens=3, verify_cost=1.0,
                                                                  draft_model=draft), **kw)

    def draws(llm, first_seed):
        params = [ts.SamplingParams(temperature=0.3, max_tokens=4, seed=first_seed + i, ignore_eos=True)
                  for i in range(n)]
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]

    plain, drafted = draws(ts.LLM(target, **kw), 0), draws(speculative, 10**6)
    for position in range(4):
        assert _chi_square([t[position] for t in plain], [t[position] for t in drafted], 16) < 37.7
    if draft_seed == 1:   # the test can tell another distribution apart
        alone = draws(ts.LLM(draft, **kw), 2 * 10**6)
        assert _chi_square([t[0] for t in plain], [t[0] for t in alone], 16) > 37.7
