"""The messages of a conversation with tools, as ``LLM.chat`` and the server check them
(``chat_messages``): an assistant's ``tool_calls`` (their JSON ``arguments`` parsed to the
dicts tool templates expect) and ``reasoning_content``, a tool's ``tool_call_id``;
anything else refused by path."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from tokenspeed.api.chat_messages import template_messages

ARGS = st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4) | st.booleans(), max_size=3)


def call(arguments, **extra) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}, **extra}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(arguments=ARGS)
def test_a_calls_arguments_reach_the_template_as_a_dict(arguments):
    for given_arguments in (json.dumps(arguments), arguments):
        [message] = template_messages([{"role": "assistant", "content": None, "tool_calls": [call(given_arguments)]}])
        assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": arguments}}]


def test_a_conversation_with_tools_keeps_its_fields():
    messages = template_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "ask", "tool_calls": [call("")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    assert messages[1]["reasoning_content"] == "ask" and messages[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, says", [
    ({"role": "user", "content": "x", "tool_calls": [call("{}")]},
     r"messages\[0\].tool_calls: only a message of role 'assistant' has one, not one of role 'user'"),
    ({"role": "assistant", "content": "x", "tool_call_id": "1"}, r"messages\[0\].tool_call_id: only .* 'tool'"),
    ({"role": "assistant", "tool_calls": [call("{bad")]}, r"messages\[0\].tool_calls\[0\].function.arguments is "
                                                          "not JSON"),
    ({"role": "assistant", "tool_calls": [call("[1]")]}, r"arguments must be a JSON object"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, r"tool_calls\[0\] must be"),
    ({"role": "assistant", "tool_calls": [call("{}", extra=1)]}, r"tool_calls\[0\] must be"),
    ({"role": "assistant", "tool_calls": "f()"}, r"tool_calls must be a list of tool calls"),
    ({"role": "tool", "content": "x", "tool_call_id": 3}, r"tool_call_id=3: must be a string"),
])
def test_bad_tool_messages_are_refused_by_path(message, says):
    with pytest.raises((TypeError, ValueError), match=says):
        template_messages([message])


def test_llm_chat_passes_tools_and_template_kwargs_as_the_server_does():
    """vLLM's ``LLM.chat(..., tools=, chat_template_kwargs=)``: both reach the template."""
    import tokenspeed as ts
    from tool_models import hermes_model_dir
    llm = ts.LLM(hermes_model_dir(), page_size=4, max_num_seqs=2)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    greedy = ts.SamplingParams(temperature=0, max_tokens=2)
    [out] = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False, tools=[tool],
                     chat_template_kwargs={"enable_thinking": False})
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match=r"chat_template_kwargs: \['tools'\] are set by the request's own fields"):
        llm.chat([{"role": "user", "content": "Hi"}], greedy, chat_template_kwargs={"tools": []})
    with pytest.raises(TypeError, match="tools must be a list of tool dicts, got dict"):
        llm.chat([{"role": "user", "content": "Hi"}], greedy, tools=tool)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict, got str"):
        llm.chat([{"role": "user", "content": "Hi"}], greedy, chat_template_kwargs="enable_thinking")
