"""The OpenAI request bodies, checked strictly (types are not coerced; unknown fields are
refused), and what they become: prompts and ``SamplingParams``. vLLM's extra sampling
fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``) are accepted
too, as is vLLM's ``request_id`` (the answer's id, as an ``X-Request-Id`` header sets
it), and so are the documented OpenAI fields that mean nothing to a local server (``user``;
for chat also ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``, ``modalities: ["text"]`` and ``prediction``, a hint for speed):
read, checked for type, and ignored. (``parallel_tool_calls: false`` allows one tool call:
``tool_use``; ``reasoning_effort`` reaches the chat template, as vLLM passes it.) Fields
that would change the answer and cannot here (``verbosity``) are refused like unknown ones.

Constraints on the output (``response_format``, vLLM's ``structured_outputs``) become a
``Constraint`` here; the handler compiles it at the door (``grammar_check``).
``logit_bias`` and vLLM's ``allowed_token_ids`` go to ``SamplingParams`` as they are.
The chat request's own fields (messages, tools) are ``chat_protocol``'s.

The door's bounds (``MAX_PROMPTS``, ``MAX_STOP_STRINGS``, ``MAX_STOP_CHARS``) are far
past what a client asks for, and close the door on requests built to wedge the server
(a 1 MB stop string is matched against every step's text).
"""

import types
import typing

from pydantic import BaseModel, ConfigDict, model_validator

from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.server.openai.api_error import APIError
from tokenspeed.server.openai.grammar_check import Constraint
from tokenspeed.structured import StructuredOutputs, from_response_format
from tokenspeed.structured.spec import KINDS

MAX_PROMPTS = 2048          # prompts in one completions request (OpenAI's bound on its arrays)
MAX_STOP_STRINGS = 64       # OpenAI allows 4
MAX_STOP_CHARS = 1024       # characters in one stop string


class Strict(BaseModel):
    """Types checked, not coerced; unknown fields refused. A null sent for a field that takes
    no null (``n``, ``stream``, ``presence_penalty``) leaves it at its default: OpenAI's
    client sends null for an argument given as None, and OpenAI reads it as unset. A field
    that takes null keeps it (completions' ``max_tokens``: null is no bound, as vLLM reads it)."""
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, body):
        if not isinstance(body, dict):
            return body
        return {k: v for k, v in body.items() if v is not None or not _defaulted_without_null(cls, k)}


def _defaulted_without_null(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    if field is None or field.is_required():
        return False
    annotation = field.annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return not (annotation is type(None) or union and type(None) in typing.get_args(annotation))


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: usage in every chunk too (with include_usage)


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
    request_id: str | None = None   # vLLM's: the answer's id (``routes._request_id``)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, model_defaults: dict,
                        constraint: Constraint | None = None) -> SamplingParams:
        """``model_defaults``: the model's generation_config values (as ``LLM``'s), for the
        fields the request leaves unset, over OpenAI's defaults; ``constraint``: what the
        output must match (``output_constraint``'s, or the tool choice's)."""
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
                               skip_special_tokens=self.skip_special_tokens,
                               include_stop_str_in_output=self.include_stop_str_in_output,
                               structured_outputs=constraint.spec if constraint else None,
                               logit_bias=self.logit_bias or (), allowed_token_ids=self.allowed_token_ids)

    def output_constraint(self) -> Constraint | None:
        """What ``response_format`` or ``structured_outputs`` asks of the output (one of them)."""
        try:
            spec = from_response_format(self.response_format)
        except RefusedRequest as exc:
            raise APIError(400, str(exc), exc.field) from exc
        if self.structured_outputs is None:
            return None if spec is None else Constraint(spec, "response_format")
        if spec is not None:
            raise APIError(400, "response_format and structured_outputs both constrain the output: give one",
                           "structured_outputs")
        return Constraint(_structured_outputs(self.structured_outputs), "structured_outputs")

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

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: read only with ``include_usage``, as vLLM reads it."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> None:
        for name in ("suffix", "best_of"):
            if getattr(self, name) is not None and not (name == "best_of" and self.best_of == self.n):
                raise APIError(400, f"{name} is not supported", name)
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs asks for the prompt's log-probabilities, which are not "
                           "computed: send one of them", "echo")
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) > MAX_PROMPTS:
            raise APIError(400, f"prompt: {len(self.prompt)} prompts, over the limit of {MAX_PROMPTS} "
                           "per request", "prompt")


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


UNSET_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _structured_outputs(value: dict) -> StructuredOutputs:
    """vLLM's ``structured_outputs`` request field: one of its kinds of constraint."""
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise APIError(400, f"structured_outputs: unknown field(s) {unknown}; it takes one of "
                       f"{', '.join(KINDS)}", "structured_outputs")
    try:
        return StructuredOutputs(**value)
    except RefusedRequest as exc:
        raise APIError(400, str(exc), exc.field) from exc


def sampling_params(**fields) -> SamplingParams:
    """``SamplingParams`` from request fields; a refused value is a 400 naming its field
    (the refusal's own)."""
    try:
        return SamplingParams(**fields)
    except RefusedRequest as exc:
        raise APIError(400, str(exc), exc.field) from exc
