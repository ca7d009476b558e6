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
    prepare = llm.compiled.decode.prepare

    def counting(rows, p, fed=None):
        steps.append(fed is not None)
        return prepare(rows, p, fed)

    llm.compiled.decode.prepare = counting
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
    """Decode steps chain onto the extend before them and past a request that finishes (its
    row is dropped on the device); a request waiting for a seat joins a few chained steps
    later, not at once."""
    prompts = PROMPTS[:3]
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 9, 30)]
    want = [list(reference("llama", [p], q.max_tokens, eos=None)[0]) for p, q in zip(prompts, params)]
    for max_num_seqs in (3, 2):
        llm = ts.LLM(checkpoint("llama"), page_size=4, max_num_seqs=max_num_seqs)
        launches = []
        for name, method in (("prefill", "launch"), ("decode", "prepare")):   # a decode step is prepared first
            runner = getattr(llm.compiled, name)
            launch = getattr(runner, method)
            setattr(runner, method, lambda *a, _n=name, _l=launch: (launches.append(
                "chained" if _n == "decode" and len(a) == 3 and a[2] is not None else _n), _l(*a))[1])
        got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert "decode" not in launches, launches           # every decode step was chained
        if max_num_seqs == 2:                               # the third waited >= 4 chained steps
            second = launches.index("prefill", 1)
            assert launches[1:second] == ["chained"] * (second - 1) and second - 1 >= 4, launches


@pytest.mark.parametrize("kw", [{"max_num_batched_tokens": 8}, {"max_num_seqs": 3},
                                {"num_kv_pages": 24, "max_num_seqs": 4, "max_num_batched_tokens": 12},
                                {"max_num_seqs": 3, "enable_prefix_caching": False}])
def test_extend_batches_chain_onto_the_step_in_flight(kw):
    """While prompts wait for seats or are computed in chunks, the next extend batch is
    launched before the step in flight is read, the rows of that step's requests fed on
    the device: the tokens, a stop token found a step late included, are the synchronous
    loop's and Hugging Face's, and every page returns."""
    prompts = PROMPTS + PROMPTS[:2]                 # repeats: prefix cache hits
    stop = reference("llama", PROMPTS[1:2], 16)[0][4]
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=(stop,))
              for n in (12, 16, 16, 7, 1, 16, 9, 5, 11)]

    def run_counting_fed(overlap):
        llm = ts.LLM(checkpoint("llama"), page_size=4, overlap=overlap, **kw)
        fed, launch = [], llm.compiled.prefill.launch
        llm.compiled.prefill.launch = lambda c, s, f=None: (fed.append(f is not None and len(f.rows)),
                                                            launch(c, s, f))[1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1, "pages leaked"
        return [(list(o.token_ids), o.finish_reason) for o in outs], fed

    on, fed = run_counting_fed(True)
    off, _ = run_counting_fed(False)
    assert on == off
    assert any(fed), "no extend batch was chained"
    for prompt, (tokens, _), p in zip(prompts, on, params):
        want = list(reference("llama", [prompt], p.max_tokens)[0])
        want = want[:want.index(stop) + 1] if stop in want else want
        assert tokens == want
