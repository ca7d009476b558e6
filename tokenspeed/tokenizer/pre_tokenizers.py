"""How a byte-level vocabulary splits text before BPE, chosen by GGUF's ``tokenizer.ggml.pre``.

BPE merges are learned inside the pieces a pre-tokenizer cuts, so the same vocabulary
gives different ids under a different split. A GGUF names its split with the ``pre``
key (llama.cpp's names); this maps those names to ``tokenizers`` pre-tokenizers:

- a split regex then byte-level spelling, as the model's own tokenizer.json has it
  (the regexes are the ones transformers' GGUF loader uses for these names);
- "digits first": every digit alone, then GPT-2's regex (llama.cpp's ``smollm``,
  ``starcoder``, ... and the original tokenizer.json of those models);
- anything else: GPT-2's byte-level regex, transformers' default.
"""

import warnings
from types import MappingProxyType

from tokenizers import Regex, pre_tokenizers

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # letters that may start a word (and marks)
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_NOT_WORD = r"[^\r\n\p{L}\p{N}]?"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_TEKKEN = (_NOT_WORD + _UPPER + "*" + _LOWER + "+|" + _NOT_WORD + _UPPER + "+" + _LOWER + "*"
           + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (_NOT_WORD + _UPPER + "*" + _LOWER + "+" + _CONTRACTION + "|" + _NOT_WORD + _UPPER + "+" + _LOWER
          + "*" + _CONTRACTION + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_SPLIT_REGEX = MappingProxyType({
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
})
_DIGITS_FIRST = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                           "minerva"})
_GPT2 = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for a byte-level (``gpt2``-model) vocabulary whose ``pre`` key is ``pre``."""
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre is not None and pre not in _GPT2:
        warnings.warn(f"GGUF tokenizer.ggml.pre={pre!r} is not known here; splitting text with "
                      "GPT-2's byte-level regex, which may not be how this vocabulary was trained",
                      stacklevel=3)
    return gpt2
