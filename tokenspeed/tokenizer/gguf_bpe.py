"""Byte-level BPE (``tokenizer.ggml.model = gpt2``) from GGUF metadata.

This is the tokenizer GPT-2, Llama 3, Qwen2 and SmolLM ship as tokenizer.json: BPE over
the byte-level alphabet (every byte spelled as one printable character), the split
that ``tokenizer.ggml.pre`` names, and a byte-level decoder. It matches what
transformers builds from the same file, except for the split of the ``pre`` names
transformers does not know (see ``pre_tokenizers``).
"""

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from tokenspeed.tokenizer.gguf_vocab import GGUFVocab
from tokenspeed.tokenizer.pre_tokenizers import byte_level_pre_tokenizer


def byte_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE spells bytes with."""
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def byte_level_spelling(token: str, alphabet: frozenset[str]) -> str:
    """``token`` in the byte alphabet: as is when it already is, else its UTF-8 bytes spelled out.

    Some converters store a token as its text ("a b") rather than its byte spelling
    ("aĠb"); BPE only ever meets the spelling, so such tokens would never match.
    """
    if set(token) <= alphabet:
        return token
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in spell.pre_tokenize_str(token))


def split_merge(merge: str) -> tuple[str, str]:
    """``"a b"`` -> ``("a", "b")``: split at the first space after the first character (llama.cpp's rule)."""
    cut = merge.index(" ", 1)
    return merge[:cut], merge[cut + 1:]


def byte_level_backend(vocab: GGUFVocab) -> Backend:
    """The ``tokenizers`` BPE tokenizer for a ``gpt2``-model GGUF (special tokens not yet added)."""
    alphabet = byte_alphabet()
    ids = {byte_level_spelling(token, alphabet): index for index, token in enumerate(vocab.tokens)}
    merges = [split_merge(merge) for merge in vocab.merges or ()]
    backend = Backend(models.BPE(ids, merges, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = byte_level_pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    return backend
