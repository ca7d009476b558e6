"""What a loader hands to ``Tokenizer``: the backend, its special tokens, its chat template."""

import attrs
from tokenizers import Tokenizer as Backend

from tokenspeed.tokenizer.chat_template import ChatTemplate
from tokenspeed.tokenizer.special_tokens import SpecialTokens


@attrs.frozen
class TokenizerParts:
    """The three things every source (HF directory, GGUF file) yields.

    Loaders return this instead of a ``Tokenizer`` so they do not depend on the class
    that dispatches to them.
    """

    backend: Backend
    special: SpecialTokens
    chat_template: ChatTemplate | None
