"""The one request check refuses with a ``RefusedRequest`` carrying the field, the bad value
and the limit it breaks."""

import pickle

import pytest
from hypothesis import given, strategies as st

import tokenspeed as ts
from tokenspeed.errors import RefusedRequest
from tokenspeed.runtime.prompt_limits import PromptLimits, check_request

LIMITS = PromptLimits(vocab_size=100, max_model_len=64, page_size=4, usable_pages=10)


def refusal(prompt, has_tokenizer=True, **params) -> RefusedRequest:
    with pytest.raises(RefusedRequest) as refused:
        check_request(LIMITS, 3, tuple(prompt), ts.SamplingParams(**params), has_tokenizer=has_tokenizer)
    return refused.value


@pytest.mark.parametrize("prompt, params, has_tokenizer, field, value, limit", [
    ([], {}, True, "prompt", 0, 1),
    ([5, 100, 6], {}, True, "prompt", 100, 100),
    ([5, -2], {}, True, "prompt", -2, 100),
    ([5], {"stop_token_ids": [7, 250]}, True, "stop_token_ids", 250, 100),
    ([5] * 10, {"max_tokens": 60}, True, "max_tokens", 70, 64),
    ([5] * 10, {"max_tokens": 40}, True, "max_tokens", 13, 10),
    ([5], {"stop": ["x"]}, False, "stop", ("x",), None),
])
def test_a_refusal_carries_its_field_value_and_limit(prompt, params, has_tokenizer, field, value, limit):
    refused = refusal(prompt, has_tokenizer, **params)
    assert (refused.field, refused.value, refused.limit) == (field, value, limit)
    assert isinstance(refused, ValueError)


def test_the_message_names_the_prompt_value_and_limit():
    refused = refusal([5] * 10, max_tokens=60)
    assert str(refused) == "prompt 3: 10 prompt tokens + max_tokens=60 = 70 exceeds max_model_len=64"


@given(st.lists(st.integers(-2**70, 2**70), min_size=1, max_size=20))
def test_any_token_outside_the_vocabulary_is_the_value_refused(prompt):
    bad = [t for t in prompt if not 0 <= t < LIMITS.vocab_size]
    if not bad:
        check_request(LIMITS, 3, tuple(prompt), ts.SamplingParams(max_tokens=1), has_tokenizer=True)
        return
    refused = refusal(prompt, max_tokens=1)
    assert (refused.field, refused.value, refused.limit) == ("prompt", bad[0], LIMITS.vocab_size)


def test_a_refusal_survives_pickling_with_its_fields():
    refused = refusal([5, 100])
    again = pickle.loads(pickle.dumps(refused))
    assert (str(again), again.field, again.value, again.limit) == \
        (str(refused), refused.field, refused.value, refused.limit)
