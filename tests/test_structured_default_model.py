"""The real default model (SmolLM2-135M-Instruct, CPU, float32) under a nested JSON Schema:
every sample at temperature 1.0 parses and validates (a small model alone writes JSON that
does not, a few times in a hundred). About 25 s on 2 idle cores, nearly all of it the
model's forward at batch 50."""

import json

import jsonschema
import pytest

import tokenspeed as ts

SCHEMA = {"type": "object", "properties": {
    "species": {"enum": ["cat", "dog", "parrot"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 25},
    "weight": {"type": "number", "minimum": 0.5, "maximum": 80},
    "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False},
    "toys": {"type": "array", "items": {"enum": ["ball", "rope"]}, "minItems": 1, "maxItems": 2}},
    "required": ["species", "age", "weight", "owner", "toys"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}   # compact JSON: half the tokens of pretty-printed
SAMPLES = 50


@pytest.mark.slow
def test_fifty_samples_of_the_default_model_validate_against_a_nested_schema():
    try:
        llm = ts.LLM(dtype="float32")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    prompt = llm.chat_prompt([{"role": "user", "content": "Describe a pet as JSON."}]).token_ids
    params = ts.SamplingParams(temperature=1.0, seed=11, n=SAMPLES, max_tokens=100,
                               structured_outputs=ts.StructuredOutputs(json=SCHEMA))
    [out] = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
    assert len(out.outputs) == SAMPLES
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
