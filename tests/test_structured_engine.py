"""Constrained decoding through ``ts.LLM.generate``: what a request's ``structured_outputs``,
``allowed_token_ids`` and ``logit_bias`` ask is what it gets, sampled at temperature 1 over
several seeds, with overlap on or off, with n > 1, beside unconstrained requests and under
speculative decoding; what cannot be served is refused at the call, by field.

The model is a tiny random Llama over SmolLM2's real vocabulary (``text_models``): its
text is nonsense, so every constrained token is the mask's doing."""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.errors import RefusedRequest

from text_models import text_model_dir

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "kind", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,5}-[0-9]{2,3}"
CHOICE = ["red", "green", "blue", "light yellow"]
PROMPT = "Describe a pet:"
SEEDS = range(4)


@pytest.fixture(scope="module")
def llm():
    return ts.LLM(str(text_model_dir()), page_size=4)


@pytest.fixture(scope="module")
def llm_sync():
    return ts.LLM(str(text_model_dir()), page_size=4, overlap=False)


def constrained(spec: ts.StructuredOutputs, seed: int, max_tokens: int = 96, **kw) -> ts.SamplingParams:
    return ts.SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec, **kw)


def texts(llm, params, prompts=(PROMPT,)) -> list[str]:
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    return [c.text for o in outs for c in o.outputs]


def test_json_samples_parse_and_validate(llm):
    params = [constrained(ts.StructuredOutputs(json=SCHEMA), seed) for seed in SEEDS]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_regex_and_choice_hold(llm):
    for seed in SEEDS:
        [text] = texts(llm, constrained(ts.StructuredOutputs(regex=REGEX), seed))
        assert re.fullmatch(REGEX, text), text
    chosen = {t for seed in SEEDS for t in texts(llm, constrained(ts.StructuredOutputs(choice=CHOICE), seed))}
    assert chosen <= set(CHOICE)
