"""Text, stop strings and finish decided in one place, the caller's (``PromptOutput``):
``LLM.generate`` cuts at the stop string an independent reading of the unconstrained
output finds; the answer does not depend on how the engine's tokens are split into
updates, nor on tokens the engine made after the stop; a stop string finishes the
engine's request (its pages return); and the engine's reports carry no text."""

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.api.engine_core import EngineCore
from tokenspeed.server.engine_loop import EngineLoop, Submit
from tokenspeed.api.messages import Completed, TokenDelta, TokenUpdate
from tokenspeed.api.output_processor import PromptOutput
from tokenspeed.api.prompts import parse_prompts

from text_models import text_model_dir

PROMPT = "The sea is"
LENGTH = 24
PLAIN = ts.SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return ts.LLM(text_model_dir(), page_size=4, max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="module")
def plain(llm):
    return llm.generate(PROMPT, PLAIN, use_tqdm=False)[0]


def first_stop(tokenizer, token_ids, stops) -> tuple[int, str, str] | None:
    """By decoding each prefix whole: the tokens kept (up to the one whose text completes a
    stop string), the stop (the earliest to end, then the longest) and the text before it."""
    for kept in range(1, len(token_ids) + 1):
        text = tokenizer.decode(list(token_ids[:kept]))
        found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
        if found:
            stop = min(found)[2]
            return kept, stop, text[:text.find(stop)]
    return None


def stop_strings(text: str):
    """One to three pieces of ``text`` (some past its end: never found)."""
    piece = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)).map(lambda p: text[p[0]:p[0] + p[1]])
    return st.lists(st.one_of(piece, st.just("never in the text")), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generate_cuts_at_the_stop_string_found_in_the_plain_output(llm, plain, data):
    stops = data.draw(stop_strings(plain.text))
    [got] = llm.generate(PROMPT, ts.SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True, stop=stops),
                         use_tqdm=False)
    want = first_stop(llm.tokenizer, plain.token_ids, stops)
    if want is None:
        assert (got.text, got.token_ids, got.finish_reason) == (plain.text, plain.token_ids, "length")
        return
    kept, stop, text = want
    assert (got.text, got.token_ids, got.finish_reason, got.outputs[0].stop_reason) == \
        (text, plain.token_ids[:kept], "stop", stop)


def first_stop_after(tokenizer, token_ids, stops, min_tokens: int) -> tuple[int, str, str] | None:
    """``first_stop`` under vLLM's ``min_tokens`` rule: a stop string counts where a token
    after the first ``min_tokens`` completes it (it ends past the text before that token),
    wherever it begins."""
    for kept in range(min_tokens + 1, len(token_ids) + 1):
        before, text = tokenizer.decode(list(token_ids[:kept - 1])), tokenizer.decode(list(token_ids[:kept]))
        found = [(start + len(s), -len(s), start, s) for s in stops
                 if (start := text.find(s, max(len(before) - len(s) + 1, 0))) >= 0]
        if found:
            _, _, start, stop = min(found)
            return kept, stop, text[:start]
    return None


@pytest.mark.parametrize("min_tokens", [5, 6, 7])
@pytest.mark.parametrize("span", ["across", "within"])
def test_min_tokens_matches_a_stop_string_completed_after_them_wherever_it_begins(llm, plain, min_tokens, span):
    """As vLLM: a stop string the 7th token completes counts for min_tokens 6 even where it
    begins in the 5th token's text, and not for min_tokens 7."""
    five, seven = (llm.tokenizer.decode(list(plain.token_ids[:k])) for k in (5, 7))
    six = llm.tokenizer.decode(list(plain.token_ids[:6]))
    stop = five[-2:] + seven[len(five):len(six) + 2] if span == "across" else seven[len(six):].strip()
    params = ts.SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True, stop=[stop],
                               min_tokens=min_tokens)
    for got in (llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0],
                "".join(llm.stream(PROMPT, params))):
        want = first_stop_after(llm.tokenizer, plain.token_ids, [stop], min_tokens)
        if min_tokens < 7:
            assert want[0] == 7
        if isinstance(got, str):   # the stream sends the same text, nothing it takes back
            assert got == (plain.text if want is None else want[2])
        elif want is None:
            assert (got.text, got.token_ids, got.finish_reason) == (plain.text, plain.token_ids, "length")
        else:
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
                (want[2], plain.token_ids[:want[0]], "stop", stop)


def engine_updates(token_ids, cuts, finish: str) -> list[TokenUpdate]:
    """The engine's updates of one completion of ``token_ids``, split at ``cuts``; the last
    one finishes it."""
    bounds = [0, *sorted(set(cuts)), len(token_ids)]
    spans = [token_ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    return [TokenUpdate((TokenDelta(0, tuple(span), (), finish if i == len(spans) - 1 else None, None),),
                        i == len(spans) - 1, 3, None, (), False) for i, span in enumerate(spans)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_answer_does_not_depend_on_how_the_tokens_arrive(llm, plain, data):
    """However the engine's tokens are split into updates (one a step, or a stream
    interval's worth), and however many it made past the stop before it heard: the same
    text, kept tokens and finish, counted as kept; the engine is told to finish the
    completion once, when the stop came before the engine's own end."""
    stops = data.draw(stop_strings(plain.text))
    cuts = data.draw(st.lists(st.integers(1, LENGTH - 1), max_size=6))
    params = ts.SamplingParams(temperature=0, max_tokens=LENGTH, stop=stops)
    output = PromptOutput(llm.tokenizer, params, 3)
    answers, told = [], []
    for update in engine_updates(plain.token_ids, cuts, "length"):
        answer, stopped = output.update(update)
        answers += [answer] if answer is not None else []
        told += stopped
    deltas = [d for a in answers for d in a.deltas]
    want = first_stop(llm.tokenizer, plain.token_ids, stops)
    kept, stop, text = want if want is not None else (LENGTH, None, plain.text)
    assert "".join(d.text for d in deltas) == text
    assert tuple(t for d in deltas for t in d.token_ids) == plain.token_ids[:kept]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (("stop", stop) if stop else ("length", None))
    assert answers[-1].finished and [a.finished for a in answers].count(True) == 1
    last_start = max([c for c in cuts if c < LENGTH], default=0)
    assert told == ([0] if stop is not None and kept <= last_start else [])
    [figures] = output.completed((Completed(LENGTH, "abort" if told else "length", 0.1, 0.01),))
    assert (figures.num_output_tokens, figures.finish_reason) == (kept, deltas[-1].finish_reason)


def test_a_stop_string_finishes_the_engines_request_and_its_pages_return(llm, plain):
    """Through the engine-client interface, as the server's processes use it: the answer
    is final at the stop string, the engine is told, stops within a step or two, and every
    page comes back."""
    core, key = EngineCore(llm.engine), "stopped"
    stop = plain.text[len(plain.text) // 3:len(plain.text) // 3 + 3]
    params = ts.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])
    [prompt] = parse_prompts(PROMPT, llm.tokenizer)
    [request] = core.add(key, prompt.token_ids, params)
    output, deltas = PromptOutput(llm.tokenizer, params, len(prompt.token_ids)), []
    while core.has_work:
        for _, update in core.step():
            answer, stopped = output.update(update)
            deltas += answer.deltas if answer is not None else []
            for index in stopped:
                core.finish(key, index)
    kept, _, text = first_stop(llm.tokenizer, plain.token_ids, [stop])
    assert "".join(d.text for d in deltas) == text and deltas[-1].stop_reason == stop
    assert request.finished and len(request.output) <= kept + 3
    assert llm.engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1
    assert list(core.keys) == []


def test_a_prompt_read_at_its_end_gets_its_tokens_once_it_finishes(llm, plain):
    """``at_end`` (``generate``'s answers without stop strings): no update before a
    completion ends, then every token at once; a prompt beside it read as it grows gets one
    a step, and an abort of a prompt read at its end is reported at the next step."""
    core = EngineCore(llm.engine)
    [prompt] = parse_prompts(PROMPT, llm.tokenizer)
    core.add("end", prompt.token_ids, PLAIN, at_end=True)
    core.add("grows", prompt.token_ids, PLAIN)
    core.add("aborted", prompt.token_ids, PLAIN, at_end=True)
    updates = {"end": [], "grows": [], "aborted": []}
    steps = 0
    while core.has_work:
        if steps == 3:
            core.engine.finish(core._live["aborted"].requests[0], "abort")   # as OfflineClient.abort does
        for key, update in core.step():
            updates[key].append((steps, update))
        steps += 1
    [(_, end)] = updates["end"]
    assert end.finished and end.deltas[0].token_ids == tuple(plain.token_ids)
    assert len(updates["grows"]) >= LENGTH - 1 and updates["grows"][-1][1].finished
    [(when, aborted)] = updates["aborted"]
    assert when == 3 and aborted.finished and aborted.deltas[0].finish_reason == "abort"


def test_a_prompt_with_stop_strings_is_not_read_at_its_end_only(llm):
    [prompt] = parse_prompts(PROMPT, llm.tokenizer)
    with pytest.raises(ValueError, match=r"stop=\['sea'\]: a prompt with stop strings"):
        EngineCore(llm.engine).add("stops", prompt.token_ids, PLAIN.clone(stop=["sea"]), at_end=True)


def loop_reports(llm, at_end: bool) -> list:
    """The engine loop's reports of one submission of ``PROMPT`` (key 1), until it finishes."""
    reports = []
    loop = EngineLoop(EngineCore(llm.engine), lambda client, report: reports.append(report), print).start()
    [prompt] = parse_prompts(PROMPT, llm.tokenizer)
    loop.inbox.put(Submit(1, prompt, PLAIN, 0, at_end))
    try:
        for _ in range(600):
            if any(u.finished for r in list(reports) for _, u in r.updates):
                break
            loop.thread.join(0.05)
    finally:
        loop.stop()
    return reports


def test_the_engine_sends_token_ids_and_no_text(llm, plain):
    """The engine loop's reports, encoded as they cross to the API process, hold the
    completion's tokens but not its text: that is made where it is read."""
    reports = loop_reports(llm, at_end=False)
    sent = b"".join(msgspec.msgpack.encode(r) for r in reports)
    tokens = [t for r in reports for _, u in r.updates for d in u.deltas for t in d.token_ids]
    assert tuple(tokens) == plain.token_ids and len(plain.text) > 20
    assert plain.text.encode() not in sent and plain.text[5:15].encode() not in sent


def test_a_submission_read_at_its_end_gets_one_report_with_every_token(llm, plain):
    """``Submit.at_end`` (an answer the API process sends whole): the loop reports the
    prompt once, finished, with all its tokens."""
    [update] = [u for r in loop_reports(llm, at_end=True) for key, u in r.updates if key == 1]
    assert update.finished and update.deltas[0].token_ids == tuple(plain.token_ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip_special", [True, False])
def test_the_token_that_ended_the_answer_is_kept_without_its_text(llm, plain, include, skip_special):
    """An end-of-sequence token (stop_token its id, stop_reason None) or a stop token ends
    the answer: kept among its tokens, its text left out even where special tokens are
    kept for a tool parser (``<|im_end|>`` once ended a tool-enabled reply), unless
    ``include_stop_str_in_output`` asks for it."""
    eos = llm.tokenizer.eos_token_ids[0]
    stop = plain.token_ids[5]
    for stop_token, stop_ids, reason in ((eos, (), None), (stop, (stop,), stop)):
        params = ts.SamplingParams(temperature=0, max_tokens=LENGTH, stop_token_ids=stop_ids,
                                   skip_special_tokens=skip_special, include_stop_str_in_output=include)
        tokens = plain.token_ids[:5] + (stop_token,)
        output = PromptOutput(llm.tokenizer, params, 3)
        for i in range(len(tokens)):   # a token an update, the last one ending it
            ended = i == len(tokens) - 1
            update = TokenUpdate((TokenDelta(0, tokens[i:i + 1], (), "stop" if ended else None,
                                             stop_token if ended else None),), ended, 3, None, (), False)
            answer, _ = output.update(update)
        last = answer.deltas[-1]
        whole = llm.tokenizer.decode(list(tokens), skip_special_tokens=skip_special)
        before = llm.tokenizer.decode(list(tokens[:-1]), skip_special_tokens=skip_special)
        assert whole != before or (skip_special and stop_token == eos)   # the token has a text to leave out
        assert (last.finish_reason, last.stop_reason) == ("stop", reason)
        assert output.outputs()[0].token_ids == tokens
        assert output.outputs()[0].text == (whole if include else before)


def test_a_stop_string_stays_in_the_text_when_asked(llm, plain):
    stop = plain.text[10:14]
    params = ts.SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=True)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    assert out.text == plain.text[:plain.text.find(stop) + len(stop)]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
