"""The language model inside a multimodal checkpoint, read as the text model it is.

Qwen3.5 is published as ``Qwen3_5ForConditionalGeneration``: its config.json nests the
language model's fields under ``text_config``, and its tensors are named
``model.language_model.*`` beside a vision tower (``model.visual.*``). tokenspeed serves
text, so it reads the language model as transformers' multimodal class does (its
embeddings tied by the outer config) and leaves the vision tower unread, saying so in one
log line. A text prompt's three M-RoPE axes hold the same positions, so ``mrope_section``
changes nothing and the rotary is the plain one. The multi-token-prediction head that Qwen3-Next and Qwen3.5 checkpoints carry
(``mtp.*``) is not read either, as transformers does not read it.
"""

import logging

import attrs

logger = logging.getLogger(__name__)
NEVER_LOADED = ("mtp.",)   # a hybrid model's, as transformers' ``_keys_to_ignore_on_load_unexpected``
# fields of the whole checkpoint that hold for its language model, over what text_config says
# (transformers ties a multimodal model's embeddings by the outer tie_word_embeddings and
# writes the text_config's default beside it)
OUTER_FIELDS = ("tie_word_embeddings", "quantization_config", "dtype", "torch_dtype")


@attrs.frozen
class TextPart:
    """How a multimodal architecture holds its language model: the text architecture it is,
    the prefix of its tensors' names, and the prefixes of the tensors that are not text."""
    text_architecture: str
    prefix: str
    skipped: tuple[str, ...]

    def config(self, hf: dict) -> dict:
        """The language model's config.json fields (``OUTER_FIELDS`` from the outer config)."""
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{hf['architectures'][0]} config has no text_config object "
                             f"(text_config={text!r}): the language model's fields are not there")
        inherited = {k: hf[k] for k in OUTER_FIELDS if k in hf}
        return {**text, **inherited, "architectures": [self.text_architecture]}

    def text_name(self, name: str) -> str | None:
        """A stored tensor's name as the text architecture names it; None: not text."""
        if name.startswith(self.prefix):
            return "model." + name.removeprefix(self.prefix)
        return None if name.startswith(self.skipped) else name

    def stored_name(self, name: str) -> str:
        """A text architecture's ``model.*`` tensor name as this checkpoint stores it."""
        return self.prefix + name.removeprefix("model.")


TEXT_PARTS = {"Qwen3_5ForConditionalGeneration": TextPart("Qwen3_5ForCausalLM", "model.language_model.",
                                                          ("model.visual.",))}


def text_part(hf: dict) -> TextPart | None:
    """The text part of ``hf``'s architecture, None for a text model (logged where found)."""
    names = hf.get("architectures")
    part = TEXT_PARTS.get(names[0]) if isinstance(names, list) and names else None
    if part is not None:
        logger.info("%s: loading its language model as %s (text only; the vision tower is not read)",
                    names[0], part.text_architecture)
    return part


def loaded_name(name: str, part: TextPart | None, hybrid: bool) -> str | None:
    """A stored tensor's name as the model loads it; None for a tensor it does not read: a
    multimodal checkpoint's other towers, a hybrid model's multi-token-prediction head (which
    transformers does not load either)."""
    if hybrid and name.startswith(NEVER_LOADED):
        return None
    return name if part is None else part.text_name(name)
