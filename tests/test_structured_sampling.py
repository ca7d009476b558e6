"""Sampling at random through the masks over a real vocabulary (SmolLM2's, 49k tokens; pure
torch, no model): every sample ends, and what it spells holds the constraint, checked
without llguidance. The vocabulary as llguidance sees it is the same whether the tokenizer
comes from a GGUF file or a Hugging Face directory."""

import json
import re

import jsonschema
import pytest
import torch

from tokenspeed.structured import (GrammarMatcher, StructuredOutputs, apply_token_bitmask_,
                                   compile_grammar, guidance_tokenizer, new_bitmask)
from tokenspeed.tokenizer import load_tokenizer

from text_models import smol_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "role": {"enum": ["admin", "user", "guest"]},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "role", "age", "address", "tags"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,6} [0-9]{2}-[0-9]{3}"
CHOICE = ["Paris", "Tokyo", "New York", "São Paulo"]
SAMPLES = 8
JSON_SAMPLES = 5
MAX_STEPS = 200


@pytest.fixture(scope="module")
def smol():
    tokenizer = smol_tokenizer()
    return tokenizer, guidance_tokenizer(tokenizer, tokenizer.vocab_size + 11)


def sample(tokenizer, guide, spec, seed: int) -> str:
    """Random logits, masked, sampled at temperature 1 until EOS."""
    generator = torch.Generator().manual_seed(seed)
    matcher = GrammarMatcher(compile_grammar(spec, guide), guide)
    bitmask, tokens = new_bitmask(1, guide.vocab_size), []
    for _ in range(MAX_STEPS):
        logits = torch.randn(1, guide.vocab_size, generator=generator) * 4
        matcher.fill(bitmask, 0)
        probs = torch.softmax(apply_token_bitmask_(logits, bitmask), dim=-1)
        token = int(torch.multinomial(probs[0], 1, generator=generator))
        if token in tokenizer.eos_token_ids:
            assert matcher.can_stop
            return tokenizer.decode(tokens)
        matcher.accept(token)
        tokens.append(token)
    raise AssertionError(f"no EOS in {MAX_STEPS} tokens: {tokenizer.decode(tokens)!r}")


def test_sampled_json_validates_against_the_schema(smol):
    for seed in range(JSON_SAMPLES):
        jsonschema.validate(json.loads(sample(*smol, StructuredOutputs(json=SCHEMA), seed)), SCHEMA)


def test_sampled_text_matches_the_regex(smol):
    for seed in range(SAMPLES):
        text = sample(*smol, StructuredOutputs(regex=REGEX), seed)
        assert re.fullmatch(REGEX, text), text


def test_sampled_text_is_one_of_the_choices(smol):
    seen = {sample(*smol, StructuredOutputs(choice=CHOICE), seed) for seed in range(SAMPLES)}
    assert seen <= set(CHOICE) and len(seen) > 1


def test_a_gguf_and_its_hugging_face_directory_give_the_same_masks(smol, tmp_path):
    tokenizer, guide = smol
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokenizer.special.eos_token}))
    other = guidance_tokenizer(load_tokenizer(tmp_path), guide.vocab_size)
    spec = StructuredOutputs(json=SCHEMA)
    text = tokenizer.encode('{"name": "Zoë 😀", "role": "user", "age', add_special_tokens=False)
    masks = []
    for vocab in (guide, other):
        matcher, bitmask = GrammarMatcher(compile_grammar(spec, vocab), vocab), new_bitmask(len(text), vocab.vocab_size)
        for row, token in enumerate(text):
            matcher.fill(bitmask, row)
            matcher.accept(token)
        masks.append(bitmask)
    assert torch.equal(*masks)
