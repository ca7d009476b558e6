"""Overlapped decoding (step n+1 launched before step n's tokens are read) gives exactly
the tokens of the synchronous loop and of Hugging Face, returns every page, and really
chains steps."""

import pytest

import tokenspeed as ts
from hf_models import checkpoint, make_prompts, reference

PROMPTS = make_prompts((1, 5, 17, 40, 9, 3, 28), seed=11)


def run(prompts, params, **kw):
    llm = ts.LLM(checkpoint("llama"), page_size=4, **kw)
    steps = []
    launch = llm.compiled.decode.launch

    def counting(rows, p, chained=False, kept=None):
        steps.append(chained)
        return launch(rows, p, chained, kept)

    llm.compiled.decode.launch = counting
    outs = llm.generate(prompts, params)
    assert llm.engine.in_flight is None
    assert llm.engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1, "pages leaked"
    return [o.token_ids for o in outs], [o.finish_reason for o in outs], steps


@pytest.mark.parametrize("kw", [{}, {"enforce_eager": True}, {"max_num_seqs": 3},
                                {"max_num_batched_tokens": 8}])
def test_overlap_matches_hf_and_sync(kw):
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n) for n in (12, 3, 16, 7, 1, 16, 9)]
    on, reasons_on, chained = run(PROMPTS, params, overlap=True, **kw)
    off, reasons_off, _ = run(PROMPTS, params, overlap=False, **kw)
    assert on == off and reasons_on == reasons_off
    for prompt, tokens, p in zip(PROMPTS, on, params):
        assert list(tokens) == list(reference("llama", [prompt], p.max_tokens)[0])
    assert any(chained), "no step was chained"


def test_a_stop_token_found_a_step_late_is_dropped():
    ref = reference("llama", PROMPTS[:3], 16)
    stop = ref[1][5]  # occurs in prompt 1's continuation, so that request stops mid-chain
    params = ts.SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop,))
    on, reasons, chained = run(PROMPTS[:3], params, overlap=True)
    off, reasons_off, _ = run(PROMPTS[:3], params, overlap=False)
    assert on == off and reasons == reasons_off
    assert on[1][-1] == stop and reasons[1] == "stop" and any(chained)


def test_overlap_under_page_pressure_matches_hf():
    params = ts.SamplingParams(temperature=0.0, max_tokens=16)
    on, _, _ = run(PROMPTS, params, overlap=True, num_kv_pages=24, max_num_seqs=4)
    assert [list(t) for t in on] == [list(r) for r in reference("llama", PROMPTS, 16)]


def test_the_chain_goes_on_past_a_finished_request_and_waits_to_admit():
    """A request that finishes leaves the chain without breaking it (its row is dropped on the
    device), and a request waiting for a seat joins a few chained steps later, not at once."""
    prompts = PROMPTS[:3]
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 9, 30)]
    want = [list(reference("llama", [p], q.max_tokens, eos=None)[0]) for p, q in zip(prompts, params)]
    tokens, _, steps = run(prompts, params)
    assert [list(t) for t in tokens] == want
    assert steps.count(False) == 1, steps          # one unchained launch: the first
    tokens, _, steps = run(prompts, params, max_num_seqs=2)
    assert [list(t) for t in tokens] == want
    breaks = [i for i, chained in enumerate(steps) if not chained]
    assert len(breaks) == 2 and breaks[1] >= 4, steps   # the third joined after >= 4 chained steps
