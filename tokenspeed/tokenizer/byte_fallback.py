"""Which ids a ``ByteFallback`` decoder turns into raw bytes.

SentencePiece vocabularies spell characters they lack as ``<0xNN>`` byte tokens. The
``ByteFallback`` decoder decodes each run of such tokens as a whole: valid UTF-8
becomes its text, anything else becomes one U+FFFD per token. So the text of a run
is not known until the run ends: ``<0x3A>`` alone is ":", but ``<0x3A><0xF0>`` is "��".
An incremental detokenizer must hold a run back until a non-byte token closes it.
"""

import json
import re

from tokenizers import Tokenizer as Backend

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _decoder_types(state: dict) -> list[str]:
    """Every decoder type in a serialized decoder, looking inside ``Sequence``."""
    inner = state.get("decoders") or []
    return [state.get("type", ""), *(kind for child in inner for kind in _decoder_types(child))]


def byte_fallback_ids(backend: Backend) -> frozenset[int]:
    """The ``<0xNN>`` ids when the decoder has a ``ByteFallback`` step, else none."""
    if backend.decoder is None:
        return frozenset()
    if "ByteFallback" not in _decoder_types(json.loads(backend.decoder.__getstate__())):
        return frozenset()
    return frozenset(i for token, i in backend.get_vocab().items() if BYTE_TOKEN.fullmatch(token))
