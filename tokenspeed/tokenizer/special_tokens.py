"""The named special tokens of a vocabulary, and the BOS/EOS framing they imply."""

from collections.abc import Iterable

import attrs
from tokenizers import Tokenizer as Backend
from tokenizers import processors


@attrs.frozen
class SpecialTokens:
    """Which tokens open and close a sequence.

    The strings are what chat templates see as ``bos_token`` / ``eos_token`` / ...;
    the ids are what the engine needs: ``eos_token_ids`` holds every id that ends a
    generation (the tokenizer's EOS plus what generation_config.json or the GGUF's
    end-of-turn key adds), because chat models often end a turn with a token that is
    not the tokenizer's EOS.
    """

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def template_variables(self) -> dict[str, str]:
        """The ``*_token`` variables transformers passes to a chat template.

        A missing token is left out rather than passed as None, so the template sees
        an undefined (empty) variable instead of the text "None".
        """
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def unique_ids(ids: Iterable[int | None]) -> tuple[int, ...]:
    """The ids in first-seen order, without None or repeats."""
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def framing_processor(backend: Backend, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """A post-processor that frames a sequence with ``bos`` and/or ``eos`` (None: no token).

    This is the processor transformers installs from ``add_bos_token``/``add_eos_token``,
    so ``encode(text, add_special_tokens=True)`` adds BOS exactly when it would.
    """
    head = f"{bos}:0 " if bos else ""
    tail = f" {eos}:0" if eos else ""
    single = f"{head}$A:0{tail}"
    pair = f"{single} {head.replace(':0', ':1')}$B:1{tail.replace(':0', ':1')}"
    tokens = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(tokens)))
