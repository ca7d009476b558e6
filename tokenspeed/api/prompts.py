"""What ``generate`` accepts, checked rather than coerced: a string, a list of strings, a
list of token ids (one prompt), a list of token-id lists, or prompt dicts
(``{"prompt": text}``, ``{"prompt_token_ids": ids}``), or ``Prompt`` records (a chat
prompt, say). A bad prompt is refused naming its index and the bad value."""

import numbers
from collections.abc import Mapping, Sequence

import attrs


# vLLM's prompt-dict keys beside the prompt itself, and why each is not taken
VLLM_PROMPT_OPTIONS = {
    "multi_modal_data": "the models served here read text alone",
    "mm_processor_kwargs": "the models served here read text alone",
    "media_io_kwargs": "the models served here read text alone",
    "multi_modal_uuids": "the models served here read text alone",
    "prompt_embeds": "prompts are token ids or text, not embeddings",
    "token_type_ids": "no cross-encoder models here",
    "cache_salt": "the prefix cache is shared by every prompt alike",
}


@attrs.frozen
class Prompt:
    token_ids: tuple[int, ...]
    text: str | None = None


def parse_prompts(prompts, tokenizer) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping, Prompt)) or _is_token_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"prompts must be a string, token ids, a prompt dict or a list of them; "
                        f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given")
    return [_one(i, p, tokenizer) for i, p in enumerate(prompts)]


def _is_token_ids(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and \
        (_all_ints(value) or all(_is_token_id(t) for t in value))


def _all_ints(values) -> bool:
    """Whether every value is a plain ``int``: the common case, checked at C speed (an
    ``isinstance`` per token took 15 ms of an 8k-token prompt's time to first token; a set
    comprehension 0.32 ms, ``map`` 0.21)."""
    return set(map(type, values)) <= {int}


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _one(index: int, prompt, tokenizer) -> Prompt:
    if isinstance(prompt, Prompt):   # checked like any token ids: a record may be built by hand
        return attrs.evolve(prompt, token_ids=token_ids(prompt.token_ids, f"prompt {index}"))
    if isinstance(prompt, str):
        return Prompt(tuple(encode(tokenizer, prompt, f"prompt {index}")), prompt)
    if isinstance(prompt, Mapping):
        return _from_dict(index, prompt, tokenizer)
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        return Prompt(token_ids(prompt, f"prompt {index}"))
    raise TypeError(f"prompt {index}: expected a string, a list of token ids or a prompt dict, "
                    f"got {type(prompt).__name__} {prompt!r}")


def _from_dict(index: int, prompt: Mapping, tokenizer) -> Prompt:
    """vLLM's ``TextPrompt`` (``{"prompt": text}``) or ``TokensPrompt``
    (``{"prompt_token_ids": ids}``, with the ``prompt`` text they encode where the caller
    has it: the ids are the prompt, the text is the output's ``prompt``, as in vLLM)."""
    _check_dict_keys(index, prompt)
    text = prompt.get("prompt")
    if "prompt" in prompt and not isinstance(text, str):
        raise TypeError(f"prompt {index}: 'prompt' must be a string, got {text!r}")
    if "prompt_token_ids" in prompt:
        return Prompt(token_ids(prompt["prompt_token_ids"], f"prompt {index}"), text)
    return _one(index, text, tokenizer)


def _check_dict_keys(index: int, prompt: Mapping) -> None:
    """A prompt dict holds ``prompt`` or ``prompt_token_ids`` (or both); vLLM's other
    keys (images, a cache salt, ...) are refused by name unless None, as is any other."""
    given = {key for key, value in prompt.items() if key not in VLLM_PROMPT_OPTIONS or value is not None}
    if given & set(VLLM_PROMPT_OPTIONS):
        key = sorted(given & set(VLLM_PROMPT_OPTIONS))[0]
        raise ValueError(f"prompt {index}: vLLM's prompt key {key!r} is not supported here "
                         f"({VLLM_PROMPT_OPTIONS[key]})")
    if not given & {"prompt", "prompt_token_ids"} or given - {"prompt", "prompt_token_ids"}:
        raise ValueError(f"prompt {index}: a prompt dict has 'prompt' (text) or 'prompt_token_ids' (with, "
                         f"optionally, the 'prompt' text they encode); got {sorted(prompt)}")


def token_ids(values, where: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{where}: token ids must be a list of integers, got {values!r}")
    if _all_ints(values):
        return tuple(values)
    bad = [t for t in values if not _is_token_id(t)]   # (None too is a bad id: no sentinel)
    if bad:
        raise TypeError(f"{where}: token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    return tuple(int(t) for t in values)


def encode(tokenizer, text: str, where: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"{where} is text, but this engine has no tokenizer: pass token ids, or load "
                         "a model whose files hold a tokenizer.json (or pass tokenizer=)")
    return tokenizer.encode(unicode_text(text, where))


def unicode_text(text: str, where: str) -> str:
    """``text``, refused where it holds a lone UTF-16 surrogate (no character: the tokenizer
    would fail on it with a TypeError of its own)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start})") from None
    return text


def chat_prompt(tokenizer, messages, add_generation_prompt: bool = True, **template_variables) -> Prompt:
    """One conversation as a prompt: the template's text and its tokens (the template
    writes the special tokens it wants; none are added again). ``template_variables``:
    further variables for the template (``tools``, ``enable_thinking``, ...)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **template_variables)
    return Prompt(tuple(tokenizer.encode(unicode_text(text, "messages"), add_special_tokens=False)), text)

