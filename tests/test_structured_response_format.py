"""OpenAI's ``response_format`` as a constraint: what ``openai``'s
``chat.completions.parse(response_format=PydanticModel)`` sends compiles, and holds the
reply to the model's schema."""

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from tokenspeed.errors import RefusedRequest
from tokenspeed.structured import (GrammarMatcher, StructuredOutputs, compile_grammar, from_response_format,
                                   guidance_tokenizer)

from tiny_vocab import tiny_tokenizer


class Address(BaseModel):
    city: str
    zip: str


class Person(BaseModel):
    name: str
    age: int
    kind: Literal["cat", "dog"]
    address: Address
    tags: list[str]


def parse_format(model) -> dict:
    from openai.lib._parsing._completions import type_to_response_format_param
    return type_to_response_format_param(model)


def test_a_pydantic_model_holds_the_reply_to_its_schema():
    tokenizer = tiny_tokenizer()
    guide = guidance_tokenizer(tokenizer)
    grammar = compile_grammar(from_response_format(parse_format(Person)), guide)
    good = Person(name="Ada", age=36, kind="cat", address=Address(city="x", zip="1"), tags=["a"])
    for text, whole in ((good.model_dump_json(), True), (json.dumps({"name": "Ada", "age": 36}), False)):
        ids = tokenizer.encode(text, add_special_tokens=False) + list(tokenizer.eos_token_ids)
        taken = GrammarMatcher(grammar, guide).valid_prefix(ids)
        assert (taken == len(ids)) == whole, text


@pytest.mark.parametrize("response_format, expected", [
    (None, None), ({"type": "text"}, None), ({"type": "json_object"}, StructuredOutputs(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True}},
     StructuredOutputs(json={"type": "integer"})),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, StructuredOutputs(json={"type": "object"})),
])
def test_each_type_maps_to_its_constraint(response_format, expected):
    assert from_response_format(response_format) == expected


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "type must be one of text, json_object, json_schema; got 'xml'"),
    ("json", "type must be one of"),
    ({"type": "json_schema"}, 'json_schema must be {"name": ..., "schema": {...}}'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema must be"),
])
def test_a_malformed_format_is_refused_by_name(response_format, message):
    with pytest.raises(RefusedRequest) as info:
        from_response_format(response_format)
    assert message in str(info.value)
    assert info.value.field == "response_format"
