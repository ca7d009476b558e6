"""How a request samples: the settings users pass to ``generate`` (``ts.SamplingParams``).

Every field is checked for its type and range when the record is made, so a bad value is
refused with its name before any work starts. Values follow vLLM and OpenAI: ``top_k=0``
(or -1) disables top-k; ``temperature=0`` is greedy, normalised to ``top_k=1`` so every
row takes one sampling route, and so is a temperature below ``GREEDY_TEMPERATURE`` (as in
vLLM: such a temperature is how many clients ask for greedy decoding); penalties have
OpenAI's (presence, frequency: over the generated tokens) and Hugging Face's (repetition:
over prompt and generated tokens) meaning. Numbers are bounded by what the sampler's
tensors hold: int64 for integers, float32 for reals (a seed may be any signed 64-bit
integer; ``n`` is capped as OpenAI caps it).
"""

import math
import numbers
from collections.abc import Iterable

import attrs

from tokenspeed.errors import RefusedRequest, did_you_mean
from tokenspeed.structured.spec import StructuredOutputs
from tokenspeed.structured.token_bias import TokenBias, allowed_ids, bias_pairs

MAX_LOGPROBS = 20
MAX_N = 128                      # OpenAI's cap on completions per prompt
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0**-126         # the smallest normal float32
GREEDY_TEMPERATURE = 1e-5        # vLLM's _SAMPLING_EPS: a temperature below it is greedy


def _fail(name, value, limit):
    raise RefusedRequest(f"{name}={value!r}: must be {limit}", field=name, value=value, limit=limit)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _int_in(low: int, high: int):
    def check(instance, attribute, value):
        if not _integer(value) or not low <= value <= high:
            _fail(attribute.name, value, f"an integer >= {low} and <= {_shown(high)}")
    return check


def _shown(bound: float) -> str:
    """A bound as people write it: the int64 limit as a power of two, float32's by name."""
    return {INT64_MAX: "2**63 - 1", FLOAT32_MAX: f"{FLOAT32_MAX:g} (float32's largest)",
            FLOAT32_TINY: f"{FLOAT32_TINY:g} (float32's smallest normal)"}.get(bound, f"{bound:g}")


def _real_in(low: float, high: float, low_open: bool = False):
    """Reals in ``[low, high]`` (``(low, high]`` when ``low_open``); an upper bound of
    float32's largest value is named as such."""
    def check(instance, attribute, value):
        inside = _real(value) and (low < value if low_open else low <= value) and value <= high
        if not inside:
            bound = f"{'>' if low_open else '>='} {_shown(low)} and <= {_shown(high)}" \
                if high == FLOAT32_MAX else f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            _fail(attribute.name, value, f"a finite number {bound}")
    return check


def _positive_float32(instance, attribute, value):
    """A divisor: a value float32 rounds to 0 (below its smallest normal) or infinity divides
    scores into infinities and NaNs."""
    if not (_real(value) and FLOAT32_TINY <= value <= FLOAT32_MAX):
        _fail(attribute.name, value, f"a finite number > 0 that float32 holds: in "
              f"[{_shown(FLOAT32_TINY)}, {_shown(FLOAT32_MAX)}]")


STOP_LIMIT = "a non-empty string or a list of non-empty strings"


def _strings(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        _fail("stop", value, STOP_LIMIT)
    return tuple(value)


def _check_stop(instance, attribute, value):
    """The message names the bad string, not the tuple the list became; a value that is no
    string by its place (``stop[1]=None`` read as ``stop=None``, which is allowed)."""
    for index, stop in enumerate(value):
        if not (isinstance(stop, str) and stop):
            name = "stop" if isinstance(stop, str) else f"stop[{index}]"
            raise RefusedRequest(f"{name}={stop!r}: must be {STOP_LIMIT}", field="stop", value=stop, limit=STOP_LIMIT)


def _token_ids(value) -> tuple:
    if value is None:   # vLLM's default, and so often passed
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        _fail("stop_token_ids", value, "a list of token ids")
    return tuple(value)


def _check_token_ids(instance, attribute, value):
    if not all(_integer(t) and 0 <= t <= INT64_MAX for t in value):
        _fail(attribute.name, value, "a list of token ids (integers >= 0 and <= 2**63 - 1)")


def _check_seed(instance, attribute, value):
    if value is not None and (not _integer(value) or not INT64_MIN <= value <= INT64_MAX):
        _fail("seed", value, "an integer or None, in the signed 64-bit range [-2**63, 2**63 - 1] "
              "(not the unsigned one)")


def _check_logprobs(instance, attribute, value):
    if value is not None and (not _integer(value) or not 0 <= value <= MAX_LOGPROBS):
        _fail("logprobs", value, f"None or an integer in [0, {MAX_LOGPROBS}]")


def _check_bool(instance, attribute, value):
    if not isinstance(value, bool):
        _fail(attribute.name, value, "True or False")


def _check_structured(instance, attribute, value):
    if value is not None and not isinstance(value, StructuredOutputs):
        _fail("structured_outputs", value, "None or a StructuredOutputs")


def _top_k(value):
    return 0 if value == -1 and _integer(value) else value


def _check_top_k(instance, attribute, value):
    """-1 is taken too (converted to 0), so the message names it."""
    if not _integer(value) or not 0 <= value <= INT64_MAX:
        _fail("top_k", value, f"-1 or 0 (off), or an integer >= 1 and <= {_shown(INT64_MAX)}")


# vLLM's SamplingParams fields tokenspeed does not take: the value at which each changes
# nothing (vLLM's default, which scripts often spell out), and why another is refused
VLLM_ONLY = {
    "prompt_logprobs": (None, "the prompt's log-probabilities are not computed"),
    "best_of": (None, "vLLM V1 dropped it too: ask for n samples and rank them by cumulative_logprob"),
    "detokenize": (True, "the text is always decoded"),
    "spaces_between_special_tokens": (True, "special tokens are decoded as the tokenizer joins them"),
    "truncate_prompt_tokens": (None, "prompts are never truncated: a prompt too long is refused"),
    "logits_processors": (None, "no Python code runs per step; use logit_bias or allowed_token_ids"),
    "bad_words": (None, "use logit_bias to forbid tokens"),
    "guided_decoding": (None, "its newer name is structured_outputs (a ts.StructuredOutputs)"),
    "prompt_logprob_token_ids": (None, "the prompt's log-probabilities are not computed"),
    "logprob_token_ids": (None, "logprobs returns the sampled and the most likely tokens"),
    "flat_logprobs": (False, "logprobs are a mapping per position"),
    "extra_args": (None, "no extension reads them"),
    "thinking_token_budget": (None, "a reasoning budget is not enforced"),
}


def _neutral(value, neutral) -> bool:
    """``value`` is the neutral one (True, False, None: by identity, so 1 is not True), or
    an empty list or dict where that is None (no processors, no bad words)."""
    return value is neutral or (neutral is None and isinstance(value, (list, tuple, dict)) and not value)


def _without_vllm_only(fields: dict, known: tuple[str, ...]) -> dict:
    """``fields`` less vLLM's fields given at their neutral value; any other value of one
    is refused naming it and why, and a name neither has is a ``TypeError`` naming the
    closest field, not Python's bare "unexpected keyword"."""
    for name, value in fields.items():
        if name in VLLM_ONLY:
            neutral, why = VLLM_ONLY[name]
            if not _neutral(value, neutral):
                raise RefusedRequest(f"{name}={value!r}: vLLM's {name} is not supported here ({why}); only "
                                     f"{neutral!r} is accepted", field=name, value=value, limit=neutral)
        elif name not in known:
            raise TypeError(f"SamplingParams() got an unknown argument {name!r}{did_you_mean(name, known)}; "
                            f"it takes {', '.join(known)}")
    return {name: value for name, value in fields.items() if name not in VLLM_ONLY}


@attrs.frozen(init=False)
class SamplingParams:
    """``n``: completions per prompt (they share the prompt's full KV pages);
    ``logprobs``: how many top log-probabilities to return with each sampled token (its
    own always comes with them); ``seed``: makes this request's samples reproducible,
    whatever else is in the batch; ``min_tokens``: EOS and ``stop_token_ids`` are masked,
    and ``stop`` strings not matched, until that many tokens exist; ``structured_outputs``:
    what the output must match (a JSON Schema, a regex, a choice, a grammar), enforced by
    a token mask every step; ``logit_bias`` (token id -> bias in [-100, 100], added to its
    logit, as OpenAI adds it) and ``allowed_token_ids`` (the only tokens it may sample)
    take the same route; ``max_tokens`` None: until the context (or the KV pool) ends, as
    vLLM's None; ``include_stop_str_in_output``: the stop string, stop token or
    end-of-sequence token that ended the answer stays at the end of its text (by default
    the text ends before it, as vLLM's does; the token stays among the token ids either
    way).

    Immutable (a request's settings cannot change under it): ``clone(max_tokens=100)``
    gives a changed copy, checked as a new one is, where vLLM's code sets the field."""
    n: int = attrs.field(default=1, validator=_int_in(1, MAX_N))
    temperature: float = attrs.field(default=1.0, validator=_real_in(0.0, FLOAT32_MAX))
    top_p: float = attrs.field(default=1.0, validator=_real_in(0.0, 1.0, low_open=True))
    top_k: int = attrs.field(default=0, converter=_top_k, validator=_check_top_k)
    min_p: float = attrs.field(default=0.0, validator=_real_in(0.0, 1.0))
    presence_penalty: float = attrs.field(default=0.0, validator=_real_in(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_real_in(-2.0, 2.0))
    repetition_penalty: float = attrs.field(default=1.0, validator=_positive_float32)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    max_tokens: int | None = attrs.field(default=16,
                                         validator=attrs.validators.optional(_int_in(1, INT64_MAX)))
    min_tokens: int = attrs.field(default=0, validator=_int_in(0, INT64_MAX))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings, validator=_check_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids,
                                                  validator=_check_token_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)
    skip_special_tokens: bool = attrs.field(default=True, validator=_check_bool)
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_check_bool)
    structured_outputs: StructuredOutputs | None = attrs.field(default=None, validator=_check_structured)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=bias_pairs)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=allowed_ids)

    def __init__(self, *args, **fields):
        """The attrs fields, and vLLM's fields this engine does not take (``VLLM_ONLY``)
        accepted at their neutral value, so a ported script that spells them out runs."""
        self.__attrs_init__(*args, **_without_vllm_only(fields, tuple(attrs.fields_dict(type(self)))))

    def __attrs_post_init__(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens={self.max_tokens}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "top_k", 1)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` (vLLM's ``clone()``, which takes none, then sets fields).
        The ``top_k`` 1 that a greedy temperature set is greedy's mark, not a choice: a copy
        given a temperature that samples (and no ``top_k``) samples with top-k off, as vLLM's
        copy does (its greedy temperature turned top-k off), not greedily."""
        if self.temperature < GREEDY_TEMPERATURE <= changes.get("temperature", 0):
            changes.setdefault("top_k", 0)
        return attrs.evolve(self, **changes)

    @property
    def token_bias(self) -> TokenBias | None:
        """``logit_bias`` and ``allowed_token_ids`` as one record (None: neither is set)."""
        if not self.logit_bias and self.allowed_token_ids is None:
            return None
        return TokenBias(self.logit_bias, self.allowed_token_ids)

    @property
    def constrained(self) -> bool:
        """Its tokens are masked or biased before sampling (a grammar, allowed ids, a bias)."""
        return self.structured_outputs is not None or self.token_bias is not None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or \
            self.repetition_penalty != 1
