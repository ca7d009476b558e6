"""What a request returns to its caller (``ts.RequestOutput``), shaped as vLLM's: one
``CompletionOutput`` per sample (``SamplingParams.n``), the first one's fields also on the
request output itself."""

from collections.abc import Iterator, Mapping

import attrs


@attrs.frozen
class Logprob:
    """One token's entry at a position, as vLLM's ``Logprob``: ``rank`` 1 is the most likely
    token (the sampled token's is its rank in the whole vocabulary, as vLLM's, also when it
    is not among the top ones asked for; None only where it was not computed);
    ``decoded_token``: its text (None where the engine has no tokenizer)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@attrs.frozen
class TokenLogprobs(Mapping):
    """A sampled token's log-probability under the model, and the most likely tokens'
    (best first), as many as ``SamplingParams.logprobs`` asked for (``ranked``), then the
    sampled token's where it is not among them (so ``top`` always holds it, as vLLM's
    entries do; its rank is then ``rank``, the number of tokens at least as likely, itself
    included, as vLLM counts it). It is also the mapping
    vLLM returns per position, token id -> ``Logprob`` (the sampled token first), so code
    written for vLLM's ``logprobs[i][token_id].decoded_token`` reads it unchanged;
    ``texts``: each token's text, where ``LLM`` had a tokenizer to decode them."""
    token_id: int
    logprob: float
    top: dict[int, float]
    texts: dict[int, str] | None = None
    ranked: int | None = None   # the entries of ``top`` ranked best first (None: all)
    rank: int | None = None     # the sampled token's rank in the vocabulary (None: not computed)

    def __getitem__(self, token_id: int) -> Logprob:
        ranks = {t: i + 1 for i, t in enumerate(self.top) if self.ranked is None or i < self.ranked}
        if token_id != self.token_id and token_id not in ranks:
            raise KeyError(token_id)
        value = self.logprob if token_id == self.token_id else self.top[token_id]
        rank = ranks.get(token_id, self.rank)   # only the sampled token is outside the ranked ones
        return Logprob(value, rank, None if self.texts is None else self.texts[token_id])

    def __iter__(self) -> Iterator[int]:
        return iter(dict.fromkeys((self.token_id, *self.top)))

    def __len__(self) -> int:
        return len(self.top) + (self.token_id not in self.top)


@attrs.frozen
class RequestMetrics:
    """Wall-clock times (``time.time()``) and token counts of one request (all its samples);
    ``num_cached_tokens``: prompt tokens its first sample found cached (not computed);
    ``mean_accept_length``: tokens kept per speculative window, one with drafts (None when
    it had none)."""
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    mean_accept_length: float | None = None


@attrs.frozen
class CompletionOutput:
    """``finish_reason``: ``"stop"`` (an end-of-sequence or stop token, or a stop string;
    ``stop_reason`` names a stop string or a stop token id, None for end-of-sequence),
    ``"length"`` (max_tokens or the context) or ``"abort"``. The text ends before the token
    or string that stopped it (``include_stop_str_in_output`` keeps it), the token ids
    with that token."""
    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    text: str | None = None
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the kept tokens' log-probabilities, as vLLM's (which scripts read to
        rank samples); None where ``logprobs`` was not asked for, as vLLM's is then."""
        if self.logprobs is None:
            return None
        return sum(position.logprob for position in self.logprobs)

    def finished(self) -> bool:
        """vLLM's ``CompletionOutput.finished()``: whether this sample has ended."""
        return self.finish_reason is not None


@attrs.frozen
class RequestOutput:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    metrics: RequestMetrics
    prompt: str | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> tuple[TokenLogprobs, ...] | None:
        return self.outputs[0].logprobs

    @property
    def finished(self) -> bool:
        return all(o.finished() for o in self.outputs)

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's ``RequestOutput.num_cached_tokens``: prompt tokens found in the prefix cache."""
        return self.metrics.num_cached_tokens
