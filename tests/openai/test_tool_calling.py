"""Tools, structured outputs and reasoning end to end, through the ``openai`` client, on
the tiny model with a Hermes-style chat template (``tool_models``): the tools and the
conversation's calls and answers reach the template, ``chat_template_kwargs`` too; a
required or named ``tool_choice`` always yields valid arguments; ``auto`` parses what the
model writes; streamed answers join to the whole ones; the reasoning is split off
(``--reasoning-parser deepseek_r1``: the reply thinks until ``</think>``); and
``chat.completions.parse`` reads a Pydantic model back. Tests that need the engine to
enforce a constraint say so."""

import functools
import json

import jsonschema
import openai
import pydantic
import pytest

import tokenspeed as ts
from tokenspeed.server.engine_process import EngineSpec
from tokenspeed.server.openai.chat_parsers import ParserFlags
from tokenspeed.server.openai.chat_replies import ReplyParsing
from tokenspeed.server.openai.server import create_app
from tokenspeed.tokenizer import load_tokenizer

from openai_http import KEY, MODEL, Api, assert_error
from serving import running
from tool_models import hermes_model_dir

pytestmark = pytest.mark.slow   # a server of its own

OPTIONS = dict(page_size=4, max_num_seqs=8, max_model_len=512)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "count", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def base_url():
    path = str(hermes_model_dir())
    spec = EngineSpec(functools.partial(ts.LLM, path, **OPTIONS), path)
    app = create_app(spec, MODEL, api_key=KEY, parser_flags=ParserFlags(reasoning_parser="deepseek_r1"))
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def api(base_url):
    return Api(base_url)


def prompt_text(api, **body) -> str:
    tokens = api.post("/tokenize", {"messages": ASK, **body}).json()["tokens"]
    return load_tokenizer(hermes_model_dir()).decode(tokens, skip_special_tokens=False)


def test_the_tools_reach_the_template_and_a_tool_follow_up_renders(api, client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}
    follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    text = api.post("/tokenize", {"messages": follow_up, "tools": TOOLS}).json()["tokens"]
    text = load_tokenizer(hermes_model_dir()).decode(text, skip_special_tokens=False)
    assert json.dumps(TOOLS[0]) in text and json.dumps(TOOLS[1]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_response_message_goes_back_into_the_conversation(client):
    """The openai client sends a response's message as it came (``reasoning_content`` too)."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
    messages = [*ASK, first.choices[0].message, {"role": "user", "content": "And in Rome?"}]
    assert client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4).choices


def test_chat_template_kwargs_reach_the_template(api):
    assert prompt_text(api, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_text(api).endswith("<|im_start|>assistant\n")


def test_auto_parses_what_the_model_writes(api, client):
    """The chat answer is the parse of the completion of the same prompt's tokens."""
    tokens = api.post("/tokenize", {"messages": ASK, "tools": TOOLS}).json()["tokens"]
    raw = client.completions.create(model=MODEL, prompt=tokens, max_tokens=24, temperature=0,
                                    extra_body={"skip_special_tokens": False}).choices[0]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24,
                                          temperature=0).choices[0]
    want = ReplyParsing.of("deepseek_r1", "hermes").message(raw.text)
    assert chat.message.content == want["content"] and chat.message.reasoning_content == want["reasoning_content"]
    assert chat.message.reasoning_content == raw.text   # no </think>: all of it is thought


def test_tool_choice_none_answers_in_text(client):
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"


def test_a_streamed_reasoning_joins_to_the_whole(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == whole.reasoning_content
    assert whole.reasoning_content and whole.content is None


def called(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# The tests below need the engine to enforce SamplingParams.structured_outputs.

@pytest.mark.parametrize("choice, names", [("required", set(SCHEMAS)),
                                           ({"type": "function", "function": {"name": "count"}}, {"count"})])
def test_a_required_or_named_tool_choice_always_yields_valid_arguments(client, choice, names):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, n=4,
                                            max_tokens=200, temperature=1.0, seed=3)
    for c in answer.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        for name, arguments in called(c.message):
            assert name in names
            jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_a_stop_string_is_not_finished_as_a_call(client, stream):
    """The named call's arguments must hold ``"n"``: a stop string there cuts the call
    short, and the reply ends ``"stop"`` (whole or streamed), not ``"tool_calls"``."""
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "count"}},
                stop=['"n"'], max_tokens=200, seed=3)
    if stream:
        finishes = [c.finish_reason for chunk in client.chat.completions.create(**body, stream=True)
                    for c in chunk.choices if c.finish_reason]
    else:
        answer = client.chat.completions.create(**body).choices[0]
        finishes = [answer.finish_reason]
        assert answer.message.tool_calls is None or all(
            not _json_object(c.function.arguments) for c in answer.message.tool_calls), answer.message
    assert finishes == ["stop"]


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_without_parallel_calls_a_required_choice_makes_one_call(client):
    """``parallel_tool_calls=False``: one call, ended as the grammar ends it."""
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=4,
                                            max_tokens=200, temperature=1.0, seed=3, parallel_tool_calls=False)
    for c in answer.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        [(name, arguments)] = called(c.message)
        jsonschema.validate(arguments, SCHEMAS[name])


def test_without_parallel_calls_auto_keeps_the_first_call(client):
    """The model writes two calls (a regex makes it); ``parallel_tool_calls=False`` keeps the
    first, whole and streamed."""
    regex = (r'<tool_call>\n\{"name": "count", "arguments": \{"n": 1\}\}\n</tool_call>\n'
             r'<tool_call>\n\{"name": "count", "arguments": \{"n": 2\}\}\n</tool_call>')
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    assert len(client.chat.completions.create(**kw).choices[0].message.tool_calls) == 2
    choice = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and called(choice.message) == [("count", {"n": 1})]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, parallel_tool_calls=False, stream=True)
              if c.choices]
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert {t.index for t in calls} == {0} and chunks[-1].finish_reason == "tool_calls"
    assert "".join(t.function.arguments or "" for t in calls) == choice.message.tool_calls[0].function.arguments


def test_auto_reads_a_call_and_its_stream_joins_to_it(client):
    """A regex makes the model write a call whatever its weights; a constrained reply is
    not split for reasoning (its grammar holds from its first token)."""
    regex = r'OK<tool_call>\n\{"name": "count", "arguments": \{"n": [0-9]\}\}\n</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "OK"
    assert getattr(choice.message, "reasoning_content", None) is None
    assert [n for n, _ in called(choice.message)] == ["count"]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [c.delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "OK"
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].function.name == "count" and calls[0].id.startswith("call_")
    assert "".join(t.function.arguments or "" for t in calls) == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].finish_reason == "tool_calls"


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    celsius: int = pydantic.Field(ge=-50, le=50)


def test_parse_returns_a_pydantic_object(client):
    """The reply is not split for reasoning either (the server thinks in ``deepseek_r1``'s way)."""
    answer = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Weather, max_tokens=120,
                                           temperature=0)
    assert isinstance(answer.choices[0].message.parsed, Weather)


# Refusals at the door.

@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "response_format: "),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "structured_outputs.regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names no tool"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "outside the vocabulary"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages", "arguments is not JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages", "only a message of role"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the request's own fields"),
    ({"tools": [{"type": "function", "function": {"name": "f</tool_call>"}}]}, "tools",
     "tools[0].function.name: String should match pattern '^[a-zA-Z0-9_-]{1,64}$', got 'f</tool_call>'"),
    ({"tools": TOOLS + TOOLS}, "tools", "more than one tool"),
])
def test_bad_requests_are_refused_naming_the_field(api, body, param, says):
    assert_error(api.post(PATH, {"messages": ASK, **body}), 400, "BadRequestError", param, says)
