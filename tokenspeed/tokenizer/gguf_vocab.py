"""The ``tokenizer.*`` metadata of a GGUF file, read with ``gguf.GGUFReader``.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token
types and special ids as metadata. This reads them into one record; the builders
turn it into a ``tokenizers.Tokenizer``.
"""

import warnings
from pathlib import Path

import attrs
import gguf

from tokenspeed.tokenizer.file_errors import TokenizerFileError

GGUF_MAGIC = b"GGUF"   # a GGUF file's first bytes

# llama.cpp's token types (gguf.TokenType): what each vocabulary entry is.
CONTROL = int(gguf.TokenType.CONTROL)            # <|im_start|>, </s>: special, never split
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)  # <think>: matched whole, but ordinary text


@attrs.frozen
class GGUFVocab:
    """One GGUF's tokenizer, as the file states it (``None``: the key is absent)."""

    model: str                           # tokenizer.ggml.model: "gpt2" (byte-level), "llama" (SentencePiece)
    pre: str | None                      # tokenizer.ggml.pre: the pre-tokenizer's name
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    scores: tuple[float, ...] | None
    merges: tuple[str, ...] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    end_of_turn_ids: tuple[int, ...]     # eot / eom: chat turns end here, not at eos
    add_bos: bool | None
    add_eos: bool | None
    add_space_prefix: bool | None
    chat_template: str | None


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is read as a GGUF file: by its name, or else by its first bytes.

    A file named ``.gguf`` that is not one is then refused as a bad GGUF file (and a missing
    one as missing), and a GGUF file named otherwise (an Ollama blob, ``model.bin``, a link
    without the suffix) is still read as one. A directory never is (a Hugging Face model
    directory may be named ``x.gguf``). The model loader asks this too (``models.gguf``),
    so the model and its tokenizer agree on what a path is.
    """
    path = Path(path)
    if path.is_dir():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def _reader_get(reader: gguf.GGUFReader, key: str):
    """A field's Python value (str, int, bool, list), or None when the file lacks it."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _as_tuple(value) -> tuple | None:
    return None if value is None else tuple(value)


def _open(path: str | Path) -> gguf.GGUFReader:
    """The reader fails on a truncated or foreign file with numpy's errors (a reshape, an
    index out of range); each becomes one error naming the file."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError) as exc:
        raise TokenizerFileError(path, f"not a readable GGUF file (truncated or corrupt: {exc})") from exc


def _checked_ids(ggml: dict, path) -> None:
    """Every special token id must be an id of the vocabulary: past it, the token would be
    None (a text prompt would lose its BOS, a generation its end). A padding id past it is
    dropped with a warning, as llama.cpp drops it: tokenspeed never pads."""
    size = len(ggml["tokens"])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id",
                "eom_token_id"):
        value = ggml[key]
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size):
            continue
        problem = (f"tokenizer.ggml.{key}={value!r} is not a token id of the vocabulary: tokenizer.ggml.tokens "
                   f"holds {size} tokens, ids 0 to {size - 1}")
        if key != "padding_token_id":
            raise TokenizerFileError(path, problem)
        warnings.warn(f"{path}: {problem}; the padding token is ignored", stacklevel=4)
        ggml[key] = None


def read_gguf_vocab(path: str | Path, reader: gguf.GGUFReader | None = None) -> GGUFVocab:
    """Read the tokenizer metadata; a file without ``tokenizer.ggml.model`` is an error.
    ``reader``: the file already opened (parsing its metadata takes seconds)."""
    reader = reader or _open(path)
    ggml = {key: _reader_get(reader, f"tokenizer.ggml.{key}") for key in (
        "model", "pre", "tokens", "token_type", "scores", "merges", "bos_token_id", "eos_token_id",
        "unknown_token_id", "padding_token_id", "eot_token_id", "eom_token_id", "add_bos_token",
        "add_eos_token", "add_space_prefix")}
    if ggml["model"] is None or ggml["tokens"] is None:
        raise ValueError(f"{path}: no tokenizer in this GGUF (tokenizer.ggml.model/tokens missing): give one "
                         f"(ts.LLM(path, tokenizer=<a tokenizer directory or model id>)), or run token ids "
                         f"alone (ts.LLM(ts.models.load(path)))")
    _checked_ids(ggml, path)
    return GGUFVocab(
        model=ggml["model"], pre=ggml["pre"], tokens=tuple(ggml["tokens"]),
        token_types=_as_tuple(ggml["token_type"]) or (), scores=_as_tuple(ggml["scores"]),
        merges=_as_tuple(ggml["merges"]), bos_id=ggml["bos_token_id"], eos_id=ggml["eos_token_id"],
        unk_id=ggml["unknown_token_id"], pad_id=ggml["padding_token_id"],
        end_of_turn_ids=tuple(i for i in (ggml["eot_token_id"], ggml["eom_token_id"]) if i is not None),
        add_bos=ggml["add_bos_token"], add_eos=ggml["add_eos_token"],
        add_space_prefix=ggml["add_space_prefix"],
        chat_template=_reader_get(reader, "tokenizer.chat_template"))
