"""A chat reply read by the reasoning and tool-call parsers, as the server answers it: the
message (``content``, ``reasoning_content``, ``tool_calls``, finish ``"tool_calls"``), and
its stream, whose chunks a client joins back to that message wherever the engine's pieces
were cut."""

import json
import types

from hypothesis import given, settings, strategies as st

from tokenspeed.api.text_updates import CompletionDelta
from tokenspeed.server.openai.chat_replies import ReplyParsing
from tokenspeed.server.openai.responses import ChatFormat

PROPERTY = settings(max_examples=80, deadline=None, derandomize=True)
TEXT = st.text(st.sampled_from('ab <>/{}",:\n😀'), max_size=10)
MARKERS = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "\n"])
NOISE = st.lists(TEXT | MARKERS, max_size=8).map("".join)
ARGS = st.dictionaries(st.text("xyz", max_size=3), st.integers() | TEXT | st.booleans(), max_size=3)
CALLS = st.lists(st.tuples(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), ARGS), max_size=3)


def hermes_reply(thought: str | None, content: str, calls) -> str:
    think = "" if thought is None else f"<think>{thought}</think>\n\n"
    return think + content + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n"
                                     for n, a in calls)


def chat_format(reasoning="qwen3", tools="hermes", single_call: bool = False) -> ChatFormat:
    return ChatFormat("m", None, 1, parsing=ReplyParsing.of(reasoning, tools, single_call))


def whole(text: str, finish: str = "stop", single_call: bool = False) -> dict:
    return chat_format(single_call=single_call).choice(CompletionDelta(0, text, (), (), finish, None))


def streamed_chunks(text: str, cuts, finish: str = "stop", single_call: bool = False) -> list[dict]:
    fmt, prefix = chat_format(single_call=single_call), ""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    events = "".join(fmt.events(prefix, 0, types.SimpleNamespace(deltas=(CompletionDelta(
        0, piece, (), (), finish if i == len(pieces) - 1 else None, None),)))
        for i, piece in enumerate(pieces))
    return [json.loads(e.removesuffix("]}")) for e in events.split("\n\n") if e]


def joined(chunks: list[dict]) -> dict:
    """The message a client rebuilds from the chunks (as the openai client's stream helper)."""
    content, reasoning, calls, finish = [], [], {}, None
    for choice in chunks:
        delta = choice["delta"]
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                     "function": {"name": call["function"].get("name"),
                                                                  "arguments": ""}})
            entry["function"]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return {"content": "".join(content) or None, "reasoning_content": "".join(reasoning) or None,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def without_ids(message: dict) -> dict:
    calls = [{**call, "id": None} for call in message.get("tool_calls", [])]
    return {"content": message["content"], "reasoning_content": message.get("reasoning_content"),
            "tool_calls": calls}


def test_a_reply_with_reasoning_and_calls_is_openais_message():
    choice = whole('<think>Weather: ask.</think>\n\nLet me look.<tool_call>\n{"name": "get_weather", '
                   '"arguments": {"city": "Paris"}}\n</tool_call>')
    message = choice["message"]
    assert message["reasoning_content"] == "Weather: ask." and message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls"


def test_a_reply_cut_short_keeps_its_finish():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert whole(text, "length")["finish_reason"] == "length"


def test_a_reply_without_calls_is_content():
    choice = chat_format(reasoning=None).choice(CompletionDelta(0, "just text", (), (), "stop", None))
    assert choice["message"] == {"role": "assistant", "content": "just text"} and choice["finish_reason"] == "stop"


@PROPERTY
@given(thought=st.none() | TEXT, content=TEXT, calls=CALLS, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_a_streamed_reply_joins_to_the_whole_message(thought, content, calls, cuts):
    text = hermes_reply(thought, content, calls)
    choice, chunks = whole(text), streamed_chunks(text, cuts)
    rebuilt = joined(chunks)
    assert without_ids(rebuilt) == without_ids(choice["message"])
    assert rebuilt["finish_reason"] == choice["finish_reason"] == ("tool_calls" if calls else "stop")
    assert [c["function"]["name"] for c in choice["message"].get("tool_calls", [])] == [n for n, _ in calls]
    assert all(json.loads(c["function"]["arguments"]) == a
               for c, (_, a) in zip(choice["message"].get("tool_calls", []), calls))


@PROPERTY
@given(content=TEXT, calls=CALLS.filter(bool), cut=st.integers(0, 400), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_a_reply_cut_inside_a_call_does_not_finish_as_calls(content, calls, cut, cuts):
    """A reply ended (``"stop"``: a stop string, the end of sequence) anywhere: its calls
    are those named so far, whole or streamed alike, and it finishes ``"tool_calls"`` only
    where every call named has its arguments' object closed."""
    text = hermes_reply(None, content, calls)
    ends, at = [], 0
    for name, arguments in calls:   # each call's arguments close just before its object does
        written = json.dumps({"name": name, "arguments": arguments})
        at = text.index(written, at) + len(written)
        ends.append(at - 1)
    text = text[:cut % (len(text) + 1)]
    choice, rebuilt = whole(text), joined(streamed_chunks(text, cuts))
    assert without_ids(rebuilt) == without_ids(choice["message"])
    named = len(choice["message"].get("tool_calls", []))
    closed = sum(end <= len(text) for end in ends)
    assert rebuilt["finish_reason"] == choice["finish_reason"] == ("tool_calls" if named and closed >= named
                                                                   else "stop")


@PROPERTY
@given(thought=st.none() | TEXT, content=TEXT, calls=CALLS, cuts=st.lists(st.integers(0, 400), max_size=12))
def test_without_parallel_calls_a_reply_keeps_its_first_call_whole_or_streamed(thought, content, calls, cuts):
    """``parallel_tool_calls: false``: the message holds the first call the model made (as
    vLLM keeps it), and the stream's chunks join to that message."""
    text = hermes_reply(thought, content, calls)
    choice, rebuilt = whole(text, single_call=True), joined(streamed_chunks(text, cuts, single_call=True))
    assert without_ids(rebuilt) == without_ids(choice["message"])
    assert [c["function"]["name"] for c in choice["message"].get("tool_calls", [])] == [n for n, _ in calls[:1]]
    assert rebuilt["finish_reason"] == choice["finish_reason"] == ("tool_calls" if calls else "stop")


@PROPERTY
@given(text=NOISE, cuts=st.lists(st.integers(0, 100), max_size=12))
def test_any_streamed_text_joins_to_its_whole_message(text, cuts):
    rebuilt, choice = joined(streamed_chunks(text, cuts)), whole(text)
    assert without_ids(rebuilt) == without_ids(choice["message"])
    assert rebuilt["finish_reason"] == choice["finish_reason"]


def test_each_chunk_is_one_delta_and_only_the_last_finishes():
    chunks = streamed_chunks('<think>a</think>b<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [3, 20])
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert all(c["index"] == 0 and c["logprobs"] is None for c in chunks)


def test_continuous_usage_counts_the_tokens_of_text_a_parser_holds_back():
    """A delta whose text the parser keeps (a marker, a call not yet whole) sends no chunk;
    its tokens still count in the usage of the choice's next chunk."""
    fmt = ChatFormat("m", None, 1, parsing=ReplyParsing.of("qwen3", "hermes", False), continuous_usage=True)
    pieces = [("<think>", (7,), None), ("Hm", (8, 9), None), ("</think>", (10,), None), ("Yes", (11,), "stop")]
    events = "".join(fmt.events('{"choices": [', 0, types.SimpleNamespace(num_prompt_tokens=4, deltas=(
        CompletionDelta(0, text, ids, (), finish, None),))) for text, ids, finish in pieces)
    chunks = [json.loads(e) for e in events.split("\n\n") if e]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"reasoning_content": "Hm"}, {"content": "Yes"}]
    assert [c["usage"] for c in chunks] == [{"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
                                            for n in (3, 5)]


def test_a_prompt_that_closed_the_thought_leaves_a_deepseek_r1_reply_all_answer():
    """``chat_template_kwargs: {"enable_thinking": false}`` (or DeepSeek-V3.1's thinking off)
    ends the prompt on ``</think>``: the reply is the answer, not a thought without one."""
    parsing = ReplyParsing.of("deepseek_r1", None, prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert parsing.message("Paris.") == {"reasoning_content": None, "content": "Paris."}
    assert ReplyParsing.of("deepseek_r1", None).message("Paris.") == {"reasoning_content": "Paris.", "content": None}
