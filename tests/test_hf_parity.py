"""Greedy token identity against Hugging Face transformers, one tiny random model per variant.

References come from ``model.generate(do_sample=False)`` one prompt at a time (see
``tests/hf_models.py``); tokenspeed runs the same prompts as one batch under chunked
prefill, more prompts than ``max_num_seqs``, small and large pages, and a KV pool so
small that requests are preempted and recomputed.
"""

import json
from pathlib import Path

import pytest

import tokenspeed as ts
from tokenspeed.models.config import ModelConfig, RopeScaling
from tokenspeed.scheduling.prompt_limits import most_pages_held

from hf_models import EOS, LLAMA3_ROPE, VARIANTS, checkpoint, copy_checkpoint, edit_config, \
    make_prompts, reference

MAX_TOKENS = 12
LENGTHS = (1, 5, 40, 100, 32, 33, 7)        # 7 prompts; 100 > 3 chunks of 32; 32/33 at the edge
PROMPTS = make_prompts(LENGTHS, seed=11)
GREEDY = ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def token_ids(outputs):
    return [o.token_ids for o in outputs]


def expected_finish(ref, max_tokens):
    if ref and ref[-1] == EOS:
        return "stop"
    assert len(ref) == max_tokens
    return "length"


def check_outputs(outputs, prompts, refs, max_tokens):
    assert len(outputs) == len(prompts)
    for i, (out, prompt, ref) in enumerate(zip(outputs, prompts, refs)):
        assert out.prompt_token_ids == tuple(prompt), i
        assert out.token_ids == ref, f"prompt {i} (length {len(prompt)})"
        mt = max_tokens[i] if isinstance(max_tokens, (list, tuple)) else max_tokens
        assert out.finish_reason == expected_finish(ref, mt), i


class Recorder:
    """Wraps the engine's prefill/decode runners to record the batches they see."""

    def __init__(self, llm):
        self.extend_batches, self.decode_batches = [], []
        prefill, decode = llm.engine.prefill, llm.engine.decode
        prefill_launch, decode_prepare = prefill.launch, decode.prepare  # every step is launched, or prepared

        def launch_prefill(chunks, *args, **kwargs):
            self.extend_batches.append([(len(c.tokens), c.start, c.completes) for c in chunks])
            return prefill_launch(chunks, *args, **kwargs)

        def prepare_decode(rows, *args, **kwargs):
            self.decode_batches.append(len(rows))
            return decode_prepare(rows, *args, **kwargs)

        prefill.launch, decode.prepare = launch_prefill, prepare_decode


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_default_settings_match_hf(variant):
    llm = ts.LLM(checkpoint(variant))
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    check_outputs(llm.generate(PROMPTS, GREEDY), PROMPTS, refs, MAX_TOKENS)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_and_oversubscribed_match_hf(variant, page_size, enforce_eager):
    llm = ts.LLM(checkpoint(variant), page_size=page_size, max_num_seqs=3,
                 max_num_batched_tokens=32, enforce_eager=enforce_eager)
    rec = Recorder(llm)
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    check_outputs(llm.generate(PROMPTS, GREEDY), PROMPTS, refs, MAX_TOKENS)
    # the settings were really in force: token budget, chunking, sequence cap
    assert all(sum(n for n, _, _ in b) <= 32 for b in rec.extend_batches)
    assert any(start > 0 for b in rec.extend_batches for n, start, _ in b if n > 1), \
        "the 100-token prompt was never chunked"
    assert all(len(b) <= 3 for b in rec.extend_batches)
    assert rec.decode_batches and all(n <= 3 for n in rec.decode_batches)
    report = getattr(llm, "startup", None)
    if report is not None:
        assert (report.num_graphs == 0) == enforce_eager


@pytest.mark.parametrize("capture_sizes", [(1,), (2, 4), (5,)], ids=str)
def test_decode_ladder_padding_matches_hf(capture_sizes):
    """Batches padded up to a captured size, and batches above the ladder (eager)."""
    variant = "llama3_rope"
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_seqs=3, max_num_batched_tokens=32,
                 capture_sizes=capture_sizes)
    rec = Recorder(llm)
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    check_outputs(llm.generate(PROMPTS, GREEDY), PROMPTS, refs, MAX_TOKENS)
    assert {1, 3} <= set(rec.decode_batches) or {2, 3} <= set(rec.decode_batches)


@pytest.mark.parametrize("view_width", [2, 5])
def test_wider_prefill_view_matches_hf(view_width):
    variant = "qwen3"
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_seqs=3, max_num_batched_tokens=32,
                 view_width=view_width)
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    check_outputs(llm.generate(PROMPTS, GREEDY), PROMPTS, refs, MAX_TOKENS)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("variant", ["llama", "qwen3", "head_dim", "qwen3_window", "mixtral", "qwen3_moe",
                                     "qwen3_next", *(["qwen3_5"] if "qwen3_5" in VARIANTS else [])])
def test_preemption_under_tiny_kv_pool_matches_hf(variant, page_size, monkeypatch):
    longest = max(LENGTHS) + MAX_TOKENS
    groups = ModelConfig.from_hf(json.loads((Path(checkpoint(variant)) / "config.json").read_text())).cache_groups
    # what the longest request holds at once in every cache group (a windowed group's
    # pages behind its window go back), the null page, and a little
    pages_one_request = sum(most_pages_held(longest, page_size, g.retention, 64) for g in groups)
    num_kv_pages = pages_one_request + 1 + (2 if len(groups) == 1 else 0)
    llm = ts.LLM(checkpoint(variant), page_size=page_size, num_kv_pages=num_kv_pages,
                 max_num_seqs=8, max_num_batched_tokens=64)
    preempted = []
    sched = llm.engine.scheduler
    original = sched._preempt

    def counting_preempt(request):
        preempted.append((request.id, len(request.output)))
        return original(request)

    monkeypatch.setattr(sched, "_preempt", counting_preempt)
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    check_outputs(llm.generate(PROMPTS, GREEDY), PROMPTS, refs, MAX_TOKENS)
    assert preempted, "the pool was never exhausted: the test does not exercise preemption"
    assert any(n > 0 for _, n in preempted), "no request was preempted mid-generation"
    # every page went back to the pool
    assert llm.engine.scheduler.allocator.num_free == num_kv_pages - 1
    # and the engine still serves correctly afterwards
    check_outputs(llm.generate(PROMPTS[:3], GREEDY), PROMPTS[:3], refs[:3], MAX_TOKENS)


@pytest.mark.parametrize("lengths, num_kv_pages, budget", [((8, 8), 4, 1), ((40, 100), 29, 2)])
def test_tight_pool_with_tiny_token_budget_terminates(lengths, num_kv_pages, budget, monkeypatch):
    llm = ts.LLM(checkpoint("llama"), page_size=4, num_kv_pages=num_kv_pages, max_num_seqs=2,
                 max_num_batched_tokens=budget)
    calls, limit = [0], 1500
    original = llm.engine.scheduler.schedule

    def guarded():
        calls[0] += 1
        if calls[0] > limit:
            raise RuntimeError(f"no termination after {limit} scheduler steps (livelock)")
        return original()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", guarded)
    prompts = make_prompts(lengths, seed=11)
    max_tokens = 4 if max(lengths) < 20 else MAX_TOKENS
    outs = llm.generate(prompts, ts.SamplingParams(temperature=0, max_tokens=max_tokens))
    assert token_ids(outs) == reference("llama", prompts, max_tokens)


@pytest.mark.parametrize("budget, max_num_seqs, page_size, eager",
                         [(1, 1, 1, True), (3, 2, 2, False), (7, 5, 8, True), (100, 1, 16, False)])
def test_extreme_scheduler_settings_match_hf(budget, max_num_seqs, page_size, eager):
    variant = "qwen3"
    llm = ts.LLM(checkpoint(variant), page_size=page_size, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=budget, enforce_eager=eager)
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    check_outputs(llm.generate(PROMPTS, GREEDY), PROMPTS, refs, MAX_TOKENS)


def test_per_prompt_sampling_params_match_hf():
    variant = "qwen2"
    max_tokens = [1, 4, 12, 16, 2, 9, 5]
    params = [ts.SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    refs = [reference(variant, [p], n)[0] for p, n in zip(PROMPTS, max_tokens)]
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    check_outputs(llm.generate(PROMPTS, params), PROMPTS, refs, max_tokens)


def test_greedy_rows_unaffected_by_sampled_rows_in_the_same_batch():
    variant = "llama"
    sampled = ts.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(PROMPTS))]
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, params)
    refs = reference(variant, PROMPTS, MAX_TOKENS)
    for i in range(0, len(PROMPTS), 2):
        assert outs[i].token_ids == refs[i], i
    for i in range(1, len(PROMPTS), 2):
        assert 1 <= len(outs[i].token_ids) <= MAX_TOKENS


def test_repeated_generate_calls_are_consistent():
    variant = "tied"
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    first = token_ids(llm.generate(PROMPTS, GREEDY))
    second = token_ids(llm.generate(PROMPTS[::-1], GREEDY))
    assert first == reference(variant, PROMPTS, MAX_TOKENS)
    assert second == first[::-1]


def test_llama3_rope_config_is_read():
    config = ts.models.load(checkpoint("llama3_rope")).config
    assert config.rope_theta == LLAMA3_ROPE["rope_theta"]
    assert config.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    assert ts.models.load(checkpoint("llama")).config.rope_scaling is None
    assert ts.models.load(checkpoint("llama")).config.rope_theta == 1000.0


def test_variant_configs_are_read():
    assert ts.models.load(checkpoint("qwen2")).config.qkv_bias
    assert ts.models.load(checkpoint("qwen3")).config.qk_norm
    assert ts.models.load(checkpoint("tied")).config.tie_word_embeddings
    hd = ts.models.load(checkpoint("head_dim")).config
    assert (hd.hidden_size, hd.num_heads, hd.head_dim) == (64, 4, 32)


# ---------------------------------------------------------------- finish reasons


def test_finish_reason_length():
    llm = ts.LLM(checkpoint("llama"))
    refs = reference("llama", PROMPTS, 3, eos=None)
    outs = llm.generate(PROMPTS, ts.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for out, ref in zip(outs, refs):
        assert out.finish_reason == "length"
        assert out.token_ids == ref and len(ref) == 3


def _stop_candidate(ref, min_index=2):
    """A token first produced at index >= min_index of ``ref`` (so stopping really cuts)."""
    for i in range(min_index, len(ref) - 1):
        if ref[i] not in ref[:i] and ref[i] != EOS:
            return i, ref[i]
    return None


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_finish_reason_stop_token(variant):
    refs = reference(variant, PROMPTS, MAX_TOKENS, eos=None)
    found = [(j, _stop_candidate(r)) for j, r in enumerate(refs)]
    j, (cut, stop) = next((j, c) for j, c in found if c is not None and refs[j][-1] != EOS)
    params = [ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                stop_token_ids=[stop] if i == j else ())
              for i in range(len(PROMPTS))]
    outs = ts.LLM(checkpoint(variant), page_size=4, max_num_batched_tokens=32).generate(PROMPTS, params)
    assert outs[j].token_ids == refs[j][:cut + 1]
    assert outs[j].token_ids[-1] == stop
    assert outs[j].finish_reason == "stop"
    for i, out in enumerate(outs):
        if i != j:
            assert out.token_ids == refs[i] and out.finish_reason == "length", i


def test_stop_token_as_first_generated_token():
    variant = "qwen3"
    ref = reference(variant, PROMPTS[2:3], MAX_TOKENS, eos=None)[0]
    llm = ts.LLM(checkpoint(variant), page_size=4)
    out = llm.generate([PROMPTS[2]], ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       stop_token_ids=[ref[0]]))[0]
    assert out.token_ids == (ref[0],) and out.finish_reason == "stop"


def test_stop_token_only_in_the_prompt_does_not_stop():
    variant = "qwen3"
    ref = reference(variant, PROMPTS[2:3], MAX_TOKENS, eos=None)[0]
    in_prompt_only = next(t for t in PROMPTS[2] if t not in ref)
    llm = ts.LLM(checkpoint(variant), page_size=4)
    out = llm.generate([PROMPTS[2]], ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True,
                                                       stop_token_ids=[in_prompt_only]))[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_eos_from_config_stops_like_hf():
    variant = "qwen2"
    full = reference(variant, PROMPTS, MAX_TOKENS, eos=None)
    j, (cut, eos) = next((j, c) for j, c in enumerate(map(_stop_candidate, full)) if c)
    path = copy_checkpoint(variant)
    edit_config(path, eos_token_id=[EOS, eos])
    hf_refs = reference(variant, PROMPTS, MAX_TOKENS, eos=[EOS, eos])
    assert hf_refs[j] == full[j][:cut + 1]
    llm = ts.LLM(path, page_size=4, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outs) == hf_refs
    for out, ref in zip(outs, hf_refs):
        assert out.finish_reason == ("stop" if ref[-1] in (EOS, eos) else "length")
    assert outs[j].finish_reason == "stop" and outs[j].token_ids[-1] == eos
    # ignore_eos runs on to max_tokens, exactly like HF without an EOS
    outs = llm.generate(PROMPTS, ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    assert token_ids(outs) == full
    assert all(o.finish_reason == "length" for o in outs)
