"""Tokenizers for the engine's face: Hugging Face directories and GGUF files, chat
templates, incremental detokenization and stop strings.

Built on the ``tokenizers`` library and ``jinja2``; transformers is not needed at run
time. A leaf: nothing else of tokenspeed is imported here.
"""

from tokenspeed.tokenizer.chat_template import ChatTemplate, NoChatTemplateError
from tokenspeed.tokenizer.detokenizer import IncrementalDetokenizer
from tokenspeed.tokenizer.gguf_tokenizer import UnsupportedTokenizerError
from tokenspeed.tokenizer.special_tokens import SpecialTokens
from tokenspeed.tokenizer.stop_strings import StopCheck, StopStrings
from tokenspeed.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ChatTemplate", "IncrementalDetokenizer", "NoChatTemplateError", "SpecialTokens", "StopCheck",
    "StopStrings", "Tokenizer", "UnsupportedTokenizerError", "load_tokenizer",
]
