"""Each token's own bytes, for log-probabilities that a client can join back into text.

Decoding one token alone loses bytes: a byte-level token that holds half of a UTF-8
character, or a SentencePiece ``<0xNN>`` byte token, decodes to U+FFFD, whose UTF-8
(``EF BF BD``) is not what the model wrote. OpenAI's ``bytes`` field carries the real
bytes, so that the bytes of a completion's tokens, joined, decode to its text. They come
from the vocabulary's spelling of the token, by the decoder the tokenizer declares:

- byte-level BPE (a ``ByteLevel`` decoder): every character of the spelling stands for
  one byte (GPT-2's printable byte alphabet);
- SentencePiece byte fallback (a ``ByteFallback`` decoder): ``<0xNN>`` is the byte NN;
- SentencePiece pieces (a ``Metaspace`` decoder, or ``Replace`` of "▁"): the text of the
  piece with "▁" as a space. The decoder also drops the space before a completion's
  first word, so the first token's bytes may hold one space more than its text;
- added tokens (special or not) are their content, and anything else is its decoded text.
"""

import json
import re

import attrs
from tokenizers import Tokenizer as Backend

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_MARKER = "▁"


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet, character -> byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _decoder_state(state: dict) -> list[dict]:
    """Every decoder step in a serialized decoder, looking inside ``Sequence``."""
    return [state, *(step for child in state.get("decoders") or [] for step in _decoder_state(child))]


def _kinds(backend: Backend) -> set[str]:
    """Which of the spellings above the backend's decoder declares."""
    if backend.decoder is None:
        return set()
    steps = _decoder_state(json.loads(backend.decoder.__getstate__()))
    kinds = {step.get("type", "") for step in steps}
    if any(step.get("type") == "Replace" and step.get("content") == " " and
           step.get("pattern", {}).get("String") == SPACE_MARKER for step in steps):
        kinds.add("Metaspace")
    return kinds


@attrs.frozen
class TokenBytes:
    """``token_bytes(id)``: the bytes token ``id`` adds to a text (see the module's note)."""

    backend: Backend = attrs.field(repr=False)
    kinds: frozenset[str] = attrs.field(init=False)
    added: dict[int, str] = attrs.field(init=False, repr=False)
    bytes_of: dict[str, int] = attrs.field(init=False, repr=False)

    @kinds.default
    def _find_kinds(self) -> frozenset[str]:
        return frozenset(_kinds(self.backend))

    @added.default
    def _find_added(self) -> dict[int, str]:
        return {i: token.content for i, token in self.backend.get_added_tokens_decoder().items()}

    @bytes_of.default
    def _find_bytes_of(self) -> dict[str, int]:
        return byte_decoder() if "ByteLevel" in self.kinds else {}

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        spelling = self.backend.id_to_token(token_id)
        if spelling is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.backend.get_vocab_size()})")
        return self._spelled(token_id, spelling)

    def _spelled(self, token_id: int, spelling: str) -> bytes:
        if self.bytes_of and set(spelling) <= self.bytes_of.keys():
            return bytes(self.bytes_of[c] for c in spelling)
        if "ByteFallback" in self.kinds and (byte := BYTE_TOKEN.fullmatch(spelling)):
            return bytes([int(byte.group(1), 16)])
        if "Metaspace" in self.kinds:
            return spelling.replace(SPACE_MARKER, " ").encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
