"""``POST /v1/completions``: the response's and the stream's shapes, several prompts and
samples, stop strings and lengths, logprobs and their text offsets, and refusals."""

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.server.openai.protocol import MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOP_STRINGS

from openai_http import MODEL, assert_error

PATH = "/v1/completions"


def test_a_completion_has_openais_shape(api):
    body = api.post(PATH, {"model": MODEL, "prompt": "The sea is", "max_tokens": 5, "temperature": 0}).json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == MODEL
    [choice] = body["choices"]
    assert set(choice) >= {"index", "text", "logprobs", "finish_reason"} and choice["index"] == 0
    assert choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_max_tokens_ends_in_length_and_equals_offline(client, llm):
    got = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                        use_tqdm=False)[0]
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 7 and got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_none_from_the_client_means_unset(client, llm):
    """The client's nulls (arguments given as None) leave their fields at OpenAI's defaults."""
    got = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=7, temperature=0, n=None,
                                    echo=None, stream=None, presence_penalty=None, frequency_penalty=None)
    want = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)[0]
    assert [c.text for c in got.choices] == [want.text]


def test_several_prompts_times_n_are_indexed_prompt_major(client, llm):
    got = client.completions.create(model=MODEL, prompt=["One", "Two", "Three"], max_tokens=4, n=2, seed=9)
    assert [c.index for c in got.choices] == list(range(6))
    offline = llm.generate(["One", "Two", "Three"], ts.SamplingParams(max_tokens=4, n=2, seed=9), use_tqdm=False)
    assert [c.text for c in got.choices] == [c.text for o in offline for c in o.outputs]


def test_token_id_prompts_are_prompts(client, llm):
    ids = llm.tokenizer.encode("The sea is")
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [by_text.choices[0].text] * 2


def test_a_stop_string_ends_the_text_before_it(client, llm):
    full = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    got = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.finish_reason == "stop" and got.text == full[:full.index(stop)] and stop not in got.text


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_decided_in_the_api_process_answer_as_generate_does(client, llm, data):
    """Stop strings picked from the unconstrained output: the answer, whole or streamed,
    is ``generate``'s (text, finish, stop reason, and the tokens kept as its usage)."""
    plain = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].text
    piece = st.tuples(st.integers(0, len(plain) - 1), st.integers(1, 5)).map(lambda p: plain[p[0]:p[0] + p[1]])
    stops = data.draw(st.lists(piece, min_size=1, max_size=3))
    want = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stops),
                        use_tqdm=False)[0]
    asked = dict(model=MODEL, prompt="The sea is", max_tokens=24, temperature=0, stop=stops,
                 extra_body={"ignore_eos": True})
    whole = client.completions.create(**asked)
    chunks = list(client.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert whole.choices[0].text == "".join(c.text for c in choices) == want.text
    assert whole.choices[0].finish_reason == choices[-1].finish_reason == want.finish_reason
    assert whole.choices[0].model_extra["stop_reason"] == choices[-1].model_extra["stop_reason"] == \
        want.outputs[0].stop_reason
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_a_stream_is_chunks_then_usage_then_done(api):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks = api.stream_chunks(PATH, body)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    *texts, usage = chunks
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in texts)
    assert [c["choices"][0]["finish_reason"] for c in texts] == [None] * (len(texts) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path, prompt_field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_each_streamed_choice_finishes_once(api, path, prompt_field):
    """Samples that finish at different steps: each choice's finish goes out once, in its
    last chunk (it was repeated in every later chunk of the request)."""
    prompt = "Sing" if prompt_field == "prompt" else [{"role": "user", "content": "Sing"}]
    body = {prompt_field: prompt, "max_tokens": 30, "n": 3, "seed": 4, "temperature": 1.0, "stop": ["e", "a"],
            "stream": True}
    chunks = [c for c in api.stream_chunks(path, body) if c["choices"]]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"][0]["finish_reason"]]
    assert sorted(index for index, _ in finishes) == [0, 1, 2]
    last = {c["choices"][0]["index"]: i for i, c in enumerate(chunks)}
    assert all(chunks[last[index]]["choices"][0]["finish_reason"] == reason for index, reason in finishes)
    assert len(set(last.values())) == 3, "the samples must finish at different steps to test this"


@pytest.mark.parametrize("path, prompt, opens", [
    ("/v1/completions", ["Hi", "The sea is"], 0),
    ("/v1/completions", ["Hi", "The sea is"], 1),      # echo: each choice opens with its prompt
    ("/v1/chat/completions", [{"role": "user", "content": "Hi"}], 1),   # the role's chunk
])
def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(api, path, prompt, opens):
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk carries its choice's
    prompt tokens and the tokens it kept so far (none in an opening chunk), the last one
    of a choice all of them; the usage chunk sums them. Without ``include_usage`` it adds
    nothing, as vLLM reads it."""
    field = "prompt" if path == PATH else "messages"
    body = {field: prompt, "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "echo": bool(opens)}
    if path != PATH:
        del body["echo"]
    *chunks, total = api.stream_chunks(path, body)
    counts = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        usage, before = chunk["usage"], counts.get(choice["index"], [])
        counts[choice["index"]] = before + [usage["completion_tokens"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert sorted(counts) == list(range(len(counts))) and len(counts) == 2 * (len(prompt) if path == PATH else 1)
    assert all(c == sorted(c) and c[-1] == 5 and (c[0] == 0) == bool(opens) for c in counts.values())
    prompt_tokens = {c["choices"][0]["index"]: c["usage"]["prompt_tokens"] for c in chunks}
    assert total["choices"] == [] and total["usage"]["completion_tokens"] == 5 * len(counts)
    assert total["usage"]["prompt_tokens"] == sum(prompt_tokens.values()) // 2
    plain = {**body, "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in c for c in api.stream_chunks(path, plain))


@pytest.mark.parametrize("path, prompt_field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
@pytest.mark.parametrize("stream", [False, True])
def test_the_answers_id_is_the_requests_own_as_vllm_names_it(api, path, prompt_field, stream):
    """The ``X-Request-Id`` header, else vLLM's ``request_id`` field, else a fresh id: the
    answer's ``id`` ends with it and the header carries it back (a value unfit for a
    header stays in the id alone)."""
    prompt = "Hi" if prompt_field == "prompt" else [{"role": "user", "content": "Hi"}]
    prefix = "cmpl-" if prompt_field == "prompt" else "chatcmpl-"

    def answer(headers=None, **fields):
        body = {prompt_field: prompt, "max_tokens": 2, "stream": stream, **fields}
        response = api.post(path, body, headers=headers or {})
        assert response.status_code == 200, response.text
        lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        ids = {json.loads(line)["id"] for line in lines[:-1]} if stream else {response.json()["id"]}
        assert len(ids) == 1
        return ids.pop(), response.headers.get("x-request-id")

    assert answer({"X-Request-Id": "trace-42"}) == (f"{prefix}trace-42", "trace-42")
    assert answer(request_id="mine") == (f"{prefix}mine", "mine")
    assert answer({"X-Request-Id": "trace-43"}, request_id="mine") == (f"{prefix}trace-43", "trace-43")
    fresh, header = answer()
    assert fresh == f"{prefix}{header}" and len(header) >= 16
    assert answer(request_id="a\nb") == (f"{prefix}a\nb", None)


def test_logprobs_have_openais_shape_and_offsets_into_the_text(client):
    choice = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, logprobs=2, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(len(top) == 2 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]   # no token is half a character here
    assert "".join(lp.tokens) == choice.text


def test_streamed_text_offsets_equal_the_whole_answers(client):
    kw = dict(model=MODEL, prompt=["Hi", "Ho"], max_tokens=10, logprobs=1, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    streamed = {c.index: [] for c in whole.choices}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.text_offset if c.logprobs else []
    assert streamed == {c.index: c.logprobs.text_offset for c in whole.choices}
    assert all(offsets[-1] > 0 for offsets in streamed.values())


def test_echo_begins_each_choice_with_its_prompt_streamed_or_not(client, llm):
    """Each choice's text is its prompt's (as sent, or its token ids spelled) and then the
    completion the same request without ``echo`` gets; a stream sends the prompt first."""
    ids = llm.tokenizer.encode("The sea is")
    kw = dict(model=MODEL, prompt=["One", "Two"], max_tokens=5, n=2, seed=3)
    plain = client.completions.create(**kw)
    echoed = client.completions.create(**kw, echo=True)
    prompts = ["One", "One", "Two", "Two"]
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(prompts, plain.choices)]
    streamed = {c.index: "" for c in echoed.choices}
    for chunk in client.completions.create(**kw, echo=True, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in echoed.choices}
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    spelled = llm.tokenizer.decode(ids, False)
    assert spelled and by_ids.choices[0].text.startswith(spelled)


def test_echo_with_logprobs_is_refused_by_name(api):
    """And a token id outside the vocabulary is refused as without ``echo``, before it is spelled."""
    assert_error(api.post(PATH, {"prompt": "x", "echo": True, "logprobs": 1}), 400, "BadRequestError", "echo",
                 "prompt's log-probabilities")
    assert_error(api.post(PATH, {"prompt": [1, 10**9], "echo": True}), 400, "BadRequestError", "prompt",
                 "outside the vocabulary")
    assert api.post(PATH, {"prompt": "x", "echo": False, "logprobs": 1, "max_tokens": 1}).status_code == 200


def test_the_default_max_tokens_is_cut_to_the_room_a_prompt_leaves(api):
    """A prompt 3 tokens short of the context, without max_tokens: its default 16 is cut to
    3 (as ``LLM.generate`` cuts its defaults), and the other prompt of the request keeps 16;
    16 asked for is refused, naming max_tokens."""
    near = [5] * (256 - 3)
    body = api.post(PATH, {"prompt": [near, [5, 6]], "temperature": 0, "ignore_eos": True}).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 3 + 16
    assert_error(api.post(PATH, {"prompt": near, "max_tokens": 16}), 400, "BadRequestError", "max_tokens",
                 "exceeds max_model_len=256")


@pytest.mark.parametrize("path, body, param", [
    (PATH, {"prompt": [5] * 300, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sea " * 300}], "max_tokens": 4}, "messages"),
    (PATH, {"prompt": [5] * 256, "max_tokens": 1}, "prompt"),
])
def test_a_prompt_past_the_context_is_refused_as_the_prompt_not_max_tokens(api, path, body, param):
    """As vLLM tells them apart: no max_tokens fits a prompt that alone leaves no room, so
    the refusal names the prompt (it named max_tokens), and still both numbers."""
    error = assert_error(api.post(path, body), 400, "BadRequestError", param, "exceeds max_model_len=256")
    assert "prompt tokens + max_tokens=" in error["message"] and "the prompt alone" in error["message"]
    near = {"prompt": [5] * 255, "max_tokens": 2}
    assert_error(api.post(PATH, near), 400, "BadRequestError", "max_tokens", "257 exceeds max_model_len=256")


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("best_of", 3)])
def test_unsupported_fields_are_refused_by_name(api, field, value):
    assert_error(api.post(PATH, {"prompt": "x", field: value}), 400, "BadRequestError", field, "not supported")


def test_stream_options_need_a_stream(api):
    response = api.post(PATH, {"prompt": "x", "stream_options": {"include_usage": True}})
    assert_error(response, 400, "BadRequestError", "stream_options", "stream=true")
    assert api.post(PATH, {"prompt": "x", "max_tokens": 1, "stream": False}).status_code == 200


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt", f"over the limit of {MAX_PROMPTS}"),
    ({"prompt": [[5]] * (MAX_PROMPTS + 1)}, "prompt", f"over the limit of {MAX_PROMPTS}"),
    ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop", f"over the limit of {MAX_STOP_STRINGS}"),
    ({"prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop", f"over the limit of {MAX_STOP_CHARS}"),
    ({"prompt": "x", "stop": ["ok", "s" * (1 << 20)]}, "stop", f"over the limit of {MAX_STOP_CHARS}"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 2, "allowed_token_ids": [2]}, "min_tokens",
     "leaving no token to sample"),   # the model's end of sequence alone, which min_tokens masks
    ({"prompt": True}, "prompt", "prompt: expected str, list[str], list[int] or list[list[int]], got True"),
    ({"prompt": [[1, "a"]]}, "prompt", "prompt[0][1]: Input should be a valid integer, got 'a'"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop", "stop='': must be a non-empty string"),
])
def test_the_doors_bounds_are_400s_naming_the_limit(api, client, body, param, says):
    assert_error(api.post(PATH, body), 400, "BadRequestError", param, says)
    assert client.completions.create(model=MODEL, prompt="still", max_tokens=2).choices[0].text is not None


def test_requests_at_the_doors_bounds_are_served(client):
    got = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                    stop=["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    assert got.choices[0].finish_reason in ("stop", "length")


def test_unset_sampling_fields_take_the_models_defaults_then_openais():
    """The model's generation_config values (as the engine reports them) fill the fields a
    request leaves unset, as ``LLM.get_default_sampling_params`` does offline; a field the
    request sets wins, and what neither sets is OpenAI's default."""
    from tokenspeed.server.openai.protocol import CompletionRequest
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 99}
    unset = CompletionRequest(prompt="x").sampling_params(16, None, model)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.max_tokens) == (0.6, 0.9, 20, 0.0, 16)
    given = CompletionRequest(prompt="x", temperature=0.0, min_p=0.1).sampling_params(16, None, model)
    assert (given.temperature, given.greedy, given.top_p, given.min_p) == (0.0, True, 0.9, 0.1)
    plain = CompletionRequest(prompt="x").sampling_params(16, None, {})
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_an_answer_sent_whole_without_stop_strings_is_read_from_the_engine_at_its_end(client, llm, monkeypatch):
    """A request answered whole and without stop strings asks the engine for its tokens only
    when a completion ends (``at_end``); a stream, or stop strings to look for, every step.
    Its answer equals the offline one either way."""
    from tokenspeed.server.engine_client import EngineClient
    asked, submit = [], EngineClient.submit
    monkeypatch.setattr(EngineClient, "submit", lambda self, key, prompt, params, at_end=False: (
        asked.append(at_end), submit(self, key, prompt, params, at_end))[1])
    want = llm.generate("The sea is", ts.SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    whole = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True})
    streamed = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True}, stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    stopped = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=9, temperature=0,
                                        stop=["\x00"], extra_body={"ignore_eos": True})
    assert asked == [True, False, False]
    assert whole.choices[0].text == text == stopped.choices[0].text == want
