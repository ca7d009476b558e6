"""A tokenizer from a Hugging Face model directory.

``tokenizer.json`` is the backend as the model's authors saved it, BOS/EOS framing
included: its post-processor decides whether ``encode`` adds BOS, and transformers 5
ignores ``add_bos_token``/``add_eos_token`` in the config when a tokenizer.json exists, so
this does too. The rest is what transformers layers on top, read from
``tokenizer_config.json`` (special tokens, the chat template), ``special_tokens_map.json``
(older saves keep the special tokens there), ``chat_template.jinja`` (newer saves keep
the template there) and ``generation_config.json`` (the ids that end a generation).
"""

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from tokenspeed.tokenizer.chat_template import ChatTemplate
from tokenspeed.tokenizer.file_errors import TokenizerFileError
from tokenspeed.tokenizer.parts import TokenizerParts
from tokenspeed.tokenizer.special_tokens import SpecialTokens, unique_ids

_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
_CONFIG_FILES = ("special_tokens_map.json", "tokenizer_config.json")   # a later file's field wins
# What else a Hugging Face tokenizer is saved as (SentencePiece models, BPE or WordPiece
# vocabularies of slow tokenizers) or with: none of it is read here without tokenizer.json.
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                          *_CONFIG_FILES)
TOKENIZER_JSON_ONLY = "tokenspeed reads a tokenizer from tokenizer.json only"


def _json(path: Path) -> dict[str, Any]:
    """A JSON object's fields; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerFileError(path, f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerFileError(path, f"expected a JSON object of fields, found a {type(value).__name__}")
    return value


def _backend(file: Path) -> Backend:
    """``tokenizers`` reports every problem with the file (not JSON, not UTF-8, a field it
    does not know) as a plain ``Exception``; each becomes one error naming the file."""
    try:
        return Backend.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 -- see the docstring
        raise TokenizerFileError(file, f"not a tokenizer.json that the tokenizers library reads ({exc})") from exc


def _config(directory: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """The fields of the config files, merged, and the file each field was read from (for
    an error to name it)."""
    fields, files = {}, {}
    for name in _CONFIG_FILES:
        read = _json(directory / name)
        fields.update(read)
        files.update(dict.fromkeys(read, directory / name))
    return fields, files


def _added_token(name: str, value: Any, file: Path) -> AddedToken:
    """A special token as the config writes it: a string, or an AddedToken object (its text
    as ``content``, its flags true or false); anything else is refused naming the file."""
    if isinstance(value, str):
        return AddedToken(value, normalized=False, special=True)
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        raise TokenizerFileError(file, f"{name}={value!r}: expected the token's text, or an object with "
                                       f"its text as \"content\"")
    flags = {key: value[key] for key in _ADDED_TOKEN_FLAGS if key in value}
    for key, flag in flags.items():
        if not isinstance(flag, bool):
            raise TokenizerFileError(file, f"{name}.{key}={flag!r}: expected true or false")
    return AddedToken(value["content"], **{"special": True, **flags})


def _named_tokens(config: dict[str, Any], files: dict[str, Path], backend: Backend) -> dict[str, str | None]:
    """The named special tokens, added to the backend as special when they are not yet
    (transformers does the same, so they match whole and ``skip_special_tokens`` drops them)."""
    tokens = {name: _added_token(name, config[name], files[name]) for name in _NAMED
              if config.get(name) not in (None, "")}
    _check_in_vocabulary(tokens, files, backend)
    backend.add_special_tokens(list(tokens.values()))
    return {name: tokens[name].content if name in tokens else None for name in _NAMED}


def _check_in_vocabulary(tokens: dict[str, AddedToken], files: dict[str, Path], backend: Backend) -> None:
    """BOS and EOS must be tokens of tokenizer.json (its added tokens included). transformers
    adds a missing one as a new token, whose id, past the vocabulary, the model never
    learned: prompts would carry it and generations never end on it. (A missing unk or pad
    token is added as transformers adds it: nothing here writes or stops on them.)"""
    size = backend.get_vocab_size(with_added_tokens=True)
    for name in ("bos_token", "eos_token"):
        if name in tokens and backend.token_to_id(tokens[name].content) is None:
            raise TokenizerFileError(files[name], f"{name}={tokens[name].content!r} is not a token of "
                                     f"tokenizer.json ({size} tokens, its added tokens included): as a new "
                                     f"token it would get id {size}, which the model never learned")


def _generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """``eos_token_id`` of generation_config.json: chat models list their end-of-turn ids there."""
    ids = _json(directory / "generation_config.json").get("eos_token_id")
    return tuple(ids) if isinstance(ids, list) else (() if ids is None else (ids,))


def _chat_template_source(directory: Path, config: dict[str, Any],
                          files: dict[str, Path]) -> tuple[str | None, Path | None]:
    """chat_template.jinja if present, else tokenizer_config's ``chat_template`` (a string,
    or a list of named templates of which "default" is the one transformers uses); and the
    file it came from. A value of another kind is refused naming the file."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return _text(jinja_file), jinja_file
    source, file = config.get("chat_template"), files.get("chat_template")
    if source is None or isinstance(source, str):
        return source or None, file
    if isinstance(source, list) and all(_is_named_template(t) for t in source):
        return next((t["template"] for t in source if t["name"] == "default"), None), file
    shown = repr(source) if len(repr(source)) <= 80 else f"{repr(source)[:77]}..."
    raise TokenizerFileError(file, f"chat_template={shown}: expected a Jinja template (a string) or a list "
                                   f"of {{\"name\": ..., \"template\": ...}} objects")


def _is_named_template(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(key), str) for key in ("name", "template"))


def _text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerFileError(file, f"not UTF-8 text ({exc})") from exc


def missing_tokenizer_json(directory: str | Path) -> str | None:
    """Why a directory that holds tokenizer files brings no tokenizer here (it lacks a
    tokenizer.json file), naming the files; None when it has one, or no tokenizer file at
    all (weights alone, for token-id prompts)."""
    directory = Path(directory)
    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        return None
    if tokenizer_json.exists():
        return f"{tokenizer_json} is not a file"
    found = [name for name in _OTHER_TOKENIZER_FILES if (directory / name).exists()]
    return f"{directory} has {', '.join(found)} but no tokenizer.json" if found else None


def read_hf_dir(directory: str | Path) -> TokenizerParts:
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        why = missing_tokenizer_json(directory) or f"{directory} has no tokenizer.json"
        raise FileNotFoundError(f"{why}: {TOKENIZER_JSON_ONLY} (transformers' fast tokenizers save one)")
    backend = _backend(directory / "tokenizer.json")
    config, files = _config(directory)
    named = _named_tokens(config, files, backend)
    eos_id = backend.token_to_id(named["eos_token"]) if named["eos_token"] else None
    bos_id = backend.token_to_id(named["bos_token"]) if named["bos_token"] else None
    special = SpecialTokens(**named, bos_token_id=bos_id,
                            eos_token_ids=unique_ids((eos_id, *_generation_eos_ids(directory))))
    source, file = _chat_template_source(directory, config, files)
    return TokenizerParts(backend, special, ChatTemplate.of_model(source, str(file)) if source else None)
