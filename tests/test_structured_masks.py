"""Grammar masks over a tiny vocabulary, token by token: a mask allows exactly what the
grammar takes next (never a token it rejects), never forbids every token while the
grammar can still finish, and a walk through the masks that ends on EOS is text the
constraint accepts, checked without llguidance (json + jsonschema, re, the choice list)."""

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tokenspeed.structured import (GrammarMatcher, MaskFiller, MaskRow, StructuredOutputs,
                                   compile_grammar, guidance_tokenizer, new_bitmask)
from tokenspeed.structured.bitmask import unpack_bits

from tiny_vocab import tiny_tokenizer

PADDED = 7          # the model's vocabulary runs past the tokenizer's (not a multiple of 32)
WALK = settings(max_examples=40, deadline=None, derandomize=True)
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "ok": {"type": "boolean"}},
    "required": ["kind", "age"], "additionalProperties": False}
REGEX = r"-?[0-9]{1,3}(\.[0-9]{2})?"
CHOICE = ["yes", "no", "maybe so"]
SPECS = {"json": StructuredOutputs(json=SCHEMA), "regex": StructuredOutputs(regex=REGEX),
         "choice": StructuredOutputs(choice=CHOICE), "json_object": StructuredOutputs(json_object=True),
         "grammar": StructuredOutputs(grammar='start: "[" item ("," item)* "]"\nitem: /[0-9]+/ | "null"')}


@pytest.fixture(scope="module")
def vocab():
    tokenizer = tiny_tokenizer()
    return tokenizer, guidance_tokenizer(tokenizer, tokenizer.vocab_size + PADDED)


def accepted(kind: str, text: str) -> bool:
    """The constraint's own meaning, without llguidance."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICE
    if kind == "grammar":
        return re.fullmatch(r"\[([0-9]+|null)(,([0-9]+|null))*\]", text) is not None
    value = json.loads(text)
    if kind == "json":
        jsonschema.validate(value, SCHEMA)
    return isinstance(value, dict)


def mask_of(matcher, size) -> torch.Tensor:
    bitmask = new_bitmask(1, size)
    matcher.fill(bitmask, 0)
    return unpack_bits(bitmask[0], size)


@WALK
@given(kind=st.sampled_from(sorted(SPECS)), data=st.data())
def test_a_walk_through_the_masks_keeps_to_the_grammar(vocab, kind, data):
    tokenizer, guide = vocab
    eos = tokenizer.eos_token_ids[0]
    matcher = GrammarMatcher(compile_grammar(SPECS[kind], guide), guide)
    tokens = []
    for _ in range(60):
        allowed = mask_of(matcher, guide.vocab_size)
        ids = allowed.nonzero().flatten().tolist()
        assert ids, f"every token forbidden after {tokenizer.decode(tokens)!r}"
        assert allowed[eos] == matcher.can_stop
        assert not allowed[tokenizer.vocab_size:].any()     # padding ids are never allowed
        assert all(matcher.valid_prefix([t]) == 1 for t in ids)
        refused = data.draw(st.sampled_from(range(guide.vocab_size)).filter(lambda t: not allowed[t]))
        assert matcher.valid_prefix([refused]) == 0
        token = data.draw(st.sampled_from(sorted(ids, key=lambda t: t != eos)))   # EOS first: walks end
        if token == eos:
            assert accepted(kind, tokenizer.decode(tokens))
            return
        matcher.accept(token)
        tokens.append(token)


@WALK
@given(data=st.data())
def test_rollback_returns_to_the_same_masks(vocab, data):
    tokenizer, guide = vocab
    matcher = GrammarMatcher(compile_grammar(SPECS["json"], guide), guide)
    prefix = tokenizer.encode('{"kind": "dog", "age": 4', add_special_tokens=False)
    cut = data.draw(st.integers(0, len(prefix)))
    for t in prefix[:cut]:
        matcher.accept(t)
    before = mask_of(matcher, guide.vocab_size)
    for t in prefix[cut:]:
        matcher.accept(t)
    matcher.rollback(len(prefix) - cut)
    assert torch.equal(mask_of(matcher, guide.vocab_size), before)


def test_a_finished_grammar_allows_eos_alone(vocab):
    tokenizer, guide = vocab
    matcher = GrammarMatcher(compile_grammar(SPECS["choice"], guide), guide)
    for t in tokenizer.encode("maybe so", add_special_tokens=False):
        matcher.accept(t)
    assert matcher.finished and matcher.can_stop
    assert mask_of(matcher, guide.vocab_size).nonzero().flatten().tolist() == [tokenizer.eos_token_ids[0]]


def test_a_choice_of_thousands_of_strings_takes_each_of_them(vocab):
    """Past llguidance's 2,000 items a row, a choice of one alternative a string failed at
    its first token; the strings, with quotes, backslashes and shared prefixes, each hold."""
    tokenizer, guide = vocab
    choices = [f"option {i}" for i in range(3000)] + ['say "hi" \\ \n', "a", "ab", "é"]
    grammar = compile_grammar(StructuredOutputs(choice=choices), guide)
    for text in ("option 2999", 'say "hi" \\ \n', "a", "ab", "é"):
        matcher = GrammarMatcher(grammar, guide)
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert mask_of(matcher, guide.vocab_size)[t], text
            matcher.accept(t)
        assert matcher.can_stop, text
    for text in ("option 3000", "b", "option x"):
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert GrammarMatcher(grammar, guide).valid_prefix(tokens) < len(tokens), text


def test_a_batch_fill_equals_one_row_at_a_time(vocab):
    tokenizer, guide = vocab
    matchers = [GrammarMatcher(compile_grammar(SPECS[k], guide), guide) for k in ("json", "regex", "choice")]
    for t in tokenizer.encode('{"kind"', add_special_tokens=False):
        matchers[0].accept(t)
    batch = MaskFiller(threads=2).fill([MaskRow(m, row) for m, row in zip(matchers, (0, 2, 3))],
                                       new_bitmask(5, guide.vocab_size))
    for m, row in zip(matchers, (0, 2, 3)):
        assert torch.equal(unpack_bits(batch[row], guide.vocab_size), mask_of(m, guide.vocab_size))
    assert (batch[[1, 4]] == -1).all()     # rows without a constraint allow everything


def test_copies_share_a_lexer_and_move_apart(vocab):
    """Copies of a kept matcher, fed different texts and filled in one batch (with a row of
    another lexer), have the masks of matchers made afresh; the kept one stays at the start."""
    tokenizer, guide = vocab
    grammar = compile_grammar(SPECS["json"], guide)
    origin = GrammarMatcher(grammar, guide)
    texts = ['{"kind": "c', '{"kind": "dog", "age": 4', "", '{"kind": "cat", "age": 1, "tags": ["a']
    copies, fresh = [origin.copy() for _ in texts], [GrammarMatcher(grammar, guide) for _ in texts]
    for text, a, b in zip(texts, copies, fresh):
        for t in tokenizer.encode(text, add_special_tokens=False):
            a.accept(t)
            b.accept(t)
    other = GrammarMatcher(compile_grammar(SPECS["regex"], guide), guide)
    assert len({id(m.lexer) for m in copies + [origin]}) == 1 and other.lexer is not origin.lexer
    filler = MaskFiller(threads=2)
    rows = [MaskRow(m, i) for i, m in enumerate([copies[0], other, *copies[1:]])]
    batch = filler.fill(rows, new_bitmask(len(rows), guide.vocab_size))
    for row, m in enumerate([fresh[0], other, *fresh[1:]]):
        assert torch.equal(unpack_bits(batch[row], guide.vocab_size), mask_of(m, guide.vocab_size))
    assert torch.equal(mask_of(origin, guide.vocab_size), mask_of(fresh[2], guide.vocab_size))


def test_draft_rows_hold_the_masks_after_each_draft_token(vocab):
    """A speculative row's mask rows follow its drafts; the matcher is left where it was."""
    tokenizer, guide = vocab
    drafts = tokenizer.encode("12.5", add_special_tokens=False)
    matcher = GrammarMatcher(compile_grammar(SPECS["regex"], guide), guide)
    filler = MaskFiller(threads=1)
    batch = filler.fill([MaskRow(matcher, 1, drafts=tuple(drafts))], new_bitmask(len(drafts) + 2, guide.vocab_size))
    expected = []
    for t in [None, *drafts]:
        if t is not None:
            matcher.accept(t)
        expected.append(mask_of(matcher, guide.vocab_size))
    assert torch.equal(unpack_bits(batch[1:], guide.vocab_size), torch.stack(expected))
    assert (batch[0] == -1).all()


def test_allowed_token_ids_narrow_the_grammar_row(vocab):
    tokenizer, guide = vocab
    from tokenspeed.structured import TokenBias
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123"]
    bias = TokenBias(allowed_token_ids=digits[:2] + [tokenizer.encode("a", add_special_tokens=False)[0]])
    matcher = GrammarMatcher(compile_grammar(SPECS["regex"], guide), guide)
    filler = MaskFiller(threads=1)
    rows = [MaskRow(matcher, 0, allowed=bias.allowed_words(guide.vocab_size)),
            MaskRow(None, 1, allowed=bias.allowed_words(guide.vocab_size))]
    batch = filler.fill(rows, new_bitmask(2, guide.vocab_size))
    assert unpack_bits(batch[0], guide.vocab_size).nonzero().flatten().tolist() == sorted(digits[:2])
    assert unpack_bits(batch[1], guide.vocab_size).nonzero().flatten().tolist() == sorted(bias.allowed_token_ids)


def test_a_reused_buffer_is_filled_whole_and_without_a_torch_op(vocab):
    """Rows without a grammar and a draft window past what the grammar takes come back all
    ones from a buffer holding an older step's masks; the host's writes are no torch op (one
    over a batch would wake torch's thread pool against llguidance's workers)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    tokenizer, guide = vocab
    matchers = [GrammarMatcher(compile_grammar(SPECS[k], guide), guide) for k in ("regex", "choice")]
    drafts = tuple(tokenizer.encode("1a2", add_special_tokens=False))   # the choice grammar takes none
    bitmask = torch.zeros(6 + len(drafts), new_bitmask(1, guide.vocab_size).shape[1], dtype=torch.int32)
    filler = MaskFiller(threads=1)
    with Ops() as ops:
        filler.fill([MaskRow(matchers[0], 1), MaskRow(matchers[1], 3, drafts=drafts)], bitmask)
    assert set(ops.seen) <= {"aten.detach.default"}     # numpy's view of the buffer
    assert (bitmask[[0, 2]] == -1).all() and (bitmask[4:] == -1).all()
    assert torch.equal(unpack_bits(bitmask[1], guide.vocab_size), mask_of(matchers[0], guide.vocab_size))
    assert torch.equal(unpack_bits(bitmask[3], guide.vocab_size), mask_of(matchers[1], guide.vocab_size))


def test_the_filler_leaves_cores_to_the_engine(monkeypatch):
    """Half the CPUs the process may use (its affinity and quota, not the machine's count)."""
    from tokenspeed.structured import mask_filler
    for cores, threads in ((1, 1), (2, 1), (16, 8), (192, mask_filler.MAX_THREADS)):
        monkeypatch.setattr(mask_filler, "allowed_cpus", lambda c=cores: c)
        assert mask_filler.default_threads() == threads


def test_rows_past_the_bitmask_are_refused_before_any_write(vocab):
    _, guide = vocab
    matcher = GrammarMatcher(compile_grammar(SPECS["regex"], guide), guide)
    filler = MaskFiller(threads=1)
    with pytest.raises(ValueError, match="mask row 1 with 2 draft rows after it is outside a bitmask of 3 rows"):
        filler.fill([MaskRow(matcher, 1, drafts=(5, 6))], new_bitmask(3, guide.vocab_size))
    with pytest.raises(ValueError, match="contiguous host int32"):
        filler.fill([MaskRow(matcher, 0)], new_bitmask(3, guide.vocab_size)[:, :2])


def test_the_package_loads_without_torch_compile():
    """llguidance.torch imports torch._dynamo (two seconds); the masks are filled without it."""
    import subprocess
    import sys
    code = "import sys, tokenspeed.structured; sys.exit('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.parametrize("spec", [StructuredOutputs(json_object=True),
                                  StructuredOutputs(json={"x-guidance": {"whitespace_flexible": False},
                                                          "type": "object"})])
def test_json_whitespace_runs_are_bounded(vocab, spec):
    """At most 16 characters of whitespace at a place (none, where the schema asks for compact JSON):
    a sampled reply cannot spend its tokens on one run."""
    tokenizer, guide = vocab
    text = tokenizer.encode("{", add_special_tokens=False) + tokenizer.encode(" ", add_special_tokens=False) * 20
    bound = 16 if spec.json_object else 0
    assert GrammarMatcher(compile_grammar(spec, guide), guide).valid_prefix(text) == 1 + bound


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), words=st.integers(1, 5), cut=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_unpacked_bits_are_each_word_s_bits_in_token_order(rows, words, cut, seed):
    """Token t is bit ``t % 32`` of word ``t // 32`` (llguidance's layout), whatever the word's
    sign; tokens past the last word are refused and a shorter vocabulary cuts the row."""
    from tokenspeed.structured.bitmask import pack_bits
    generator = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31, (rows, words), dtype=torch.int32, generator=generator)
    vocab = words * 32 - 20 + cut
    expected = [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) if t < words * 32 else False
                 for t in range(vocab)] for r in range(rows)]
    assert unpack_bits(bitmask, vocab).tolist() == expected
    assert torch.equal(pack_bits(unpack_bits(bitmask, words * 32)), bitmask)
