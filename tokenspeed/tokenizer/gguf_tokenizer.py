"""A tokenizer from a ``.gguf`` file: the vocabulary's backend, its special tokens, its chat template."""

from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from tokenspeed.tokenizer.chat_template import ChatTemplate
from tokenspeed.tokenizer.file_errors import TokenizerFileError
from tokenspeed.tokenizer.gguf_bpe import byte_alphabet, byte_level_backend
from tokenspeed.tokenizer.gguf_spm import sentencepiece_backend
from tokenspeed.tokenizer.gguf_vocab import CONTROL, USER_DEFINED, GGUFVocab, read_gguf_vocab
from tokenspeed.tokenizer.parts import TokenizerParts
from tokenspeed.tokenizer.special_tokens import SpecialTokens, framing_processor, unique_ids


class UnsupportedTokenizerError(ValueError):
    """The GGUF's ``tokenizer.ggml.model`` names a tokenizer this package cannot build."""


def _backend(vocab: GGUFVocab, path: Path) -> Backend:
    builders = {"gpt2": byte_level_backend, "llama": sentencepiece_backend}
    if vocab.model not in builders:
        raise UnsupportedTokenizerError(
            f"{path}: tokenizer.ggml.model={vocab.model!r} is not supported "
            f"(supported: {', '.join(sorted(builders))})")
    if vocab.model == "gpt2" and not vocab.merges:   # BPE without merges: every text in single bytes
        raise TokenizerFileError(path, "a byte-level BPE vocabulary (tokenizer.ggml.model='gpt2') without "
                                       "tokenizer.ggml.merges: text would be cut into single bytes")
    return builders[vocab.model](vocab)


def _add_typed_tokens(backend: Backend, vocab: GGUFVocab) -> None:
    """Control tokens become special tokens and user-defined ones plain added tokens, so
    both are matched whole in text instead of being cut by BPE (as transformers does).

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    converter's mislabel (transformers skips those too).
    """
    alphabet = byte_alphabet() if vocab.model == "gpt2" else None
    typed = list(zip(vocab.tokens, vocab.token_types))
    control = [t for t, kind in typed if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    known = backend.get_vocab()
    user = [t for t, kind in typed if kind == USER_DEFINED and t in known]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _special_tokens(backend: Backend, vocab: GGUFVocab) -> SpecialTokens:
    """Named tokens by the file's ids; the named ones are made special, as transformers makes them."""
    names = {name: backend.id_to_token(i) if i is not None else None for name, i in (
        ("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
        ("unk_token", vocab.unk_id), ("pad_token", vocab.pad_id))}
    named = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(names.values()) if t]
    backend.add_special_tokens(named)
    return SpecialTokens(**names, bos_token_id=vocab.bos_id,
                         eos_token_ids=unique_ids((vocab.eos_id, *vocab.end_of_turn_ids)))


def _adds_bos(vocab: GGUFVocab) -> bool:
    """Whether encoding prepends BOS: the file's flag; without one, SentencePiece vocabularies
    add it (llama.cpp's and transformers' default) and byte-level ones do not."""
    return vocab.add_bos if vocab.add_bos is not None else vocab.model == "llama"


def read_gguf(path: str | Path, reader=None) -> TokenizerParts:
    path = Path(path)
    vocab = read_gguf_vocab(path, reader)
    backend = _backend(vocab, path)
    _add_typed_tokens(backend, vocab)
    special = _special_tokens(backend, vocab)
    backend.post_processor = framing_processor(
        backend, special.bos_token if _adds_bos(vocab) else None,
        special.eos_token if vocab.add_eos else None)
    template = ChatTemplate.of_model(vocab.chat_template, f"{path} (tokenizer.chat_template)") \
        if vocab.chat_template else None
    return TokenizerParts(backend, special, template)
