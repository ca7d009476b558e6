"""A tiny byte-level BPE tokenizer, trained in-process on a few JSON-ish lines: a few
hundred tokens (every byte, some merges, an EOS), so that a property can look at every
token of a mask. Not a test module."""

import functools

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from tokenspeed.tokenizer import SpecialTokens, Tokenizer

EOS = "<eos>"
CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"]}', '{"kind": "cat", "ok": true}',
          "yes no maybe 123 456 7890 -12.5e3", "[1, 2, 3] {} [] null false true",
          "hello world, the quick brown fox", '{"items": [{"id": 1}, {"id": 2}]}']


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> Tokenizer:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer)
    eos = backend.token_to_id(EOS)
    return Tokenizer(backend, SpecialTokens(eos_token=EOS, eos_token_ids=(eos,)))
