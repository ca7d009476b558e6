"""``IncrementalDetokenizer``: a request's generated ids -> text, one token at a time.

Decoding the whole output every step costs O(length) per token; decoding one token
alone is wrong (a character's UTF-8 bytes may be spread over several byte-level
tokens, and SentencePiece decoders treat a sequence's first space specially). The
``tokenizers`` library's ``DecodeStream`` does what vLLM's incremental detokenizer
does: it decodes only the tokens since the last emitted text, holds back text that
ends in U+FFFD (half a character) until it resolves, and emits the difference.
A run of SentencePiece ``<0xNN>`` byte tokens is handed to it only once a token with
text of its own closes the run, because the decoder decodes such a run as a whole
(see ``byte_fallback``; a skipped special token does not close it): text shown earlier
could later turn into U+FFFD.
"""

from tokenizers.decoders import DecodeStream

from tokenspeed.tokenizer.tokenizer import Tokenizer


def _ids_that_wait(tokenizer: Tokenizer, skip_special_tokens: bool) -> frozenset[int]:
    """Ids not handed to the stream until a later token: byte-fallback tokens (their run
    may continue) and, when skipped, special tokens (they neither show nor end a run)."""
    if not tokenizer.byte_fallback_ids:
        return frozenset()
    skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
    return tokenizer.byte_fallback_ids | skipped


class IncrementalDetokenizer:
    """Streams the text of one request's generated ids.

    ``push(id)`` returns the text that became stable with this token ("" while a
    multi-byte character is incomplete); at the end ``flush()`` returns what was still
    held back (the text of a truncated character, as ``decode`` renders it). The pushes
    and the flush concatenate to ``tokenizer.decode(generated_ids, skip_special_tokens)``.

    Decoding starts at the first generated token, not inside the prompt, so that the
    text is ``decode(generated_ids)``: for a SentencePiece vocabulary the prompt as
    context would keep the space before the first word, which ``decode`` drops.

    ``deferred``: nobody reads the text before the end (an offline answer without stop
    strings), so ``push`` only keeps the id and ``flush`` decodes them all at once: the
    same text, without a decode step per token on the engine's thread (a few
    microseconds a row of every step, which a batch of constrained rows, bound by the
    host, pays in full).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, deferred: bool = False):
        self._tokenizer = tokenizer
        self._deferred = deferred
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._wait_ids = _ids_that_wait(tokenizer, skip_special_tokens)
        self._ids: list[int] = []
        self._fed = 0      # ids handed to the stream so far
        self._emitted = 0  # characters returned so far

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def push(self, token_id: int) -> str:
        """The new stable text after ``token_id``: decodes only the tokens since the last emission."""
        self._ids.append(token_id)
        if self._deferred or token_id in self._wait_ids:
            return ""
        pending, self._fed = self._ids[self._fed:], len(self._ids)
        text = self._stream.step(self._tokenizer.backend, pending) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """The held-back tail, once no more tokens will come (one full decode per request)."""
        text = self._tokenizer.decode(self._ids, self._skip_special_tokens)[self._emitted:]
        self._emitted += len(text)
        return text
