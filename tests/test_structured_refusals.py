"""Bad structured-output, logit_bias and allowed_token_ids input is refused where it
arrives: a ``RefusedRequest`` naming the field (and llguidance's message, for what it
compiles), never a fault later in the engine."""

import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tokenspeed.errors import RefusedRequest
from tokenspeed.structured import (StructuredOutputs, TokenBias, add_logit_bias_, compile_grammar,
                                   guidance_tokenizer)

from tiny_vocab import tiny_tokenizer


@pytest.fixture(scope="module")
def guide():
    return guidance_tokenizer(tiny_tokenizer())


def refused(field: str, *fragments: str):
    """pytest.raises(RefusedRequest) checking its field and message."""
    class Check:
        def __enter__(self):
            self.raises = pytest.raises(RefusedRequest)
            self.info = self.raises.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            assert self.info.value.field == field
            for fragment in fragments:
                assert fragment in str(self.info.value), str(self.info.value)
            return handled
    return Check()


@pytest.mark.parametrize("fields, given", [({}, "none"), ({"regex": "a", "choice": ["b"]}, "regex, choice"),
                                           ({"json": {}, "json_object": True}, "json, json_object")])
def test_exactly_one_constraint_is_set(fields, given):
    with refused("structured_outputs", "exactly one of json, regex, choice, grammar, json_object", given):
        StructuredOutputs(**fields)


@pytest.mark.parametrize("fields, field, message", [
    ({"choice": []}, "choice", "at least one string"),
    ({"choice": ["a", ""]}, "choice", "none of them empty"),
    ({"choice": "ab"}, "choice", "a list of strings"),
    ({"choice": 5}, "choice", "a list of strings"),   # not iterable: refused, not a TypeError
    ({"regex": ""}, "regex", "non-empty string"),
    ({"grammar": 3}, "grammar", "non-empty string"),
    ({"json": 3}, "json", "a dict or its JSON text"),
    ({"json_object": 1}, "json_object", "True or False"),
])
def test_a_malformed_field_is_named(fields, field, message):
    with refused(f"structured_outputs.{field}", message):
        StructuredOutputs(**fields)


@pytest.mark.parametrize("fields, field, message", [
    ({"json": "{"}, "json", "not valid JSON"),
    ({"json": "[1]"}, "json", "an object or a boolean"),
    ({"json": {"type": "objekt"}}, "json", "Invalid type: objekt"),
    ({"json": {"type": "string", "pattern": "[a-"}}, "json", "unclosed character class"),
    ({"json": {"type": "integer", "maximum": 10 ** 30}}, "json", "not JSON serializable: " + "1" + "0" * 30),
    ({"json": {"enum": [99999999999999999999999]}}, "json", "99999999999999999999999"),
    ({"regex": "(?=lookahead)"}, "regex", "look-around"),
    ({"regex": "[z-a]"}, "regex", "invalid regex"),
    ({"grammar": "start: ("}, "grammar", "Expected token"),
    ({"grammar": "start: missing_rule"}, "grammar", "missing_rule"),
    ({"grammar": 'root ::= "a" undefined'}, "grammar", "Rule 'undefined' not found"),
    ({"grammar": 'foo: "a"'}, "grammar", "read as GBNF: Lark starts from 'start: ...'"),   # Lark, no start rule
])
def test_what_does_not_compile_is_refused_with_llguidances_message(guide, fields, field, message):
    spec = StructuredOutputs(**fields)
    for tokenizer in (None, guide):
        with refused(f"structured_outputs.{field}", message):
            compile_grammar(spec, tokenizer)


def test_a_refusal_crosses_processes_with_its_field(guide):
    with pytest.raises(RefusedRequest) as info:
        compile_grammar(StructuredOutputs(regex="(?=x)"), guide)
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.field, str(again)) == (info.value.field, str(info.value))


def test_a_schema_dict_and_its_text_are_one_spec():
    assert StructuredOutputs(json={"type": "object"}) == StructuredOutputs(json='{"type": "object"}')
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")


@pytest.mark.parametrize("fields, field, message", [
    ({"logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias", "in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "'x' is not a token id"),
    ({"logit_bias": {-3: 1}}, "logit_bias", "-3 is not a token id"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "'\u00b2' is not a token id"),     # a digit to isdigit, not to int
    ({"logit_bias": {"\u0663": 1}}, "logit_bias", "'\u0663' is not a token id"),     # an Arabic-Indic three
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "is not a token id"),   # past what int() reads
    ({"logit_bias": [1, 2]}, "logit_bias", "must map token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
    ({"allowed_token_ids": [1, True]}, "allowed_token_ids", "True is not a token id"),
])
def test_bad_token_bias_is_named(fields, field, message):
    with refused(field, message):
        TokenBias(**fields)


@pytest.mark.parametrize("fields, field", [({"logit_bias": {"330": 1.0}}, "logit_bias"),
                                           ({"allowed_token_ids": [0, 330]}, "allowed_token_ids")])
def test_ids_outside_the_vocabulary_are_refused_with_the_limit(fields, field):
    with refused(field, "token id 330 is outside the vocabulary [0, 330)") as info:
        TokenBias(**fields).check_vocabulary(330)
    assert info.value.limit == 330


@settings(max_examples=30, deadline=None, derandomize=True)
@given(bias=st.dictionaries(st.integers(0, 9), st.floats(-100, 100), max_size=5),
       rows=st.lists(st.integers(0, 2), max_size=3))
def test_logit_bias_adds_to_its_rows_alone(bias, rows):
    logits = torch.randn(3, 10)
    got = add_logit_bias_(logits.clone(), [(r, TokenBias(logit_bias=bias)) for r in rows])
    expected = logits.clone()
    for r in rows:
        for token, value in bias.items():
            expected[r, token] += value
    torch.testing.assert_close(got, expected)


def test_the_constraint_is_public_as_vllm_names_it():
    import tokenspeed as ts
    assert ts.StructuredOutputs is StructuredOutputs and "StructuredOutputs" in dir(ts)
