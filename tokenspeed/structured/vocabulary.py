"""llguidance's view of a model's vocabulary, built from tokenspeed's own tokenizer.

llguidance computes masks over a trie of each token's bytes, and tokenizes text a grammar
forces while it computes them (about one call in three masks of a JSON schema). It reads
both from the tokenizer's ``tokenizers`` JSON when its reading agrees with tokenspeed's
(``Tokenizer.token_bytes``: a byte-level BPE token's raw bytes, a SentencePiece ``<0xNN>``
token's byte, so a Hugging Face directory and a GGUF file, whose backends are built
differently, give the same trie) and with its special tokens: then it tokenizes in native
code and a mask never takes the GIL, so llguidance's workers fill rows of different lexers
truly in parallel (with a Python encoder they queued on the GIL: eight lexers filled 32 rows
no faster than one, docs/PERFORMANCE.md's forty-eighth session). Where the readings differ
(llguidance marks every added token of the form ``<...>`` special: a vocabulary with plain
added tokens, such as Qwen's ``<think>``, differs) or llguidance cannot read the JSON (a
decoder it does not know), llguidance is given the bytes and a Python encoder, and one log
line says so. (Moving such tokens into the JSON's vocabulary gives the same bytes but not the
same masks: a mask at text a grammar forces follows llguidance's tokenization of it, which
then spells a forced ``<tool_call>`` in pieces, so the token itself would be masked.)
Special tokens are marked as such: a grammar names them (``<|im_end|>``) and text never
spells them.

The model's vocabulary (its logits' width) may be larger than the tokenizer's (padded
embeddings); the ids past the tokenizer's are tokens no text mask allows.
"""

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import llguidance

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What is read of ``tokenspeed.tokenizer.Tokenizer`` (named by its parts, so that the
    engine may import this package and still not import the tokenizer)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special_token_ids: Iterable[int]
    token_bytes: Callable[[int], bytes]
    backend: Any    # its ``tokenizers.Tokenizer``, whose JSON llguidance reads

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class _Vocabulary:
    """The duck type ``llguidance.TokenizerWrapper`` reads (``tokens``, ``eos_token_id``,
    ``bos_token_id``, ``special_token_ids``), and the encoder it calls for forced text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def guidance_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """The ``LLTokenizer`` every grammar of this model compiles against. ``vocab_size``:
    the model's logits' width (the tokenizer's own when None). Build it once per model:
    it walks the whole vocabulary (a few tenths of a second for 50k tokens)."""
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size={size}: the model's vocabulary must hold the tokenizer's "
                         f"{tokenizer.vocab_size} tokens")
    if not tokenizer.eos_token_ids:
        raise ValueError("the tokenizer declares no EOS token; a grammar needs one to end on")
    native = _native(tokenizer, size)
    if native is not None and _reads_as_tokenspeed(native, tokenizer):
        return native
    wrapped = _wrapped(tokenizer, size)
    if native is None:
        return wrapped
    differing = _first_difference(native, wrapped, tokenizer.vocab_size)
    if differing is None:
        return native
    log.warning("llguidance reads token %d of this vocabulary as %r (special: %s), tokenspeed as %r "
                "(special: %s): masks tokenize through Python and are filled more slowly", differing,
                native.decode_bytes([differing]), native.is_special_token(differing),
                wrapped.decode_bytes([differing]), wrapped.is_special_token(differing))
    return wrapped


def _native(tokenizer: Tokenizer, size: int) -> llguidance.LLTokenizer | None:
    """llguidance's own reading of the tokenizer's JSON; None, said in a log line, where it
    cannot read it (a decoder it does not know, such as a lone Metaspace)."""
    try:
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=size,
                                      eos_token=list(tokenizer.eos_token_ids))
    except ValueError as exc:
        log.warning("llguidance cannot read this tokenizer itself (%s): masks tokenize through Python "
                    "and are filled more slowly", str(exc).splitlines()[0][:200])
        return None


def _wrapped(tokenizer: Tokenizer, size: int) -> llguidance.LLTokenizer:
    """tokenspeed's bytes and a Python encoder."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, size)),
                                  eos_token=list(tokenizer.eos_token_ids))


def _reads_as_tokenspeed(native: llguidance.LLTokenizer, tokenizer: Tokenizer) -> bool:
    """Every token's bytes and special mark as tokenspeed has them (the common case, checked
    without building the Python-fed view)."""
    special = frozenset(tokenizer.special_token_ids)
    return all(native.decode_bytes([i]) == tokenizer.token_bytes(i) and native.is_special_token(i) == (i in special)
               for i in range(tokenizer.vocab_size))


def _first_difference(a: llguidance.LLTokenizer, b: llguidance.LLTokenizer, count: int) -> int | None:
    """The first of the first ``count`` ids the two views read differently (a byte no UTF-8
    text holds, 0xFF, is marked special by llguidance either way)."""
    return next((i for i in range(count) if a.decode_bytes([i]) != b.decode_bytes([i])
                 or a.is_special_token(i) != b.is_special_token(i)), None)
