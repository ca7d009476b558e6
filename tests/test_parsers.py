"""Tool-call and reasoning parsers: a whole reply parses to its content and calls (names,
arguments that load to what was written), and the same reply streamed in pieces split
anywhere gives deltas that join to exactly the whole reply's parse, for well-formed
replies, replies cut off anywhere, and arbitrary text."""

import itertools
import json

import pytest
from hypothesis import given, settings, strategies as st

from tokenspeed.parsers import (DeltaMessage, ParsedReply, ToolCall, default_reasoning_parser,
                                default_tool_parser, reasoning_parser, tool_parser)

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True)
FORMATS = ("hermes", "llama3_json", "mistral")
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<think>", "</think>"]
TEXT = st.text(st.sampled_from('ab <>[]{}",:;\\\n\té😀'), max_size=12)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | \
    st.floats(allow_nan=False, allow_infinity=False) | TEXT
ARGS = st.dictionaries(st.text(max_size=5), st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6), max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)
DUMP = st.fixed_dictionaries({"ensure_ascii": st.booleans(), "indent": st.none() | st.just(2)})


def ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def dumped(value, dump) -> str:
    return json.dumps(value, **dump)


def reply(fmt: str, content: str, calls, dump, named: bool) -> str:
    """A reply of ``fmt`` (``named``: Mistral's ``name[ARGS]`` form rather than its array)."""
    if fmt == "hermes":
        return content + "".join(f"<tool_call>\n{dumped({'name': n, 'arguments': a}, dump)}\n</tool_call>\n"
                                 for n, a in calls)
    if fmt == "llama3_json":
        return "<|python_tag|>" * named + "; ".join(dumped({"name": n, "parameters": a}, dump) for n, a in calls)
    if named:
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{dumped(a, dump)}" for n, a in calls)
    return content + "[TOOL_CALLS]" + dumped([{"name": n, "arguments": a} for n, a in calls], dump)


def streamed(stream, text: str, cuts) -> list[DeltaMessage]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in stream.feed(text[a:b])]
    return deltas + stream.finish()


def joined(deltas: list[DeltaMessage]) -> ParsedReply:
    """The reply a client rebuilds from the deltas (each call named once, in order)."""
    calls: dict[int, list[str]] = {}
    for call in (c for d in deltas for c in d.tool_calls):
        if call.id is not None:
            assert call.index == len(calls) and call.name
            calls[call.index] = [call.id, call.name, ""]
        calls[call.index][2] += call.arguments
    content = "".join(d.content or "" for d in deltas) or None
    return ParsedReply(content, tuple(ToolCall(*calls[i]) for i in sorted(calls)))


@PROPERTY
@given(fmt=st.sampled_from(FORMATS), content=TEXT.filter(lambda t: not any(m in t for m in MARKERS)),
       calls=CALLS, dump=DUMP, named=st.booleans(), cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_a_reply_parses_whole_and_streamed_alike(fmt, content, calls, dump, named, cuts):
    text = reply(fmt, "" if fmt == "llama3_json" else content, calls, dump, named)
    whole = tool_parser(fmt, ids()).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert whole.content == ((content.rstrip() or None) if fmt != "llama3_json" else None)
    assert joined(streamed(tool_parser(fmt, ids()).stream(), text, cuts)) == whole


@PROPERTY
@given(fmt=st.sampled_from(FORMATS), content=TEXT, calls=CALLS, dump=DUMP, named=st.booleans(),
       cut=st.integers(0, 10**4), cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_a_reply_cut_off_anywhere_streams_to_its_whole_parse(fmt, content, calls, dump, named, cut, cuts):
    text = reply(fmt, content, calls, dump, named)
    text = text[:cut % (len(text) + 1)]
    assert joined(streamed(tool_parser(fmt, ids()).stream(), text, cuts)) == tool_parser(fmt, ids()).parse(text)


@PROPERTY
@given(fmt=st.sampled_from(FORMATS), pieces=st.lists(TEXT | st.sampled_from(MARKERS), max_size=10),
       cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_any_text_streams_to_its_whole_parse(fmt, pieces, cuts):
    text = "".join(pieces)
    assert joined(streamed(tool_parser(fmt, ids()).stream(), text, cuts)) == tool_parser(fmt, ids()).parse(text)


FIELDS = st.lists(st.tuples(st.sampled_from(["name", "arguments", "parameters", "other"]), NAMES, ARGS),
                  min_size=1, max_size=5)


def written(fields, dump) -> str:
    """An object whose keys may repeat (json.dumps cannot write one)."""
    return "{" + ", ".join(f"{json.dumps(key)}: {dumped(name if key == 'name' else args, dump)}"
                           for key, name, args in fields) + "}"


@PROPERTY
@given(fmt=st.sampled_from(FORMATS), fields=FIELDS, dump=DUMP, cut=st.integers(0, 10**4),
       cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_a_call_that_repeats_a_key_streams_to_its_whole_parse(fmt, fields, dump, cut, cuts):
    """A key written twice (two names, both argument keys) keeps its first value, in the
    stream as in the whole parse, cut off anywhere: a later one never renames a call or
    takes back arguments a stream sent."""
    body = written(fields, dump)
    text = {"hermes": f"<tool_call>\n{body}\n</tool_call>", "llama3_json": body,
            "mistral": f"[TOOL_CALLS][{body}]"}[fmt]
    whole = tool_parser(fmt, ids()).parse(text)
    names = [name for key, name, _ in fields if key == "name"]
    arguments = [args for key, _, args in fields if key in ("arguments", "parameters")]
    if names:
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(names[0], (arguments or [{}])[0])]
    text = text[:cut % (len(text) + 1)]
    assert joined(streamed(tool_parser(fmt, ids()).stream(), text, cuts)) == tool_parser(fmt, ids()).parse(text)


def test_a_reply_without_calls_is_all_content():
    for fmt in FORMATS:
        text = "I would call a tool, but { it is not } <tool_ here.\n"
        assert tool_parser(fmt).parse(text) == ParsedReply(text)


def test_a_block_that_names_nothing_leaves_the_reply_as_content():
    text = "ok <tool_call>\nnot json\n</tool_call>"
    assert tool_parser("hermes").parse(text) == ParsedReply(text)


def test_arguments_given_as_a_json_string_are_its_value():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert tool_parser("hermes", ids()).parse(text).tool_calls == (ToolCall("id0", "f", '{"a": 1}'),)


def test_the_deltas_are_openais():
    stream = tool_parser("hermes", ids()).stream()
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"a"')
    assert [d.as_openai() for d in first] == [{"tool_calls": [
        {"index": 0, "id": "id0", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]}]
    assert [d.as_openai() for d in stream.feed(": 1}}")] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert stream.finish() == []


def test_mistral_ids_are_nine_letters_and_digits():
    call, = tool_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]').tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


# ---------------------------------------------------------------- reasoning

THOUGHT = TEXT.filter(lambda t: "</think>" not in t)


@PROPERTY
@given(name=st.sampled_from(["qwen3", "deepseek_r1"]), opened=st.booleans(), thought=THOUGHT, answer=TEXT,
       closed=st.booleans(), cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_reasoning_streams_to_its_whole_parse(name, opened, thought, answer, closed, cuts):
    text = "<think>" * opened + thought + ("</think>\n\n" + answer) * closed
    parser = reasoning_parser(name)
    deltas = streamed(parser.stream(), text, cuts)
    assert ("".join(d.reasoning_content or "" for d in deltas) or None,
            "".join(d.content or "" for d in deltas) or None) == parser.parse(text)


@pytest.mark.parametrize("name, text, expected", [
    ("qwen3", "<think>\nplan\n</think>\n\nThe answer.", ("\nplan\n", "The answer.")),
    ("qwen3", "The answer, no thought.", (None, "The answer, no thought.")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("deepseek_r1", "plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", "<think>plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
])
def test_reasoning_splits_from_the_answer(name, text, expected):
    assert reasoning_parser(name).parse(text) == expected


@pytest.mark.parametrize("name, prompt, text, expected", [
    ("deepseek_r1", "<｜Assistant｜></think>", "The answer.", (None, "The answer.")),   # V3.1, thinking off
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "plan</think>answer", ("plan", "answer")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "plan</think>answer", ("plan", "answer")),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "The answer.", (None, "The answer.")),
    ("deepseek_r1", "<|im_start|>assistant\n", "still thinking", ("still thinking", None)),
    ("deepseek_r1", None, "still thinking", ("still thinking", None)),
])
def test_the_prompts_last_tag_says_where_the_reply_starts(name, prompt, text, expected):
    """A prompt that closed the thought leaves the reply all answer (before: a deepseek_r1
    reply took it for thought), one that opened it, thought until </think>; streamed alike."""
    parser = reasoning_parser(name).after(prompt)
    assert parser.parse(text) == expected
    deltas = streamed(parser.stream(), text, [3, 7])
    assert ("".join(d.reasoning_content or "" for d in deltas) or None,
            "".join(d.content or "" for d in deltas) or None) == expected


@PROPERTY
@given(calls=CALLS, cuts=st.lists(st.integers(0, 10**4), max_size=8))
def test_reasoning_then_tool_calls_chain_as_a_server_streams_them(calls, cuts):
    """The reasoning stream's content pieces feed the tool stream."""
    text = "<think>which tool?</think>\n\n" + reply("hermes", "Calling.", calls, {}, False)
    reasoning, tools = reasoning_parser("qwen3").stream(), tool_parser("hermes", ids()).stream()
    pieces = streamed(reasoning, text, cuts)
    deltas = [DeltaMessage(reasoning_content=p.reasoning_content) for p in pieces if p.reasoning_content]
    deltas += [d for p in pieces if p.content for d in tools.feed(p.content)] + tools.finish()
    assert joined(deltas) == tool_parser("hermes", ids()).parse(reasoning_parser("qwen3").parse(text)[1])
    assert "".join(d.reasoning_content or "" for d in deltas) == "which tool?"


# ---------------------------------------------------------------- choosing by name, and by template

def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="--tool-call-parser='nope': unknown; choose one of hermes, "
                                         "llama3_json, mistral"):
        tool_parser("nope")
    with pytest.raises(ValueError, match="--reasoning-parser='x': unknown; choose one of deepseek_r1, qwen3"):
        reasoning_parser("x")


@pytest.mark.parametrize("template, tools, reasoning", [
    ("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>{% endfor %}"
     "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}", "hermes", "qwen3"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral", None),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     "llama3_json", None),
    ("{{ '<|Assistant|><think>\\n' }}", None, "deepseek_r1"),
    ("{{ messages }}", None, None),
    (None, None, None),
])
def test_a_template_implies_its_parsers(template, tools, reasoning):
    assert default_tool_parser(template) == tools
    assert default_reasoning_parser(template) == reasoning
