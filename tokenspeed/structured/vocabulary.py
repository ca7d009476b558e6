"""llguidance's view of a model's vocabulary, built from tokenspeed's own tokenizer.

llguidance computes masks over a trie of each token's bytes. It is given those bytes
from ``Tokenizer.token_bytes`` (a byte-level BPE token's raw bytes, a SentencePiece
``<0xNN>`` token's byte), so a Hugging Face directory and a GGUF file, whose backends
are built differently, give the same trie for the same vocabulary. Special tokens are
marked as such: a grammar names them (``<|im_end|>``) and text never spells them.

The model's vocabulary (its logits' width) may be larger than the tokenizer's (padded
embeddings); the ids past the tokenizer's are empty tokens, which no mask allows.
"""

from collections.abc import Callable, Iterable
from typing import Protocol

import llguidance


class Tokenizer(Protocol):
    """What is read of ``tokenspeed.tokenizer.Tokenizer`` (named by its parts, so that the
    engine may import this package and still not import the tokenizer)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special_token_ids: Iterable[int]
    token_bytes: Callable[[int], bytes]

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
    it walks the whole vocabulary (a tenth of a second for 50k tokens)."""
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size={size}: the model's vocabulary must hold the tokenizer's "
                         f"{tokenizer.vocab_size} tokens")
    if not tokenizer.eos_token_ids:
        raise ValueError("the tokenizer declares no EOS token; a grammar needs one to end on")
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, size))
    return llguidance.LLTokenizer(wrapper, eos_token=list(tokenizer.eos_token_ids))
