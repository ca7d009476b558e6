"""The OpenAI request bodies, checked strictly (types are not coerced; unknown fields are
refused), and what they become: prompts and ``SamplingParams``. vLLM's extra sampling
fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``) are accepted too, and so are the documented
OpenAI fields that mean nothing to a local server (``user``; for chat also ``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls``, ``prompt_cache_key``,
``safety_identifier``): read, checked for type, and ignored.

The door's bounds (``MAX_PROMPTS``, ``MAX_STOP_STRINGS``, ``MAX_STOP_CHARS``) are far
past what a client asks for, and close the door on requests built to wedge the server
(a 1 MB stop string is matched against every step's text).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenspeed.api.chat_messages import ROLES, template_messages
from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.sampling_params import SamplingParams

MAX_PROMPTS = 2048          # prompts in one completions request (OpenAI's bound on its arrays)
MAX_STOP_STRINGS = 64       # OpenAI allows 4
MAX_STOP_CHARS = 1024       # characters in one stop string


class APIError(Exception):
    """An answer other than 200: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, model_defaults: dict) -> SamplingParams:
        """``model_defaults``: the model's generation_config values (as ``LLM``'s), for the
        fields the request leaves unset, over OpenAI's defaults."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        self._check_stop()
        models = {k: v for k, v in model_defaults.items() if k in UNSET_DEFAULTS}
        given = {k: getattr(self, k) for k in UNSET_DEFAULTS if getattr(self, k) is not None}
        return sampling_params(**{**UNSET_DEFAULTS, **models, **given}, n=self.n, max_tokens=max_tokens,
                               stop=self.stop, seed=self.seed, logprobs=logprobs,
                               presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty,
                               min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                               stop_token_ids=self.stop_token_ids or (),
                               skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: {len(stops)} stop strings, over the limit of {MAX_STOP_STRINGS}", "stop")
        for stop in stops:
            if len(stop) > MAX_STOP_CHARS:
                raise APIError(400, f"stop: a stop string of {len(stop)} characters, over the limit of "
                               f"{MAX_STOP_CHARS}", "stop")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> None:
        for name in ("echo", "suffix", "best_of"):
            if getattr(self, name) not in (None, False) and not (name == "best_of" and self.best_of == self.n):
                raise APIError(400, f"{name} is not supported", name)
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) > MAX_PROMPTS:
            raise APIError(400, f"prompt: {len(self.prompt)} prompts, over the limit of {MAX_PROMPTS} "
                           "per request", "prompt")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        """Shaped by the check ``LLM.chat`` makes (``chat_messages``): one rule for both."""
        return template_messages([self.model_dump(exclude_none=True)])[0]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    response_format: dict | None = None
    metadata: dict[str, str] | None = None          # accepted and ignored (see the module's note)
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def unsupported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "response_format other than text is not supported", "response_format")

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


UNSET_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_params(**fields) -> SamplingParams:
    """``SamplingParams`` from request fields; a refused value is a 400 naming its field
    (the refusal's own)."""
    try:
        return SamplingParams(**fields)
    except RefusedRequest as exc:
        raise APIError(400, str(exc), exc.field) from exc
