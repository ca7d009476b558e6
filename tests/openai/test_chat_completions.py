"""``POST /v1/chat/completions``: the response's and the stream's shapes, samples, logprobs
(each token's own bytes), a message's ``name``, the OpenAI fields accepted and ignored, and
tool calls on a server with no tool-call parser."""

import json

import attrs
import jsonschema
import openai
import pytest

import tokenspeed as ts
from tokenspeed.api.text_updates import CompletionDelta
from tokenspeed.server.openai import responses
from tokenspeed.server.openai.chat_protocol import ChatMessage
from tokenspeed.api.prompts import chat_prompt
from tokenspeed.execution.outputs import TokenLogprobs
from tokenspeed.tokenizer import ChatTemplate, load_tokenizer

from openai_http import MODEL, assert_error
from text_models import text_model_dir

PATH = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello!"}]
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                            "unit": {"enum": ["C", "F"]}},
                             "required": ["city", "unit"], "additionalProperties": False},
           "ping": {"type": "object", "additionalProperties": False}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]


def test_a_chat_completion_has_openais_shape_and_equals_offline(api, llm):
    body = api.post(PATH, {"model": MODEL, "messages": HELLO, "max_tokens": 6, "temperature": 0}).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    want = llm.chat(HELLO, ts.SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert choice["message"]["content"] == want.text and choice["finish_reason"] == want.finish_reason
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_a_chat_stream_opens_each_choice_with_its_role(api):
    body = {"messages": HELLO, "max_tokens": 5, "n": 2, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = api.stream_chunks(PATH, body)
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[2:-1] if c["choices"][0]["finish_reason"]]
    assert finishes == ["length", "length"]


def test_streamed_content_joins_to_the_answer(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
              if c.choices]
    assert "".join(pieces) == whole


def test_chat_logprobs_bytes_join_to_the_content(client):
    choice = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, logprobs=True,
                                            top_logprobs=2, temperature=0,
                                            extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0]
    entries = choice.logprobs.content
    assert len(entries) == 16 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == choice.message.content


def test_a_byte_fragment_tokens_bytes_are_its_own():
    """A token that holds part of a character shows as U+FFFD; its bytes are the real ones
    (they were U+FFFD's, EF BF BD), so a client joins the text back from them."""
    tokenizer = load_tokenizer(text_model_dir())
    ids = tokenizer.encode("😀", add_special_tokens=False)
    logprobs = tuple(TokenLogprobs(i, -0.5, {i: -0.5}) for i in ids)
    fmt = responses.ChatFormat(MODEL, tokenizer, 1)
    content = fmt.choice(CompletionDelta(0, "😀", tuple(ids), logprobs, "stop", None))["logprobs"]["content"]
    assert "\ufffd" in content[0]["token"] and content[0]["bytes"] != [0xEF, 0xBF, 0xBD]
    assert bytes(b for e in content for b in e["bytes"]) == "😀".encode()
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]


def test_a_messages_name_reaches_the_chat_template():
    tokenizer = attrs.evolve(load_tokenizer(text_model_dir()),
                             chat_template=ChatTemplate.compile("{% for m in messages %}[{{ m.name }}]"
                                                                "{{ m.content }}{% endfor %}"))
    message = ChatMessage.model_validate({"role": "user", "content": "hi", "name": "ada"})
    assert chat_prompt(tokenizer, [message.as_template_message()]).text == "[ada]hi"
    nameless = ChatMessage.model_validate({"role": "user", "content": "hi"})
    assert chat_prompt(tokenizer, [nameless.as_template_message()]).text == "[]hi"


def test_openais_fields_that_mean_nothing_here_are_accepted_and_ignored(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    ignored = client.chat.completions.create(**kw, user="u-1", metadata={"team": "a"}, store=False,
                                             service_tier="auto", parallel_tool_calls=False,
                                             prompt_cache_key="k", safety_identifier="s", modalities=["text"],
                                             prediction={"type": "content", "content": "Hi there"})
    assert ignored.choices[0].message.content == plain


def test_none_from_the_client_means_unset(client):
    """OpenAI's client sends null for an argument given as None: the default, as OpenAI reads it."""
    kw = dict(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    nulls = client.chat.completions.create(**kw, n=None, presence_penalty=None, frequency_penalty=None,
                                           logprobs=None, stream=None)
    assert [c.message.content for c in nulls.choices] == [plain]


def test_a_reply_dumped_by_the_client_goes_back_in_as_a_turn(client):
    """``message.model_dump()`` carries OpenAI's null refusal, annotations, audio and
    function_call: the next turn takes it as it is."""
    first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    turn = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call"} <= set(turn)
    messages = [*HELLO, turn, {"role": "user", "content": "More."}]
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    kept = [*HELLO, first.choices[0].message.model_dump(exclude_none=True), messages[-1]]
    assert again.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=kept, max_tokens=4, temperature=0).choices[0].message.content


def test_max_completion_tokens_is_refused_by_its_own_name(api):
    assert_error(api.post(PATH, {"messages": HELLO, "max_completion_tokens": 0}), 400, "BadRequestError",
                 "max_completion_tokens", "max_completion_tokens=0")
    assert_error(api.post(PATH, {"messages": HELLO, "max_completion_tokens": 10**6}), 400, "BadRequestError",
                 "max_completion_tokens", "max_completion_tokens")
    assert_error(api.post(PATH, {"messages": HELLO, "max_tokens": 0}), 400, "BadRequestError", "max_tokens")
    error = assert_error(api.post(PATH, {"messages": HELLO, "max_completion_tokens": 3, "min_tokens": 5}), 400,
                         "BadRequestError", "min_tokens", "max_completion_tokens=3")
    assert "max_tokens" not in error["message"]


@pytest.mark.parametrize("method", ["events", "first_chunks", "usage_chunk"])
def test_a_fault_formatting_a_stream_ends_it_with_an_error_event(api, monkeypatch, method):
    """Not a connection cut mid-stream: the client reads a 500's body, then [DONE]."""
    def broken(self, *args):
        raise RuntimeError("a formatting fault")
    monkeypatch.setattr(responses.ChatFormat, method, broken)
    body = {"messages": HELLO, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    lines = api.stream_lines(PATH, body)
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == 500 and "RuntimeError: a formatting fault" in error["message"]


def test_a_begun_reply_is_continued_as_vllm_continues_it(client, llm):
    begun = [*HELLO, {"role": "assistant", "content": "Hello, I am"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    got = client.chat.completions.create(model=MODEL, messages=begun, max_tokens=4, temperature=0, extra_body=extra)
    want = llm.chat(begun, ts.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, continue_final_message=True,
                    add_generation_prompt=False)[0]
    assert got.choices[0].message.content == want.text


@pytest.mark.parametrize("messages, extra, echoed", [
    ([*HELLO, {"role": "assistant", "content": "Hello, I am"}],
     {"continue_final_message": True, "add_generation_prompt": False}, "Hello, I am"),
    ([*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
     {}, "Hi\nthere"),                                   # the reply's role: parts joined, as vLLM joins them
    (HELLO, {}, ""),                                      # a user's message is not the reply's
    (HELLO, {"add_generation_prompt": False}, "Hello!"),  # the reply goes on from the last message
])
def test_echo_begins_each_reply_with_the_last_message_as_vllm_does(client, messages, extra, echoed):
    """vLLM's chat ``echo``: the last message's text where it has the reply's role, before
    each choice's reply, whole or streamed (after each choice's role); it was refused."""
    kw = dict(model=MODEL, messages=messages, max_tokens=4, n=2, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body=extra)
    got = client.chat.completions.create(**kw, extra_body={**extra, "echo": True})
    assert [c.message.content for c in got.choices] == [echoed + c.message.content for c in plain.choices]
    streamed = {}
    for chunk in client.chat.completions.create(**kw, extra_body={**extra, "echo": True}, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in got.choices}


def test_a_template_or_a_continuation_that_cannot_be_is_refused_by_its_field(api):
    assert_error(api.post(PATH, {"messages": HELLO, "chat_template": "{% for m %}"}), 400, "BadRequestError",
                 "chat_template", "not a Jinja template")
    assert_error(api.post(PATH, {"messages": HELLO, "chat_template": "{{ 1 / 0 }}"}), 400, "BadRequestError",
                 "chat_template", "rendering failed: ZeroDivisionError")   # a 500 before
    assert_error(api.post(PATH, {"messages": HELLO, "continue_final_message": True}), 400, "BadRequestError",
                 "continue_final_message", "pass add_generation_prompt=False")


def test_an_answer_in_audio_is_refused(api):
    assert_error(api.post(PATH, {"messages": HELLO, "modalities": ["text", "audio"]}), 400, "BadRequestError",
                 "modalities", "'text'")


@pytest.mark.parametrize("field, value", [("verbosity", "low"), ("frobnicate", 1),
                                          ("reasoning_effort", "minimal")])
def test_fields_that_would_change_the_answer_are_refused(api, field, value):
    assert_error(api.post(PATH, {"messages": HELLO, field: value}), 400, "BadRequestError", field)


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
     "messages[0].content[1] is an 'image_url' part: the models served here read text alone"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "is an 'input_audio' part"),
    ({"type": "txt", "text": "hi"}, "does not match any of the expected tags: 'text', 'image_url'"),
])
def test_a_part_the_model_cannot_read_is_refused_by_its_kind(api, part, says):
    """Not as a body whose content should have been a string."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], "max_tokens": 2}
    assert_error(api.post(PATH, body), 400, "BadRequestError", "messages", says)


def test_top_logprobs_past_its_bound_is_refused_by_its_own_name(api):
    body = {"messages": HELLO, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}
    assert_error(api.post(PATH, body), 400, "BadRequestError", "top_logprobs",
                 "top_logprobs=21: must be an integer in [0, 20]")


def test_stream_options_need_a_stream(api):
    response = api.post(PATH, {"messages": HELLO, "stream_options": {"include_usage": False}})
    assert_error(response, 400, "BadRequestError", "stream_options", "stream=true")


def test_bad_messages_are_refused(api):
    assert_error(api.post(PATH, {"messages": []}), 400, "BadRequestError", "messages")
    assert_error(api.post(PATH, {"messages": [{"role": "wizard", "content": "hi"}]}), 400, "BadRequestError",
                 "messages")


def test_chat_top_logprobs_are_as_many_as_asked_and_completions_hold_the_sampled_token(client):
    """At a high temperature the sampled token is often not among the k most likely: chat
    lists exactly k (OpenAI's shape; the sampled token is the entry itself), completions
    add the sampled token's entry after the k (as vLLM)."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=12, logprobs=True, top_logprobs=1, temperature=1.8,
                                          seed=5, extra_body={"ignore_eos": True})
    assert all(len(e.top_logprobs) == 1 for e in chat.choices[0].logprobs.content)
    text = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=12, logprobs=1,
                                     temperature=1.8, seed=5, extra_body={"ignore_eos": True})
    lp = text.choices[0].logprobs
    assert all(token in top and len(top) in (1, 2) for token, top in zip(lp.tokens, lp.top_logprobs))


@pytest.mark.parametrize("choice, names, parallel", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}, False),
    ("required", set(SCHEMAS), False),
    ("required", set(SCHEMAS), True),
])
def test_without_a_parser_a_named_or_required_call_is_valid_json(client, choice, names, parallel):
    """This server has no tool-call parser (its template shows no tool format); as in vLLM,
    a named or required call is held to JSON calls all the same, and streamed as it ends.
    Parallel calls may run past ``max_tokens`` (a random model's choice to go on): those
    replies are cut, the others hold, and one makes several calls."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice=choice, parallel_tool_calls=parallel, max_tokens=200, temperature=1.0, seed=1)
    complete = [c for c in client.chat.completions.create(**kw, n=3).choices
                if not (parallel and c.finish_reason == "length")]
    for c in complete:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.content in (None, ""), c
        for call in c.message.tool_calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if parallel:
        assert max(len(c.message.tool_calls) for c in complete) >= 2
    else:
        assert len(complete) == 3 and all(len(c.message.tool_calls) == 1 for c in complete)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [t.function.name for t in streamed if t.function.name] == [t.function.name for t in whole.message.tool_calls]
    for index, call in enumerate(whole.message.tool_calls):
        assert "".join(t.function.arguments or "" for t in streamed if t.index == index) == call.function.arguments
    assert chunks[-1].finish_reason == whole.finish_reason
