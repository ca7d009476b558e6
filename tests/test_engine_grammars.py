"""The engine's grammars: compiled against the tokenizer's vocabulary padded to the model's,
a schema sent again reuses its compiled grammar (the most recent ``KEPT_GRAMMARS`` kept),
and a bad one is refused each time it comes."""

import pytest

from tokenspeed.engine import grammars as grammars_module
from tokenspeed.engine.grammars import Grammars
from tokenspeed.errors import RefusedRequest
from tokenspeed.structured import StructuredOutputs

from text_models import smol_tokenizer


@pytest.fixture(scope="module")
def grammars():
    tokenizer = smol_tokenizer()
    return Grammars(tokenizer, tokenizer.vocab_size + 64)


def test_the_vocabulary_is_padded_to_the_model(grammars):
    assert grammars.guide.vocab_size == grammars.tokenizer.vocab_size + 64


def test_a_schema_sent_again_reuses_its_grammar_and_old_ones_leave(grammars, monkeypatch):
    monkeypatch.setattr(grammars_module, "KEPT_GRAMMARS", 2)
    specs = [StructuredOutputs(regex=f"a{{{i}}}") for i in range(1, 4)]
    first = grammars.matchers(specs[0], 2)
    assert first[0] is not first[1] and first[0].grammar is first[1].grammar
    assert grammars.matchers(specs[0], 1)[0].grammar is first[0].grammar
    grammars.matchers(specs[1], 1), grammars.matchers(specs[2], 1)
    assert grammars.matchers(specs[0], 1)[0].grammar is not first[0].grammar


def test_a_bad_grammar_is_refused_every_time(grammars):
    for _ in range(2):
        with pytest.raises(RefusedRequest, match="structured_outputs.regex"):
            grammars.matchers(StructuredOutputs(regex="(a"), 1)
