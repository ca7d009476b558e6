"""``Tokenizer``: text <-> ids and conversations -> prompts, without transformers at run time."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from tokenizers import Tokenizer as Backend

from tokenspeed.tokenizer.byte_fallback import byte_fallback_ids
from tokenspeed.tokenizer.chat_template import (ChatTemplate, ChatTemplateRefusal, NoChatTemplateError,
                                                 continued)
from tokenspeed.tokenizer.gguf_tokenizer import read_gguf
from tokenspeed.tokenizer.gguf_vocab import is_gguf
from tokenspeed.tokenizer.hf_dir import read_hf_dir
from tokenspeed.tokenizer.parts import TokenizerParts
from tokenspeed.tokenizer.special_tokens import SpecialTokens
from tokenspeed.tokenizer.token_bytes import TokenBytes


@attrs.frozen
class Tokenizer:
    """A ``tokenizers`` backend with the special tokens and chat template of one model.

    Build it with ``Tokenizer.from_pretrained(path)`` (a Hugging Face model directory
    or a ``.gguf`` file). ``encode``/``decode``/``apply_chat_template`` give the ids and
    text transformers gives for the same model.
    """

    backend: Backend = attrs.field(repr=False)
    special: SpecialTokens
    chat_template: ChatTemplate | None = attrs.field(default=None, repr=False)
    byte_fallback_ids: frozenset[int] = attrs.field(init=False, repr=False)
    """Ids whose text waits for the next token (see ``byte_fallback``); found once, used per token."""

    special_token_ids: frozenset[int] = attrs.field(init=False, repr=False)
    """Ids ``decode(..., skip_special_tokens=True)`` drops."""

    token_bytes: TokenBytes = attrs.field(init=False, repr=False, eq=False)
    """``token_bytes(id)``: the bytes the token adds to a text (U+FFFD never stands in for
    a byte; see ``token_bytes``)."""

    @byte_fallback_ids.default
    def _find_byte_fallback_ids(self) -> frozenset[int]:
        return byte_fallback_ids(self.backend)

    @special_token_ids.default
    def _find_special_token_ids(self) -> frozenset[int]:
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    @token_bytes.default
    def _token_bytes(self) -> TokenBytes:
        return TokenBytes(self.backend)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        return load_tokenizer(path)

    @classmethod
    def from_parts(cls, parts: TokenizerParts) -> "Tokenizer":
        return cls(parts.backend, parts.special, parts.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; special tokens written in it are kept whole. With
        ``add_special_tokens`` the model's framing (BOS, when it wants one) is added."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer knows, added tokens included (transformers' ``len(tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.special.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The id of the model's EOS token (transformers' name, which scripts put in
        ``stop_token_ids``); the engine stops at every id of ``eos_token_ids``."""
        named = self.special.eos_token
        found = None if named is None else self.backend.token_to_id(named)
        return found if found is not None else next(iter(self.eos_token_ids), None)

    def __len__(self) -> int:
        """transformers' ``len(tokenizer)``: ``vocab_size``."""
        return self.vocab_size

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """transformers' lookup of tokens by their text (``"<|eot_id|>"``, for
        ``stop_token_ids``): one id or a list; a token the vocabulary lacks is the unknown
        token's id, None where there is none (as transformers answers)."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def _token_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        unknown = self.special.unk_token
        return found if found is not None or unknown is None else self.backend.token_to_id(unknown)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """transformers' inverse of ``convert_tokens_to_ids``: each id's token text."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (EOS, and the end-of-turn ids the model declares)."""
        return self.special.eos_token_ids

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, *, chat_template: str | None = None,
                            continue_final_message: bool = False, **kwargs) -> list[int] | str:
        """One conversation as the model's prompt: ids, or the text with ``tokenize=False``.

        The rendered text already holds every special token the template writes, so it
        is encoded without adding any (as transformers does). ``kwargs`` become template
        variables (``tools``, ``enable_thinking``, ...). ``chat_template``: a Jinja template
        instead of the model's; ``continue_final_message``: the prompt ends inside the last
        message, which the model goes on writing (an assistant's reply begun for it), as
        transformers' argument of that name does.
        """
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateRefusal("continue_final_message", "it and add_generation_prompt both end the "
                                      "prompt: pass add_generation_prompt=False")
        template = ChatTemplate.compile(chat_template) if chat_template is not None else self.chat_template
        if template is None:
            raise NoChatTemplateError("this model has no chat template; pass a prompt (text or ids) or a "
                                      "chat_template instead")
        text = template.render(messages, add_generation_prompt, self.special.template_variables(), **kwargs)
        text = continued(text, messages) if continue_final_message else text
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(path: str | Path, gguf_reader=None) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory or of a ``.gguf`` file
    (``gguf_reader``: that file already opened with ``gguf.GGUFReader``)."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_parts(read_hf_dir(path))
    if path.is_file() and is_gguf(path):
        return Tokenizer.from_parts(read_gguf(path, gguf_reader))
    raise FileNotFoundError(f"{path}: neither a model directory (with tokenizer.json) nor a GGUF file")
