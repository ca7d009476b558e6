"""A request's life: prompt, generated tokens, the pages holding its cache."""

import attrs

from tokenspeed.runtime.outputs import RequestOutput
from tokenspeed.runtime.sampling_params import SamplingParams


@attrs.define
class Request:
    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    output: list[int] = attrs.Factory(list)
    pages: list[int] = attrs.Factory(list)
    num_cached: int = 0          # tokens whose K/V are in the cache
    finish_reason: str | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    @property
    def last_token(self) -> int:
        """``tokens[-1]`` without building ``tokens`` (a decode row's input, every step)."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.id, self.prompt, tuple(self.output), self.finish_reason)
