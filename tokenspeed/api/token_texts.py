"""Each logprob token's own text on a completion (vLLM's ``Logprob.decoded_token``), so a
caller reading log-probabilities sees words, not bare ids."""

import attrs

from tokenspeed.execution.outputs import CompletionOutput


def with_token_texts(completion: CompletionOutput, tokenizer) -> CompletionOutput:
    """``completion`` with every logprob entry's token decoded on its own (special tokens
    kept: the entry is that token, whatever the text skips)."""
    if completion.logprobs is None or tokenizer is None:
        return completion
    texts: dict[int, str] = {}
    for position in completion.logprobs:
        texts.update({t: tokenizer.decode([t], skip_special_tokens=False) for t in position if t not in texts})
    logprobs = tuple(attrs.evolve(p, texts={t: texts[t] for t in p}) for p in completion.logprobs)
    return attrs.evolve(completion, logprobs=logprobs)
