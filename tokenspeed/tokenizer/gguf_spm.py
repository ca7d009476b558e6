"""SentencePiece-style BPE (``tokenizer.ggml.model = llama``) from GGUF metadata.

Llama 1/2, Mistral and TinyLlama vocabularies: words carry a leading "▁" for the space
before them, unknown characters fall back to ``<0xNN>`` byte tokens, and the file
usually holds scores instead of merges. This builds what transformers' LlamaTokenizer
builds from the same file (merges recovered from the scores the way transformers'
``generate_merges`` does), except that ``tokenizer.ggml.add_space_prefix = false`` is
honoured, as llama.cpp honours it.
"""

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from tokenspeed.tokenizer.gguf_bpe import split_merge
from tokenspeed.tokenizer.gguf_vocab import GGUFVocab


def _pairs(token: str, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every way to cut ``token`` into two pieces that are both in the vocabulary, by piece ids."""
    cuts = [(token[:i], token[i:]) for i in range(1, len(token))]
    return sorted(((left, right) for left, right in cuts if left in ids and right in ids),
                  key=lambda pair: (ids[pair[0]], ids[pair[1]]))


def merges_from_scores(tokens: tuple[str, ...], scores: tuple[float, ...]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: each token is a merge of two others,
    and a better-scored token merges earlier (ties: longer pieces first)."""
    ids = {token: index for index, token in enumerate(tokens)}
    ranked = [(left, right, score) for token, score in dict(zip(tokens, scores)).items()
              for left, right in _pairs(token, ids)]
    ranked.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def sentencepiece_backend(vocab: GGUFVocab) -> Backend:
    """The ``tokenizers`` BPE tokenizer for a ``llama``-model GGUF (special tokens not yet added)."""
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    if vocab.merges is not None:
        merges = [split_merge(merge) for merge in vocab.merges]
    else:
        merges = merges_from_scores(vocab.tokens, vocab.scores or (0.0,) * len(vocab.tokens))
    backend = Backend(models.BPE(ids, merges, dropout=None, fuse_unk=True, byte_fallback=True))
    prefix_space = vocab.add_space_prefix is not False
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix_space else steps)
    return backend
