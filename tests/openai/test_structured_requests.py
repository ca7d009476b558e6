"""The request fields that constrain the output, at the unit level: each reaches
``SamplingParams`` (``response_format``, vLLM's ``structured_outputs``, ``logit_bias``,
``allowed_token_ids``, a required or named ``tool_choice``), and a bad one is refused at
the door (``GrammarCheck``, ``tool_use``) with a 400 naming its field."""

import json

import pytest

from tokenspeed.server.openai.api_error import APIError
from tokenspeed.server.openai.chat_parsers import ChatParsers
from tokenspeed.server.openai.chat_protocol import ChatCompletionRequest, TokenizeRequest
from tokenspeed.server.openai.grammar_check import Constraint, GrammarCheck
from tokenspeed.server.openai.protocol import CompletionRequest
from tokenspeed.server.openai.tool_use import JSON_CALLS, tool_use
from tokenspeed.structured import StructuredOutputs

from tiny_vocab import tiny_tokenizer

HELLO = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
TOOLS = [{"type": "function", "function": {"name": "set_age", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "ping"}}]
HERMES = ChatParsers(tool_call_parser="hermes")


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": HELLO, **fields}))


def params_of(request):
    return request.sampling_params(16, None, {}, request.output_constraint())


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputs(grammar='start: "a"+')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
])
def test_each_constraint_field_reaches_the_sampling_params(fields, spec):
    assert params_of(chat(**fields)).structured_outputs == spec
    completion = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", **fields}))
    assert params_of(completion).structured_outputs == spec


def test_logit_bias_and_allowed_token_ids_reach_the_sampling_params():
    params = params_of(chat(logit_bias={"7": -100, "3": 5.5}, allowed_token_ids=[4, 9]))
    assert params.logit_bias == ((3, 5.5), (7, -100.0)) and params.allowed_token_ids == (4, 9)


@pytest.mark.parametrize("fields, param, says", [
    ({"response_format": {"type": "xml"}}, "response_format", "type must be one of"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown field(s) ['jsonn']"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one string"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
])
def test_bad_constraint_fields_are_refused_by_name(fields, param, says):
    with pytest.raises(APIError) as refused:
        params_of(chat(**fields))
    assert refused.value.status == 400 and refused.value.param == param and says in refused.value.message


@pytest.fixture(scope="module")
def grammars():
    return GrammarCheck(tiny_tokenizer())


@pytest.mark.parametrize("constraint, param, says", [
    (Constraint(StructuredOutputs(json={"type": "objekt"}), "response_format"), "response_format",
     "response_format: Invalid type"),
    (Constraint(StructuredOutputs(regex="(unclosed"), "structured_outputs"), "structured_outputs.regex",
     "structured_outputs.regex"),
    (Constraint(StructuredOutputs(grammar="start: nothing_defined"), "structured_outputs"),
     "structured_outputs.grammar", "nothing_defined"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(grammars, constraint, param, says):
    with pytest.raises(APIError) as refused:
        grammars.check(constraint, tiny_tokenizer().vocab_size)
    assert refused.value.status == 400 and refused.value.param == param and says in refused.value.message


def test_a_constraint_that_compiles_passes_and_none_needs_no_tokenizer(grammars):
    grammars.check(Constraint(StructuredOutputs(json=SCHEMA), "response_format"), tiny_tokenizer().vocab_size)
    GrammarCheck(None).check(None, 10)


def test_a_server_without_a_tokenizer_refuses_a_constraint():
    with pytest.raises(APIError, match="response_format: structured outputs .* this server has none"):
        GrammarCheck(None).check(Constraint(StructuredOutputs(json_object=True), "response_format"), 10)


@pytest.mark.parametrize("choice, names", [("required", ["set_age", "ping"]),
                                           ({"type": "function", "function": {"name": "ping"}}, ["ping"])])
def test_a_required_or_named_tool_choice_is_a_grammar_of_those_tools(choice, names):
    use = tool_use(chat(tools=TOOLS, tool_choice=choice), HERMES, tiny_tokenizer())
    assert use.parser == "hermes" and use.constraint.field == "tool_choice"
    grammar = use.constraint.spec.grammar
    assert "<tool_call>" in grammar and all(f'"const": "{n}"' in grammar for n in names)
    assert ("set_age" in grammar) == ("set_age" in names)


@pytest.mark.parametrize("choice, names", [("required", ["set_age", "ping"]),
                                           ({"type": "function", "function": {"name": "ping"}}, ["ping"])])
def test_without_a_parser_a_required_or_named_call_is_plain_json(choice, names):
    """As in vLLM, no tool-call parser is needed: the grammar holds the reply to JSON calls."""
    use = tool_use(chat(tools=TOOLS, tool_choice=choice), ChatParsers(), tiny_tokenizer())
    assert use.parser == JSON_CALLS and use.constraint.field == "tool_choice"
    grammar = use.constraint.spec.grammar
    assert "<tool_call>" not in grammar and '"parameters"' in grammar
    assert all(f'"const": "{n}"' in grammar for n in names) and ("set_age" in grammar) == ("set_age" in names)


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_parses_calls_without_a_grammar(choice):
    assert tool_use(chat(tools=TOOLS, tool_choice=choice), HERMES, tiny_tokenizer()).constraint is None
    assert tool_use(chat(tools=TOOLS, tool_choice=choice), HERMES, tiny_tokenizer()).parser == "hermes"


def test_tool_choice_none_leaves_the_reply_as_text():
    use = tool_use(chat(tools=TOOLS, tool_choice="none"), HERMES, tiny_tokenizer())
    assert use.parser is None and use.constraint is None
    assert tool_use(chat(tools=TOOLS, tool_choice="none"), ChatParsers(), tiny_tokenizer()).parser is None


@pytest.mark.parametrize("fields, parsers, param, says", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, HERMES, "tool_choice",
     "names no tool of ['ping', 'set_age']"),
    ({"tool_choice": "required"}, HERMES, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, HERMES, "tools", "the parameters of 'f'"),
    ({"tools": TOOLS}, ChatParsers(), "tools", "--tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": "auto"}, ChatParsers(), "tools", "or a named function"),
])
def test_bad_tool_requests_are_refused_by_name(fields, parsers, param, says):
    with pytest.raises(APIError) as refused:
        tool_use(chat(**fields), parsers, tiny_tokenizer())
    assert refused.value.status == 400 and refused.value.param == param and says in refused.value.message


def test_the_tools_and_chat_template_kwargs_are_template_variables():
    request = chat(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert request.template_variables() == {"enable_thinking": False, "tools": TOOLS}
    with pytest.raises(APIError, match=r"chat_template_kwargs: \['tools'\] are set by"):
        chat(chat_template_kwargs={"tools": []}).template_variables()


def test_reasoning_effort_is_a_template_variable_given_once():
    assert chat(reasoning_effort="low").template_variables() == {"reasoning_effort": "low"}
    assert chat().template_variables() == {}
    with pytest.raises(APIError, match=r"\['reasoning_effort'\] is set by the request's own field") as refused:
        chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).template_variables()
    assert refused.value.param == "chat_template_kwargs"
    assert chat(chat_template_kwargs={"reasoning_effort": "high"}).template_variables() == {"reasoning_effort": "high"}


def test_tokenize_takes_the_templates_fields_with_messages_only():
    request = TokenizeRequest.model_validate_json(json.dumps({"prompt": "x", "tools": TOOLS}))
    with pytest.raises(APIError, match="tools go through the chat template: send messages") as refused:
        request.check_input()
    assert refused.value.param == "tools"
    TokenizeRequest.model_validate_json(json.dumps({"messages": HELLO, "tools": TOOLS})).check_input()
