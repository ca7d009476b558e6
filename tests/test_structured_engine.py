"""Constrained decoding through ``ts.LLM.generate``: what a request's ``structured_outputs``,
``allowed_token_ids`` and ``logit_bias`` ask is what it gets, sampled at temperature 1 over
several seeds, with overlap on or off, with n > 1, beside unconstrained requests and under
speculative decoding; what cannot be served is refused at the call, by field.

The model is a tiny random Llama over SmolLM2's real vocabulary (``text_models``): its
text is nonsense, so every constrained token is the mask's doing."""

import json
import re
import threading
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.api.prompts import Prompt
from tokenspeed.engine.constrained_steps import BESIDE_FILL_ROWS
from tokenspeed.engine.speculative import PerRequestDrafts
from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.masked_draws import MaskedDraws

from text_models import text_model_dir

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "kind", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,5}-[0-9]{2,3}"
CHOICE = ["red", "green", "blue", "light yellow"]
PROMPT = "Describe a pet:"
SEEDS = range(4)


@pytest.fixture(scope="module")
def llm():
    return ts.LLM(str(text_model_dir()), page_size=4)


@pytest.fixture(scope="module")
def llm_sync():
    return ts.LLM(str(text_model_dir()), page_size=4, overlap=False)


def constrained(spec: ts.StructuredOutputs, seed: int, max_tokens: int = 96, **kw) -> ts.SamplingParams:
    return ts.SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec, **kw)


def texts(llm, params, prompts=(PROMPT,)) -> list[str]:
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    return [c.text for o in outs for c in o.outputs]


def test_json_samples_parse_and_validate(llm):
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed) for seed in SEEDS]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_regex_and_choice_hold(llm):
    for seed in SEEDS:
        [text] = texts(llm, constrained(ts.StructuredOutputs(regex=REGEX), seed))
        assert re.fullmatch(REGEX, text), text
    chosen = {t for seed in SEEDS for t in texts(llm, constrained(ts.StructuredOutputs(choice=CHOICE), seed))}
    assert chosen <= set(CHOICE)


def test_allowed_token_ids_only_yield_those_ids(llm):
    allowed = [11, 305, 1024, 4000]
    for seed in SEEDS:
        out = llm.generate([PROMPT], ts.SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                                                       allowed_token_ids=allowed), use_tqdm=False)
        assert set(out[0].outputs[0].token_ids) <= set(allowed)


def test_a_logit_bias_of_100_makes_its_token_chosen(llm):
    for seed in SEEDS:
        out = llm.generate([PROMPT], ts.SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                                                       logit_bias={777: 100}), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == [777] * 8


def test_greedy_output_a_constraint_already_allows_is_unchanged(llm):
    plain = llm.generate([PROMPT], ts.SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    regex = re.escape(plain.text) + r"[\s\S]*"
    held = llm.generate([PROMPT], ts.SamplingParams(temperature=0, max_tokens=12,
                                                    structured_outputs=ts.StructuredOutputs(regex=regex)),
                        use_tqdm=False)[0].outputs[0]
    assert held.token_ids == plain.token_ids


def mixed_batch(seed: int) -> list[ts.SamplingParams]:
    """Constrained and unconstrained rows side by side, a few sampled, one greedy."""
    return [constrained(ts.StructuredOutputs(json=SCHEMA), seed),
            ts.SamplingParams(temperature=1.0, seed=seed + 1, max_tokens=24),
            constrained(ts.StructuredOutputs(regex=REGEX), seed + 2),
            ts.SamplingParams(temperature=0, max_tokens=30, structured_outputs=ts.StructuredOutputs(json=SCHEMA)),
            ts.SamplingParams(temperature=1.0, seed=seed + 3, max_tokens=10, allowed_token_ids=[5, 6, 7],
                              logit_bias={6: 3.0})]


def test_overlap_gives_the_tokens_of_the_synchronous_loop_and_chains(llm, llm_sync):
    chained, prepare = [], llm.compiled.decode.prepare
    llm.compiled.decode.prepare = lambda rows, s, fed=None: (chained.append(fed is not None and any(
        r.params.structured_outputs is not None for r in s)), prepare(rows, s, fed))[1]
    try:
        on = llm.generate([PROMPT] * 5, mixed_batch(7), use_tqdm=False)
    finally:
        del llm.compiled.decode.prepare
    off = llm_sync.generate([PROMPT] * 5, mixed_batch(7), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert any(chained), "no constrained decode step was chained onto the step in flight"
    jsonschema.validate(json.loads(on[0].outputs[0].text), SCHEMA)
    assert re.fullmatch(REGEX, on[2].outputs[0].text)


def test_a_chained_step_is_prepared_before_the_draw_it_follows_and_enqueued_after(llm, monkeypatch):
    """A constrained step awaiting its masks is drawn between the next step's host work
    (``DecodeRunner.prepare``) and that step's enqueue, so the host's work for the next
    step runs while the device runs the forward (``Engine._follow``)."""
    calls, decode = [], llm.compiled.decode
    for name in ("prepare", "enqueue", "draw"):
        method = getattr(decode, name)
        monkeypatch.setattr(decode, name, lambda *a, _n=name, _m=method: (calls.append(_n), _m(*a))[1])
    endless = ts.StructuredOutputs(json={"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1000})
    out = llm.generate([PROMPT] * 2, ts.SamplingParams(temperature=0, max_tokens=8, structured_outputs=endless),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    steps = "".join(name[0] for name in calls)   # p(repare), e(nqueue), d(raw)
    # the first decode step chains onto the prompt's (drawn by the prefill runner), the last
    # has none chained onto it: 7 steps for the 7 tokens after the prompt's
    assert steps == "pe" + "pde" * 6 + "d", steps


def test_a_batch_of_constrained_rows_is_prepared_beside_its_fill(llm, llm_sync, monkeypatch):
    """At ``BESIDE_FILL_ROWS`` rows a chained step's host work runs on the helper thread while
    the engine's thread fills the masks (``Engine._drawn_beside``); the tokens are those of
    the synchronous loop, which never chains; the helper runs under the engine's inference mode."""
    threads, modes, decode = [], [], llm.compiled.decode
    prepare = decode.prepare
    monkeypatch.setattr(decode, "prepare", lambda *a: (threads.append(threading.current_thread().name),
                                                       modes.append(torch.is_inference_mode_enabled()), prepare(*a))[2])
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed, max_tokens=24) for seed in range(BESIDE_FILL_ROWS)]
    on = llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)
    off = llm_sync.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert any(name.startswith("tokenspeed-prepare") for name in threads), threads
    assert threading.main_thread().name in threads   # the first decode step, chained onto no draw
    assert all(modes)


def test_a_batch_with_few_constrained_rows_prepares_on_the_engines_thread(llm, monkeypatch):
    """Under ``BESIDE_FILL_ROWS`` constrained rows the fill is short: no hand-off, however
    many plain rows share the step."""
    threads, decode = [], llm.compiled.decode
    prepare = decode.prepare
    monkeypatch.setattr(decode, "prepare", lambda *a: (threads.append(threading.current_thread().name), prepare(*a))[1])
    few = BESIDE_FILL_ROWS - 1
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed, max_tokens=12) for seed in range(few)]
    params += [ts.SamplingParams(temperature=0, max_tokens=12)] * 4
    assert all(len(o.outputs[0].token_ids) > 2 for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False))
    assert set(threads) == {threading.main_thread().name}


def test_a_fill_that_fails_beside_a_preparation_leaves_nothing_behind(llm, monkeypatch):
    """The fill's error is raised once the helper's preparation has ended; the engine holds
    nothing of the step and serves the next call as before."""
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed, max_tokens=12) for seed in range(BESIDE_FILL_ROWS)]
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)]
    prepared, decode = threading.Event(), llm.compiled.decode
    prepare = decode.prepare
    monkeypatch.setattr(decode, "prepare", lambda *a: (time.sleep(0.3), prepared.set(), prepare(*a))[2])
    fills = []

    def fill(rows, num_rows):
        fills.append(num_rows)
        if len(fills) == 3:   # a chained step's: its next step is being prepared beside it
            prepared.clear()
            raise RuntimeError("fill failed")
        return filled(rows, num_rows)
    filled = llm.engine._filled
    monkeypatch.setattr(llm.engine, "_filled", fill)
    with pytest.raises(RuntimeError, match="fill failed"):
        llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)
    assert prepared.is_set() and not llm.engine.scheduler.running and not llm.engine.scheduler.waiting
    assert llm.engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)] == want


def test_an_interrupted_wait_for_the_helper_waits_it_out(llm, monkeypatch):
    """Ctrl-C while the engine waits for the step prepared beside a fill: the interrupt is
    raised once the preparation is done, so the engine, used again at once, meets no
    staging still in progress."""
    from tokenspeed.engine import constrained_steps
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed, max_tokens=12) for seed in range(BESIDE_FILL_ROWS)]
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)]
    prepared, decode, waits = threading.Event(), llm.compiled.decode, []
    prepare, wait_for = decode.prepare, constrained_steps.wait
    monkeypatch.setattr(decode, "prepare", lambda *a: (time.sleep(0.3), prepared.set(), prepare(*a))[2])

    def wait(pending):
        waits.append(len(waits))
        if len(waits) == 1:   # the first wait for a helper is interrupted
            prepared.clear()
            raise KeyboardInterrupt
        return wait_for(pending)
    monkeypatch.setattr(constrained_steps, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)
    assert prepared.is_set() and len(waits) >= 2
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT] * BESIDE_FILL_ROWS, params, use_tqdm=False)] == want


def test_a_masked_draw_replayed_gives_the_eager_draws_tokens(llm, monkeypatch):
    """With the CPU stand-in's captures, a decode step whose rows need only their masks
    replays its rung's masked draw (``execution.masked_draws``): the tokens of the eager
    draws. Four rows under a schema no run of 24 tokens completes keep the rung full."""
    endless = ts.StructuredOutputs(json={"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1000})
    params = [constrained(endless, seed, max_tokens=24) for seed in range(4)]
    graphed = ts.LLM(str(text_model_dir()), page_size=4, max_num_seqs=4, graphs=True, capture_sizes=(2, 4))
    replays, replay = [], MaskedDraws.replay
    monkeypatch.setattr(MaskedDraws, "replay", lambda self, rung, bitmask: (replays.append(replay(self, rung, bitmask)),
                                                                            replays[-1])[1])
    on = graphed.generate([PROMPT] * 4, params, use_tqdm=False)
    off = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert all(len(o.outputs[0].token_ids) == 24 for o in on) and sum(replays) >= 20


def test_requests_join_constrained_ones_in_flight_by_chained_extends(llm_sync):
    """Two seats, five requests: each join is an extend chained onto the constrained decode
    step in flight, its constrained rows drawn once that step is read."""
    joining = ts.LLM(str(text_model_dir()), page_size=4, max_num_seqs=2)
    fed, forward = [], joining.compiled.prefill.forward
    joining.compiled.prefill.forward = lambda c, s, f=None: (fed.append(bool(f and f.rows)), forward(c, s, f))[1]
    params = mixed_batch(5)
    on = joining.generate([PROMPT] * 5, params, use_tqdm=False)
    off = llm_sync.generate([PROMPT] * 5, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert any(fed), "no constrained extend was chained onto a step in flight"


def test_preempted_constrained_requests_recompute_to_the_same_tokens(llm):
    """A request preempted for pages keeps its matcher where its read tokens left it."""
    tight = ts.LLM(str(text_model_dir()), page_size=4, num_kv_pages=30, max_num_seqs=4)
    preempted, preempt = [], tight.engine.scheduler._preempt
    tight.engine.scheduler._preempt = lambda request: (preempted.append(request.id), preempt(request))
    params = mixed_batch(3) + mixed_batch(9)
    roomy = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    pressed = tight.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in pressed] == [o.outputs[0].token_ids for o in roomy]
    assert preempted, "no request was preempted"


def test_a_finished_request_still_held_leaves_its_lexer_idle(llm):
    """A finished request whose answer is unread holds no matcher: the schema's lexers count
    it idle, so the next request takes the first, warm lexer, not a fresh one."""
    spec = ts.StructuredOutputs(choice=CHOICE)
    prompt = Prompt(tuple(llm.tokenizer.encode(PROMPT)), PROMPT)
    held = [r for group in llm.add([prompt] * 2, [constrained(spec, 7)] * 2) for r in group]
    while not all(r.finished for r in held):
        llm.step()
    assert all(r.constraint.matcher is None for r in held)
    assert not any(lexer.live for lexer in llm.engine.grammars._kept[spec].kept)
    llm.release(held)


def test_each_of_n_completions_holds_its_constraint(llm):
    out = llm.generate([PROMPT], constrained(ts.StructuredOutputs(choice=CHOICE), 3, n=4), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(c.text in CHOICE and c.finish_reason == "stop" for c in out.outputs)


def test_a_bad_schema_is_refused_at_the_call_and_nothing_else_is_affected(llm):
    good = constrained(ts.StructuredOutputs(regex=REGEX), 1)
    bad = ts.SamplingParams(structured_outputs=ts.StructuredOutputs(json={"type": "object", "minProperties": "x"}))
    with pytest.raises(RefusedRequest, match=r"structured_outputs\.json") as caught:
        llm.generate([PROMPT, PROMPT], [good, bad], use_tqdm=False)
    assert caught.value.field == "structured_outputs.json"
    assert not llm.engine.has_work and llm.engine._num_constrained == 0
    assert re.fullmatch(REGEX, texts(llm, good)[0])


@pytest.mark.parametrize("bad", [
    dict(structured_outputs=ts.StructuredOutputs(choice=["yes"]), allowed_token_ids=[89, 90]),   # share no token
    dict(structured_outputs=ts.StructuredOutputs(   # past a limit: a rule of 2,000 alternatives
        grammar="start: " + " | ".join(f'"opt{i}"' for i in range(2000)))),
    dict(structured_outputs=ts.StructuredOutputs(grammar='start: "(" start ")"'))])   # no text ends it
def test_constraints_that_leave_no_token_end_their_request_alone(llm, bad):
    """Found mid-run, not at the door: the engine ends that request with its error, the
    call that made it is refused naming the prompt, and another caller's request in the
    same steps goes on (before, the step failed and took every request with it)."""
    plain = ts.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [other] = llm.engine.add((5, 6, 7), plain)
    with pytest.raises(RefusedRequest, match="prompt 1: structured_outputs: the request's constraints left no token"):
        llm.generate([PROMPT, PROMPT], [plain, ts.SamplingParams(temperature=0, max_tokens=40, **bad)],
                     use_tqdm=False)
    with torch.inference_mode():
        while llm.engine.has_work:
            llm.engine.step()
    assert (other.finish_reason, len(other.output), other.error) == ("length", 24, None)
    assert llm.engine._num_constrained == 0


def test_the_schema_true_is_any_json_value(llm):
    """A boolean JSON Schema, given as text (before: a bare ValueError, a 500 on the server)."""
    [out] = llm.generate([PROMPT], ts.SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                                      structured_outputs=ts.StructuredOutputs(json="true")),
                         use_tqdm=False)
    answer = out.outputs[0]
    assert answer.finish_reason in ("stop", "length")
    if answer.finish_reason == "stop":
        json.loads(answer.text)   # raises where the answer is no JSON


def test_a_stream_with_a_bad_grammar_is_refused_at_the_call(llm):
    with pytest.raises(RefusedRequest, match=r"structured_outputs\.regex"):
        llm.stream(PROMPT, ts.SamplingParams(structured_outputs=ts.StructuredOutputs(regex="[z-a]")))
    assert not llm.engine.has_work


@pytest.mark.parametrize("params, field", [
    (ts.SamplingParams(logit_bias={49152: 1.0}), "logit_bias"),
    (ts.SamplingParams(allowed_token_ids=[3, 10**6]), "allowed_token_ids"),
    (ts.SamplingParams(structured_outputs=ts.StructuredOutputs(regex="(unclosed")), "structured_outputs.regex"),
    (ts.SamplingParams(min_tokens=2, structured_outputs=ts.StructuredOutputs(choice=["a"])), "min_tokens"),
    (ts.SamplingParams(structured_outputs=ts.StructuredOutputs(regex=r"[^\s\S]")), "structured_outputs.regex"),
    (ts.SamplingParams(structured_outputs=ts.StructuredOutputs(grammar="start: /[^\\s\\S]/")),
     "structured_outputs.grammar"),   # no text satisfies either (before: an empty answer, "stop")
    (ts.SamplingParams(structured_outputs=ts.StructuredOutputs(json="false")), "structured_outputs.json")])
def test_bad_ids_and_grammars_are_refused_by_field(llm, params, field):
    with pytest.raises(RefusedRequest) as caught:
        llm.generate([PROMPT], params, use_tqdm=False)
    assert caught.value.field == field and field in str(caught.value)


def test_an_engine_without_a_tokenizer_refuses_structured_outputs(llm):
    engine, grammars = llm.engine, llm.engine.grammars
    engine.grammars = None
    try:
        with pytest.raises(RefusedRequest, match="structured_outputs: this engine has no tokenizer"):
            engine.add((1, 2, 3), ts.SamplingParams(structured_outputs=ts.StructuredOutputs(choice=["a"])))
    finally:
        engine.grammars = grammars
    assert not engine.has_work


class AnswerDrafts(PerRequestDrafts):
    """Drafts from the answers plain decoding gave (found by their prompts), every other
    window's last draft wrong: windows keep some drafts and reject others."""

    def __init__(self, answers: dict[tuple[int, ...], tuple[int, ...]]):
        self.answers = answers

    def propose(self, tokens, limit: int) -> tuple[int, ...]:
        tokens = tuple(tokens)
        for prompt, answer in self.answers.items():
            if tokens[:len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(answer[done:done + min(limit, 3)])
                if drafts and done % 2:
                    drafts[-1] = drafts[-1] + 1
                return tuple(drafts)
        return ()


def test_speculative_decoding_gives_the_tokens_of_plain_constrained_decoding(llm):
    prompts = [PROMPT, "Describe a cat:", "Describe a dog:"]
    params = [ts.SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in
              (ts.StructuredOutputs(json=SCHEMA), ts.StructuredOutputs(regex=r"[a-z ]{1,60}"), None)]
    plain = llm.generate(prompts, params, use_tqdm=False)
    drafting = ts.LLM(str(text_model_dir()), page_size=4, speculative=ts.SpeculativeConfig(verify_cost=1.0))
    drafting.engine.drafter = AnswerDrafts({o.prompt_token_ids: o.outputs[0].token_ids for o in plain})
    windows, launch = [], drafting.compiled.verify.launch

    def verify(rows, sampling, masks=None):
        windows.append((len(rows), masks is not None and masks.bitmask is not None))
        return launch(rows, sampling, masks=masks)
    drafting.compiled.verify.launch = verify
    with_drafts = drafting.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in with_drafts] == [o.outputs[0].token_ids for o in plain]
    assert any(masked and rows > 3 for rows, masked in windows), f"no masked window held drafts: {windows}"


SPECS = {"json": ts.StructuredOutputs(json=SCHEMA), "regex": ts.StructuredOutputs(regex=REGEX),
         "choice": ts.StructuredOutputs(choice=CHOICE), None: None}
row = st.builds(lambda kind, seed, greedy, max_tokens: ts.SamplingParams(
    temperature=0.0 if greedy else 1.0, seed=seed, max_tokens=max_tokens, structured_outputs=SPECS[kind]),
    st.sampled_from(list(SPECS)), st.integers(0, 2**16), st.booleans(), st.integers(1, 32))


def holds(params: ts.SamplingParams, text: str, reason: str) -> bool:
    """A completion that stopped spells what its constraint asks (one cut by its length
    need not be complete)."""
    spec = params.structured_outputs
    if spec is None or reason != "stop":
        return True
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return bool(re.fullmatch(REGEX, text)) if spec.kind == "regex" else text in CHOICE


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(row, min_size=1, max_size=5))
def test_mixed_workloads_hold_their_constraints_with_or_without_overlap(llm, llm_sync, params):
    prompts = [f"{PROMPT} {i}" for i in range(len(params))]
    on = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    off = [o.outputs[0] for o in llm_sync.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert all(holds(p, c.text, c.finish_reason) for p, c in zip(params, on))


def test_masked_rows_draw_the_same_tokens_on_either_route(llm, monkeypatch):
    """A decode step whose rows need nothing but their masks draws them inside the Gumbel-max
    (``StepMasks.draw``); its tokens are those of the general route (``sampler.sample``)."""
    from tokenspeed.execution.step_masks import StepMasks
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed, max_tokens=24) for seed in SEEDS[:2]]
    params.append(ts.SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=ts.StructuredOutputs(regex=REGEX)))
    draws = []
    monkeypatch.setattr(StepMasks, "draw", lambda self, *a, _draw=StepMasks.draw: draws.append(1) or _draw(self, *a))
    fused = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert draws
    monkeypatch.setattr(StepMasks, "masks_only", property(lambda self: False))
    general = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in general]
