"""Bad input is refused with a ValueError naming the bad value and the limit, before any work.

A refused ``generate`` leaves the engine as it was: the same LLM then produces exactly
what a fresh one does (greedy and sampled, so the sampling generator is checked too).
"""

import re

import attrs
import pytest

import tokenspeed as ts
from tokenspeed.errors import InternalError

from hf_models import MAX_POS, VOCAB, checkpoint, make_prompts, reference

MAX_MODEL_LEN = 64
PROMPTS = make_prompts((3, 9, 20, 1), seed=5)


@pytest.fixture(scope="module")
def path():
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llm(path):
    return ts.LLM(path, page_size=4, max_model_len=MAX_MODEL_LEN)


def raises(*fragments):
    """pytest.raises(ValueError) whose message contains every fragment (literally)."""
    return pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(str(f))})"
                                                            for f in fragments))


# ---------------------------------------------------------------- prompts


def test_empty_prompt(llm):
    with raises("prompt 0", "empty"):
        llm.generate([[]])


@pytest.mark.parametrize("bad", [-1, -100, VOCAB, VOCAB + 7, 2**63, -2**63 - 1, 2**70])
def test_token_out_of_vocabulary(llm, bad):
    with raises("prompt 0", str(bad), str(VOCAB)):
        llm.generate([[5, bad, 6]])


@pytest.mark.parametrize("bad", [1.0, "7", None])
def test_token_ids_that_are_not_integers_are_refused_by_name(llm, bad):
    with pytest.raises(TypeError, match=re.escape(f"prompt 0: token ids must be integers, got {bad!r}")):
        llm.generate([[5, bad, 6]])


@pytest.mark.parametrize("bad", [1.0, "7", None])
def test_a_prompt_record_of_non_integers_is_refused_by_name(llm, bad):
    from tokenspeed.api.prompts import Prompt
    with pytest.raises(TypeError, match=re.escape(f"prompt 0: token ids must be integers, got {bad!r}")):
        llm.generate([Prompt((5, bad, 6))])


def test_prompt_plus_max_tokens_over_max_model_len(llm):
    prompt = list(range(3, 3 + 60))
    with raises("prompt 0", "60", "max_tokens=5", str(MAX_MODEL_LEN)):
        llm.generate([prompt], ts.SamplingParams(max_tokens=5))
    # exactly at the limit is fine
    out = llm.generate([prompt], ts.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and out[0].finish_reason == "length"


def test_prompt_alone_over_max_model_len(llm):
    with raises("prompt 0", str(MAX_MODEL_LEN)):
        llm.generate([list(range(3, 3 + MAX_MODEL_LEN + 1))], ts.SamplingParams(max_tokens=1))


def test_request_larger_than_the_kv_pool(path):
    small = ts.LLM(path, page_size=4, num_kv_pages=5)  # 4 usable pages = 16 tokens
    with raises("prompt 0", "needs 5", "has 4"):
        small.generate([list(range(3, 18))], ts.SamplingParams(max_tokens=3))
    out = small.generate([list(range(3, 13))], ts.SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) >= 1


@pytest.mark.parametrize("kind", ["empty", "negative", "too_large", "too_long"])
def test_bad_prompt_in_the_middle_names_its_index(llm, kind):
    bad = {"empty": [], "negative": [4, -3], "too_large": [VOCAB + 1],
           "too_long": list(range(3, 3 + MAX_MODEL_LEN))}[kind]
    prompts = [PROMPTS[0], PROMPTS[1], bad, PROMPTS[2]]
    with raises("prompt 2"):
        llm.generate(prompts, ts.SamplingParams(max_tokens=4))


def test_sampling_params_count_must_match(llm):
    with raises("2", "3"):
        llm.generate(PROMPTS[:3], [ts.SamplingParams(), ts.SamplingParams()])


# ---------------------------------------------------------------- sampling params


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one(max_tokens):
    with raises(f"max_tokens={max_tokens}", ">= 1"):
        ts.SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize("temperature", [-0.5, -1e-9, float("nan")])
def test_negative_temperature(temperature):
    with raises("temperature", repr(temperature), ">= 0"):
        ts.SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0, 0.0, 1.5, -0.1, float("nan")])
def test_top_p_outside_unit_interval(top_p):
    with raises(f"top_p={top_p!r}", "(0, 1]"):
        ts.SamplingParams(top_p=top_p)


@pytest.mark.parametrize("top_k", [-2, -50])
def test_negative_top_k(top_k):
    with raises(f"top_k={top_k}", "-1 or 0 (off), or an integer >= 1"):
        ts.SamplingParams(top_k=top_k)


@pytest.mark.parametrize("field, value, limit", [
    ("max_tokens", 2.5, "an integer"), ("top_k", 2.5, "an integer"), ("n", True, "an integer"),
    ("temperature", float("inf"), "finite"), ("temperature", "0.5", "finite"),
    ("stop_token_ids", "ab", "a list of token ids"), ("stop_token_ids", [1, -2], "integers >= 0"),
    ("seed", 1.0, "an integer or None"),
    ("logprobs", 21, "[0, 20]"), ("min_p", 1.5, "[0, 1]"), ("presence_penalty", 3, "[-2, 2]"),
    ("repetition_penalty", 0, "> 0"), ("ignore_eos", "yes", "True or False"),
])
def test_sampling_params_check_types_and_ranges(field, value, limit):
    shown = repr(tuple(value)) if isinstance(value, list) else repr(value)  # lists are kept as tuples
    with raises(f"{field}={shown}", limit):
        ts.SamplingParams(**{field: value})


@pytest.mark.parametrize("bad, shown", [(5, "stop[1]=5"), ("", "stop=''"), (None, "stop[1]=None")])
def test_a_bad_stop_string_is_named_alone(bad, shown):
    with raises(f"{shown}: must be a non-empty string"):
        ts.SamplingParams(stop=["ok", bad])


def test_stop_token_ids_none_is_none_as_in_vllm():
    assert ts.SamplingParams(stop_token_ids=None).stop_token_ids == ()


@pytest.mark.parametrize("field, value, limit", [
    ("n", 129, "<= 128"), ("n", 10**8, "<= 128"), ("top_k", 2**63, "<= 2**63 - 1"),
    ("seed", 2**63, "signed 64-bit range [-2**63, 2**63 - 1]"),
    ("seed", -2**63 - 1, "signed 64-bit range [-2**63, 2**63 - 1]"),
    ("seed", 2**64 - 1, "signed 64-bit range"), ("temperature", 1e39, "<= 3.40282e+38 (float32's largest)"),
    ("repetition_penalty", 1e-50, "float32 holds"), ("repetition_penalty", 1e39, "float32 holds"),
    ("max_tokens", 2**63, "<= 2**63 - 1"), ("min_tokens", 2**63, "<= 2**63 - 1"),
    ("stop_token_ids", [2**63], "<= 2**63 - 1"),
])
def test_sampling_params_are_bounded_by_what_the_sampler_holds(field, value, limit):
    shown = repr(tuple(value)) if isinstance(value, list) else repr(value)
    with raises(f"{field}={shown}", limit):
        ts.SamplingParams(**{field: value})


def test_a_stop_token_outside_the_vocabulary_is_refused_by_field(llm):
    with pytest.raises(ValueError, match=rf"^stop_token_ids: stop token id {VOCAB + 5} is outside "
                                         rf"the vocabulary \[0, {VOCAB}\)$"):
        llm.generate([[5, 6]], ts.SamplingParams(stop_token_ids=[3, VOCAB + 5]))


def test_valid_edges_are_accepted():
    ts.SamplingParams(temperature=0, top_p=1.0, top_k=0, max_tokens=1)
    ts.SamplingParams(top_p=1e-6)
    ts.SamplingParams(top_k=10**6)
    ts.SamplingParams(n=128, top_k=2**63 - 1, seed=-2**63, temperature=3.4e38, repetition_penalty=2**-126)
    ts.SamplingParams(seed=2**63 - 1, max_tokens=2**63 - 1, min_tokens=2**63 - 1, stop_token_ids=[2**63 - 1])


@pytest.mark.slow
def test_the_largest_n_at_the_most_pages_completes(path):
    """n at its cap, each sample needing every page of the pool: they take turns, and
    each draws what it draws in a pool that holds them all (tests/test_scheduler.py has
    the windowed and prefix-cached cases)."""
    params = ts.SamplingParams(n=128, max_tokens=2, ignore_eos=True, seed=11)
    prompt = list(range(3, 9))                   # 6 + 2 tokens: 2 pages of 4
    small = ts.LLM(path, page_size=4, num_kv_pages=3)
    got = [o.token_ids for o in small.generate([prompt], params)[0].outputs]
    want = [o.token_ids for o in ts.LLM(path, page_size=4).generate([prompt], params)[0].outputs]
    assert got == want and len(got) == 128 and all(len(t) == 2 for t in got)
    assert small.engine.scheduler.allocator.num_free == 2
    with raises("prompt 0", "needs 3", "has 2"):
        small.generate([prompt], attrs.evolve(params, max_tokens=3))


def test_the_extreme_allowed_values_sample_beside_a_greedy_request(llm):
    """Every bound at its edge, in one batch with a greedy request: the step holds them,
    and the greedy request gets the tokens it gets alone."""
    greedy = ts.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], greedy)[0].token_ids
    edges = [ts.SamplingParams(n=2, top_k=2**63 - 1, seed=2**63 - 1, temperature=3.4028234663852886e38,
                               repetition_penalty=3.4028234663852886e38, max_tokens=6, ignore_eos=True),
             ts.SamplingParams(seed=-2**63, top_p=1e-300, repetition_penalty=2**-126, min_p=1.0,
                               presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20, max_tokens=6,
                               ignore_eos=True, stop_token_ids=[VOCAB - 1], min_tokens=6)]
    outputs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], edges + [greedy])
    assert outputs[2].token_ids == alone
    assert all(len(c.token_ids) == 6 and all(0 <= t < VOCAB for t in c.token_ids)
               for o in outputs[:2] for c in o.outputs)


def test_a_value_that_cannot_be_sampled_fails_only_its_request(llm):
    """A record whose value slipped past its checks is refused where its request is added,
    by name, before any of its samples is queued: the batch it would have joined (and
    failed, in the step's int64 tensors) runs on, with the tokens it draws alone."""
    engine, prompt = llm.engine, tuple(PROMPTS[1])
    good = ts.SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3)
    alone = _finish(engine, engine.add(prompt, good))
    bad = ts.SamplingParams(n=2, temperature=1.0, seed=4)
    object.__setattr__(bad, "top_k", 2**63)      # as a record built around its checks
    running = engine.add(prompt, good)
    engine.step()
    with raises("top_k=9223372036854775808", "64-bit"):
        engine.add(prompt, bad)
    assert _finish(engine, running) == alone
    assert engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1


def _finish(engine, requests) -> list:
    while engine.has_work:
        engine.step()
    assert not engine.scheduler.waiting and all(r.finish_reason == "length" for r in requests)
    return [r.output for r in requests]


# ---------------------------------------------------------------- state after a refusal


def _run(llm, prompts):
    greedy = ts.SamplingParams(temperature=0, max_tokens=8)
    sampled = ts.SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8)
    params = [greedy if i % 2 == 0 else sampled for i in range(len(prompts))]
    return [(o.token_ids, o.finish_reason, o.prompt_token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("bad", [[], [VOCAB], [-1], list(range(3, 3 + MAX_MODEL_LEN))])
def test_refused_generate_leaves_the_engine_untouched(path, bad):
    settings = dict(page_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
                    max_num_batched_tokens=16, seed=3)
    used = ts.LLM(path, **settings)
    with raises("prompt 2"):
        used.generate([PROMPTS[0], PROMPTS[1], bad, PROMPTS[2]])
    assert not used.engine.scheduler.has_work
    assert used.engine.scheduler.allocator.num_free == used.compiled.num_pages - 1
    fresh = ts.LLM(path, **settings)
    got, want = _run(used, PROMPTS), _run(fresh, PROMPTS)
    assert got == want
    # greedy rows are also HF's tokens
    refs = reference("llama", PROMPTS, 8)
    assert [got[i][0] for i in (0, 2)] == [refs[0], refs[2]]


def test_refusal_between_good_calls(path):
    settings = dict(page_size=4, max_model_len=MAX_MODEL_LEN, seed=1)
    used, fresh = ts.LLM(path, **settings), ts.LLM(path, **settings)
    assert _run(used, PROMPTS) == _run(fresh, PROMPTS)
    with raises("prompt 1", str(VOCAB)):
        used.generate([PROMPTS[0], [VOCAB + 3]])
    with pytest.raises(ValueError):
        used.generate([PROMPTS[0]], [ts.SamplingParams()] * 2)
    assert _run(used, PROMPTS[::-1]) == _run(fresh, PROMPTS[::-1])


# ---------------------------------------------------------------- LLM settings


@pytest.mark.parametrize("name", ["page_size", "max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -4])
def test_llm_settings_must_be_positive(path, name, value):
    with raises(f"{name}={value}", ">= 1" if name != "max_num_seqs" else "in [1, 65536]"):
        ts.LLM(path, **{name: value})


def test_max_model_len_above_max_position_embeddings(path):
    with raises("max_model_len=1000", f"max_position_embeddings={MAX_POS}"):
        ts.LLM(path, max_model_len=1000)
    assert ts.LLM(path, max_model_len=MAX_POS).compiled.limits.max_model_len == MAX_POS


def test_negative_max_model_len(path):
    with raises("max_model_len=-1"):
        ts.LLM(path, max_model_len=-1)


def test_kv_pool_needs_two_pages(path):
    with raises("1", "2"):
        ts.LLM(path, num_kv_pages=1)


@pytest.mark.parametrize("buckets", [(), (0, 8), (-4,)])
def test_bad_token_buckets_are_named(path, buckets):
    with raises("token_buckets="):
        ts.LLM(path, token_buckets=buckets)


def test_a_failing_step_leaves_nothing_behind(path, monkeypatch):
    llm = ts.LLM(path, page_size=4)
    prompts = make_prompts((5, 9), seed=3)
    params = ts.SamplingParams(temperature=0, max_tokens=6)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    enqueue = llm.compiled.decode.enqueue
    monkeypatch.setattr(llm.compiled.decode, "enqueue", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompts, params)
    monkeypatch.setattr(llm.compiled.decode, "enqueue", enqueue)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    assert llm.engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_an_extend_chunk_past_its_pages_is_refused():
    from tokenspeed.backends.metadata import ExtendChunk, plan_extend
    chunks = [ExtendChunk((1, 2), 0, (1,), True), ExtendChunk(tuple(range(9)), 4, (2, 3), True)]
    with pytest.raises(InternalError, match=r"chunk 1: positions up to 12 need 4 pages of 4 tokens, it holds 2"):
        plan_extend(chunks, num_rows=16, num_table_rows=3, max_pages=8, page_size=4)


def test_negative_compile_workers_is_refused(path):
    with raises("compile_workers=-1: must be >= 0"):
        ts.LLM(path, compile_workers=-1)


@pytest.mark.parametrize("options, kind, message", [
    (dict(page_size="16"), TypeError, "page_size='16': must be an integer >= 1"),
    (dict(page_size=16.5), TypeError, "page_size=16.5: must be an integer"),
    (dict(page_size=True), TypeError, "page_size=True: must be an integer"),
    (dict(max_num_seqs=None), TypeError, "max_num_seqs=None: must be an integer in [1, 65536]"),
    (dict(max_num_seqs=10 ** 7), ValueError, "max_num_seqs=10000000: must be in [1, 65536]"),
    (dict(seed="a"), TypeError, "seed='a': must be an integer"),
    (dict(gpu_memory_utilization="0.5"), TypeError, "gpu_memory_utilization='0.5': must be a number"),
    (dict(graphs="yes"), TypeError, "graphs='yes': must be True, False or None"),
    (dict(capture_sizes="abc"), TypeError, "capture_sizes='abc': must be a list of integers >= 1"),
    (dict(capture_sizes=5), TypeError, "capture_sizes=5: must be a list"),
    (dict(capture_sizes=[1, 20000]), ValueError, "capture_sizes=[1, 20000]: a step holds at most max_num_seqs=64 "
                                                 "rows; one size above it may pad a full step, under 128"),
    (dict(capture_sizes=[1, 80, 96]), ValueError, "capture_sizes=[1, 80, 96]: a step holds at most max_num_seqs=64"),
    (dict(token_buckets=[4096]), ValueError, "token_buckets=[4096]: a step holds at most max_num_batched_tokens=2048"),
    (dict(enforce_eager="no"), TypeError, "enforce_eager='no': must be True or False"),
    (dict(overlap=1), TypeError, "overlap=1: must be True or False"),
    (dict(backend="flash"), TypeError, "backend='flash': must be an attention backend"),
    (dict(tokenizer=123), TypeError, "tokenizer=123: must be a path"),
])
def test_an_option_of_the_wrong_kind_or_past_its_limit_is_refused_before_loading(options, kind, message):
    """Named with the value and what it may be, before a model is read (not a TypeError
    from deep in a tensor constructor after it loaded, nor a page size of True)."""
    with pytest.raises(kind, match=re.escape(message)):
        ts.LLM("/no/such/model", **options)
