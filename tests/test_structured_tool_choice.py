"""``tool_choice`` "required" or a named tool as a grammar: every walk through its masks
that ends is a reply the format's parser reads back as calls of the allowed tools, with
arguments that validate against each tool's schema (checked with jsonschema)."""

import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from tokenspeed.errors import RefusedRequest
from tokenspeed.parsers import tool_parser
from tokenspeed.structured import GrammarMatcher, compile_grammar, guidance_tokenizer, new_bitmask
from tokenspeed.structured.bitmask import unpack_bits
from tokenspeed.structured.tool_choice import tool_choice_constraint

from tiny_vocab import tiny_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "set_age", "parameters": {
        "type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "kind": {"enum": ["cat", "dog"]}},
        "required": ["age"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ok", "parameters": {
        "type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
CHOICES = ["required", *({"type": "function", "function": {"name": n}} for n in SCHEMAS)]


@pytest.fixture(scope="module")
def vocab():
    tokenizer = tiny_tokenizer()
    return tokenizer, guidance_tokenizer(tokenizer)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(parser=st.sampled_from(["hermes", "llama3_json", "mistral"]), choice=st.sampled_from(CHOICES),
       data=st.data())
def test_the_calls_always_validate(vocab, parser, choice, data):
    tokenizer, guide = vocab
    eos = tokenizer.eos_token_ids[0]
    matcher = GrammarMatcher(compile_grammar(tool_choice_constraint(TOOLS, choice, parser), guide), guide)
    tokens, bitmask = [], new_bitmask(1, guide.vocab_size)
    for _ in range(150):
        matcher.fill(bitmask, 0)
        ids = unpack_bits(bitmask[0], guide.vocab_size).nonzero().flatten().tolist()
        token = data.draw(st.sampled_from(sorted(ids, key=lambda t: (t != eos, tokenizer.decode([t]).isspace()))))
        if token == eos:
            break
        matcher.accept(token)
        tokens.append(token)
    else:
        return
    calls = tool_parser(parser).parse(tokenizer.decode(tokens)).tool_calls
    assert calls if choice == "required" else [c.name for c in calls] == [choice["function"]["name"]]
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_a_required_call_without_parallel_calls_is_one_call(vocab, parser):
    """``parallel_tool_calls: false``: a required reply is one call; after it, the grammar
    takes nothing but the end, where with parallel calls it takes a second call."""
    tokenizer, guide = vocab
    reply = {"hermes": '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
             "llama3_json": '{"name": "ping", "parameters": {}}',
             "mistral": '[TOOL_CALLS][{"name": "ping", "arguments": {}}'}[parser]
    second = {"hermes": "\n<tool_call>", "llama3_json": "; {", "mistral": ", {"}[parser]
    for parallel in (True, False):
        matcher = GrammarMatcher(compile_grammar(tool_choice_constraint(TOOLS, "required", parser,
                                                                        parallel=parallel), guide), guide)
        for token in tokenizer.encode(reply, add_special_tokens=False):
            matcher.accept(token)
        takes_more = matcher.valid_prefix(tokenizer.encode(second, add_special_tokens=False)) > 0
        assert takes_more == parallel and matcher.can_stop == (parser != "mistral")


NESTED = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                              "additionalProperties": False}},
          "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}, "next": {"$ref": "#"},
                                           "const": {"$ref": "#/$defs/Point"}},
          "required": ["at"], "additionalProperties": False}   # pydantic's shape of a nested model


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_a_tool_whose_schema_refers_to_its_own_defs_is_held_to_them(vocab, parser, choice):
    """Each tool's ``#/...`` references resolve within its own schema (before: from the
    calls' root, where '/$defs/Point' does not exist, and the tool was refused)."""
    tokenizer, guide = vocab
    tools = [*TOOLS, {"type": "function", "function": {"name": "move", "parameters": NESTED}}]
    matcher = GrammarMatcher(compile_grammar(tool_choice_constraint(tools, choice, parser), guide), guide)
    head = {"hermes": "<tool_call>\n", "llama3_json": "", "mistral": "[TOOL_CALLS]["}[parser]
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = f'{head}{{"name": "move", "{key}": {{"at": {{"x": 1}}, "next": {{"at": {{"x": 2}}}}, "const": {{"x": 3}}}}}}'
    assert matcher.valid_prefix(tokenizer.encode(call, add_special_tokens=False)) == \
        len(tokenizer.encode(call, add_special_tokens=False))
    for wrong in ('{"x": "1"}', '{"y": 1}'):
        bad = f'{head}{{"name": "move", "{key}": {{"at": {wrong}'
        assert matcher.valid_prefix(tokenizer.encode(bad, add_special_tokens=False)) < \
            len(tokenizer.encode(bad, add_special_tokens=False)), wrong


def test_mistrals_marker_is_its_token(vocab):
    tokenizer, guide = vocab
    marker = tokenizer.eos_token_ids[0]     # any id stands in for [TOOL_CALLS]'s
    spec = tool_choice_constraint(TOOLS, "required", "mistral", marker_id=marker)
    bitmask = new_bitmask(1, guide.vocab_size)
    GrammarMatcher(compile_grammar(spec, guide), guide).fill(bitmask, 0)
    assert unpack_bits(bitmask[0], guide.vocab_size).nonzero().flatten().tolist() == [marker]


@pytest.mark.parametrize("tools, choice, field, message", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice",
     "names no tool of ['ok', 'ping', 'set_age']"),
    (TOOLS, "auto", "tool_choice", "names no tool"),
    ([], "required", "tools", "needs at least one tool"),
    ([{"type": "function", "function": {}}], "required", "tools", "tool 0 has no function name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "required", "tools",
     "the parameters of 'f': Invalid type: objekt"),
])
def test_bad_tools_or_choices_are_refused_by_field(tools, choice, field, message):
    with pytest.raises(RefusedRequest, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        tool_choice_constraint(tools, choice, "hermes")
    assert info.value.field == field


def test_a_format_without_a_grammar_is_named():
    with pytest.raises(ValueError, match="parser='pythonic': no tool-call grammar; choose one of hermes"):
        tool_choice_constraint(TOOLS, "required", "pythonic")
