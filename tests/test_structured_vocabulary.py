"""llguidance's view of a vocabulary: read from the tokenizer's JSON (native tokenization,
no Python during a mask) when that reading agrees with tokenspeed's bytes, with the masks
of the Python-fed view; where it does not, the Python-fed view, said in a log line."""

import logging

import pytest
import torch

from tokenspeed.structured import GrammarMatcher, StructuredOutputs, compile_grammar, guidance_tokenizer, new_bitmask
from tokenspeed.structured import vocabulary

from text_models import smol_tokenizer
from tiny_vocab import tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
          "required": ["name", "kind", "age"], "additionalProperties": False}
TEXT = '{"name": "Zoë 😀 \\"x", "kind": "dog", "age": 41}'


class PythonCalls:
    """``_Vocabulary.__call__`` (the Python encoder llguidance calls), counted."""

    def __init__(self, monkeypatch):
        self.count, call = 0, vocabulary._Vocabulary.__call__

        def counted(vocab, text):
            self.count += 1
            return call(vocab, text)
        monkeypatch.setattr(vocabulary._Vocabulary, "__call__", counted)


def walk_masks(tokenizer, guide) -> torch.Tensor:
    """The masks along ``TEXT`` under ``SCHEMA``, a row a token."""
    text = tokenizer.encode(TEXT, add_special_tokens=False)
    matcher, bitmask = GrammarMatcher(compile_grammar(StructuredOutputs(json=SCHEMA), guide), guide), \
        new_bitmask(len(text), guide.vocab_size)
    for row, token in enumerate(text):
        matcher.fill(bitmask, row)
        matcher.accept(token)
    return bitmask


@pytest.mark.parametrize("make, padding", [(tiny_tokenizer, 7), (smol_tokenizer, 11)])
def test_the_json_reading_is_kept_with_the_masks_of_the_python_fed_view(make, padding, monkeypatch):
    """The tiny vocabulary holds the lone byte 0xFF, which llguidance marks special either
    way: its reading differs from tokenspeed's bytes there and is kept all the same."""
    tokenizer = make()
    size = tokenizer.vocab_size + padding
    python = PythonCalls(monkeypatch)
    guide = guidance_tokenizer(tokenizer, size)
    python.count = 0     # (the Python-fed view built for the comparison calls its encoder once)
    native_masks = walk_masks(tokenizer, guide)
    assert python.count == 0 and guide.vocab_size == size
    assert torch.equal(native_masks, walk_masks(tokenizer, vocabulary._wrapped(tokenizer, size)))
    assert python.count > 0     # the walk tokenizes forced text: the Python-fed view called out


class Misread:
    """The tiny tokenizer, one token's bytes given otherwise."""

    def __init__(self, tokenizer, token: int, misread: bytes):
        self.tokenizer, self.token, self.misread = tokenizer, token, misread

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def token_bytes(self, i: int) -> bytes:
        return self.misread if i == self.token else self.tokenizer.token_bytes(i)


def test_a_vocabulary_read_differently_is_fed_from_python_and_said(monkeypatch, caplog):
    tiny = tiny_tokenizer()
    token = tiny.encode("yes", add_special_tokens=False)[0]
    tokenizer = Misread(tiny, token, b"no")
    python = PythonCalls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=vocabulary.__name__):
        guide = guidance_tokenizer(tokenizer)
    assert f"llguidance reads token {token} of this vocabulary as b'yes' (special: False), tokenspeed as b'no'" in caplog.text
    assert guide.decode_bytes([token]) == b"no"
    python.count = 0
    walk_masks(tiny, guide)
    assert python.count > 0


def metaspace_tokenizer():
    """A Unigram vocabulary with byte fallback behind a lone ``Metaspace`` decoder (the
    T5 / Mistral style), which llguidance's own reader does not know."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers
    from tokenspeed.tokenizer.special_tokens import SpecialTokens
    from tokenspeed.tokenizer.tokenizer import Tokenizer
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), *((f"<0x{b:02X}>", 0.0) for b in range(256)),
              ("▁", -1.0), ("▁cat", -2.0), ("▁dog", -2.0), *((c, -3.0) for c in "acdgot{}\"")]
    backend = Backend(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, SpecialTokens(bos_token="<s>", eos_token="</s>", bos_token_id=1, eos_token_ids=(2,)))


def test_a_vocabulary_llguidance_cannot_read_is_fed_from_python_and_said(monkeypatch, caplog):
    tokenizer = metaspace_tokenizer()
    with caplog.at_level(logging.WARNING, logger=vocabulary.__name__):
        guide = guidance_tokenizer(tokenizer, tokenizer.vocab_size + 3)
    assert "llguidance cannot read this tokenizer itself" in caplog.text and guide.vocab_size == tokenizer.vocab_size + 3
    matcher = GrammarMatcher(compile_grammar(StructuredOutputs(choice=["cat", "dog"]), guide), guide)
    pieces = [tokenizer.backend.token_to_id(c) for c in "cato"]
    assert matcher.valid_prefix(pieces[:3]) == 3 and matcher.valid_prefix(pieces[3:]) == 0


def plain_added_tokenizer():
    """The tiny vocabulary with Qwen's plain (not special) added tokens ``<tool_call>`` and
    ``</tool_call>``: text to tokenspeed, special to llguidance's own reading."""
    from tokenizers import AddedToken, Tokenizer as Backend
    from tokenspeed.tokenizer import SpecialTokens, Tokenizer
    backend = Backend.from_str(tiny_tokenizer().backend.to_str())
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    return Tokenizer(backend, SpecialTokens(eos_token="<eos>", eos_token_ids=(backend.token_to_id("<eos>"),)))


def test_a_plain_added_token_a_grammar_forces_is_allowed_whole(caplog):
    """Hermes tool calls on a Qwen-style vocabulary: the Python-fed view (said), whose mask
    at a forced ``<tool_call>`` allows the token the model was trained to write."""
    tokenizer = plain_added_tokenizer()
    call = tokenizer.backend.token_to_id("<tool_call>")
    with caplog.at_level(logging.WARNING, logger=vocabulary.__name__):
        guide = guidance_tokenizer(tokenizer)
    assert f"llguidance reads token {call} of this vocabulary as b'<tool_call>' (special: True)" in caplog.text
    assert not guide.is_special_token(call) and guide.decode_bytes([call]) == b"<tool_call>"
    grammar = StructuredOutputs(grammar='start: "<tool_call>\\n" body "\\n</tool_call>"\n'
                                        'body: %json {"type": "object"}')
    matcher, bitmask = GrammarMatcher(compile_grammar(grammar, guide), guide), new_bitmask(1, guide.vocab_size)
    matcher.fill(bitmask, 0)
    assert (bitmask[0, call // 32] >> (call % 32)) & 1
    assert matcher.valid_prefix(tokenizer.encode('<tool_call>\n{}\n</tool_call>', add_special_tokens=False)) == 5
