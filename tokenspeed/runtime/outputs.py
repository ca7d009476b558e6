"""What a request returns to its caller (``ts.RequestOutput``), shaped as vLLM's: one
``CompletionOutput`` per sample (``SamplingParams.n``), the first one's fields also on the
request output itself."""

import attrs


@attrs.frozen
class TokenLogprobs:
    """A sampled token's log-probability under the model, and the most likely tokens'
    (best first), as many as ``SamplingParams.logprobs`` asked for."""
    token_id: int
    logprob: float
    top: dict[int, float]


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
    """``finish_reason``: ``"stop"`` (an end-of-sequence or stop token, or a stop string:
    ``stop_reason`` names it), ``"length"`` (max_tokens or the context) or ``"abort"``."""
    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    text: str | None = None
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None


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
        return all(o.finish_reason is not None for o in self.outputs)
