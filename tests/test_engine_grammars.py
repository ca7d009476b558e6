"""The engine's grammars: compiled against the tokenizer's vocabulary padded to the model's,
a schema sent again reuses its compiled grammar (the most recent ``KEPT_GRAMMARS`` kept)
and its lexers, its requests dealt among them in turn, and a bad one is refused each time
it comes."""

import pytest

from tokenspeed.engine import grammars as grammars_module
from tokenspeed.engine.grammars import Grammars
from tokenspeed.errors import RefusedRequest
from tokenspeed.structured import StructuredOutputs

from text_models import smol_tokenizer


@pytest.fixture(scope="module")
def grammars():
    tokenizer = smol_tokenizer()
    return Grammars(tokenizer, tokenizer.vocab_size + 64, lexers=1)


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


def test_a_schema_s_requests_copy_one_matcher_and_a_lexer_is_renewed(grammars, monkeypatch):
    """Matchers of one schema share a lexer (no compile per request); after
    ``COPIES_PER_LEXER`` of them the next ones start a fresh lexer, and every one starts at
    the grammar's beginning whatever the others took."""
    monkeypatch.setattr(grammars_module, "COPIES_PER_LEXER", 3)
    spec = StructuredOutputs(regex="[0-9]{2}")
    first = grammars.matchers(spec, 2)
    first[0].accept(grammars.tokenizer.encode("1", add_special_tokens=False)[0])
    second, third = grammars.matchers(spec, 1)[0], grammars.matchers(spec, 1)[0]
    assert first[0].lexer is first[1].lexer is second.lexer and third.lexer is not second.lexer
    assert [m.valid_prefix([grammars.tokenizer.encode("7", add_special_tokens=False)[0]] * 3)
            for m in (first[0], first[1], second, third)] == [1, 2, 2, 2]


def test_a_schema_s_requests_take_the_least_busy_of_its_lexers(grammars, monkeypatch):
    """A new lexer while every one is in use (up to ``lexers``), else the least busy, the
    first of those; one that has made ``COPIES_PER_LEXER`` copies is renewed on its own."""
    monkeypatch.setattr(grammars_module, "COPIES_PER_LEXER", 3)
    dealt, spec = Grammars(grammars.tokenizer, grammars.vocab_size, lexers=3), StructuredOutputs(regex="[a-z]+")
    matchers = dealt.matchers(spec, 5)
    lexer = [m.lexer for m in matchers]
    assert len(set(lexer[:3])) == 3 and lexer[3:5] == lexer[:2]
    del matchers[:]
    alone = [dealt.matchers(spec, 1)[0].lexer, dealt.matchers(spec, 1)[0].lexer]   # each dropped at once
    assert alone[0] is lexer[0]   # the first lexer, idle again, made its third copy
    assert alone[1] not in lexer   # so it was renewed for the next
    cat = grammars.tokenizer.encode("cat", add_special_tokens=False)
    assert dealt.matchers(spec, 1)[0].valid_prefix(cat) == len(cat)


def test_a_schema_needs_a_lexer(grammars):
    with pytest.raises(ValueError, match="lexers=0: a schema needs at least one lexer"):
        Grammars(grammars.tokenizer, grammars.vocab_size, lexers=0)


@pytest.mark.parametrize("threads, lexers", [(1, 1), (2, 4), (8, 16)])
def test_a_schema_keeps_two_lexers_a_filling_thread_where_there_are_several(grammars, monkeypatch, threads, lexers):
    monkeypatch.setattr(grammars_module, "default_threads", lambda: threads)
    assert Grammars(grammars.tokenizer, grammars.vocab_size).lexers == lexers
