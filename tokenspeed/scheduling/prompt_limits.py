"""What one engine can serve, as a record a server in another process can check against.

``LLM`` checks every request with ``check_request`` before queueing it; the OpenAI server
runs the engine in its own process and checks with the same function and the same record,
so a refusal reads the same wherever it is made, and carries its field, value and limit
for the CLI and the server to render.
"""

import struct

import attrs
import numpy as np

from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.sampling_params import SamplingParams


@attrs.frozen
class PromptLimits:
    vocab_size: int
    max_model_len: int
    page_size: int
    usable_pages: int            # the pool's pages, less the null page
    retentions: tuple[int, ...] = (0,)   # each cache group's (``Scheduler.retentions``)
    max_chunk: int = 0           # the most new tokens a step computes for one request
    eos_token_ids: tuple[int, ...] = ()   # masked, with stop_token_ids, until min_tokens


def most_pages_held(num_tokens: int, page_size: int, window: int = 0, max_chunk: int = 0) -> int:
    """The most KV pages a request of ``num_tokens`` tokens holds at once in one cache group:
    one per page of them, or, when the group's layers have a ``window`` (the scheduler
    returns the pages wholly behind it while the request runs), those of the window and of
    a step's chunk of at most ``max_chunk`` new tokens, and the two pages either end shares."""
    pages = -(-num_tokens // page_size)
    return min(pages, (window + max_chunk) // page_size + 2) if window else pages


def check_request(limits: PromptLimits, index: int, prompt: tuple[int, ...], params: SamplingParams,
                  *, has_tokenizer: bool) -> None:
    """Refuse, naming prompt ``index`` (or the field) and the limit, what the engine cannot
    serve: the one check, the engine's and the server's. A request's ``n`` samples need no
    more pages at once than one of them: a sample is admitted only when the pool has its
    pages (sharing the prompt's full pages of the first while that one runs), and the
    newest running sample is preempted when pages run out, so the samples run as the pool
    allows. One sample's pages bound the request."""
    where = f"prompt {index}"
    if params.stop and not has_tokenizer:
        raise RefusedRequest(f"{where}: stop strings need a tokenizer, and this engine has none: use "
                             "stop_token_ids", field="stop", value=params.stop, limit=None)
    if params.structured_outputs is not None and not has_tokenizer:
        raise RefusedRequest(f"{where}: structured_outputs need a tokenizer (a grammar is compiled against "
                             "the vocabulary as it spells it), and this engine has none",
                             field="structured_outputs", value=params.structured_outputs, limit=None)
    check_constraint(params, limits.vocab_size, limits.eos_token_ids)
    if not prompt:
        raise RefusedRequest(f"{where} is empty", field="prompt", value=0, limit=1)
    _check_vocabulary("prompt", where, "token id", prompt, limits.vocab_size)
    _check_vocabulary("stop_token_ids", "stop_token_ids", "stop token id", params.stop_token_ids,
                      limits.vocab_size)
    _check_length(limits, where, len(prompt), output_limit(limits, where, len(prompt), params))


def output_limit(limits: PromptLimits, where: str, prompt_tokens: int, params: SamplingParams) -> int:
    """The tokens a request may make: ``max_tokens``, or with None (vLLM's "until the
    context ends") as many as the context and the KV pool leave the prompt; refused where
    that is none."""
    if params.max_tokens is not None:
        return params.max_tokens
    longest = _longest_held(limits)
    if prompt_tokens >= longest:
        raise RefusedRequest(f"{where}: {prompt_tokens} prompt tokens leave no room for an output token "
                             f"(max_model_len={limits.max_model_len}, {limits.usable_pages} KV pages: "
                             f"{longest} tokens at most)", field="prompt", value=prompt_tokens, limit=longest - 1)
    return longest - prompt_tokens


def fitted(limits: PromptLimits, prompt_tokens: int, params: SamplingParams) -> SamplingParams:
    """``params`` with a ``max_tokens`` past the room the context and the KV pool leave a
    prompt of ``prompt_tokens`` cut to that room. For a default the caller did not choose
    (the model's ``max_new_tokens``, a command's own): the request then ends with the
    context, as vLLM ends it, where a ``max_tokens`` asked for is refused. A prompt that
    leaves no room gets ``max_tokens=None``: its refusal then says that the prompt leaves
    none, not that the default (which the caller never set) is past the limit."""
    if params.max_tokens is None:
        return params
    room = _longest_held(limits) - prompt_tokens
    return attrs.evolve(params, max_tokens=room if room > 0 else None) if room < params.max_tokens else params


def _longest_held(limits: PromptLimits) -> int:
    """The most tokens, up to ``max_model_len``, whose KV pages the pool holds at once
    (bisected: the pages grow with the tokens)."""
    low, high = 0, limits.max_model_len
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _pages_held(limits, middle) <= limits.usable_pages else (low, middle - 1)
    return low


def _pages_held(limits: PromptLimits, num_tokens: int) -> int:
    return sum(most_pages_held(num_tokens, limits.page_size, r, limits.max_chunk) for r in limits.retentions)


def check_constraint(params: SamplingParams, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
    """Refuse token ids outside the vocabulary (``logit_bias``, ``allowed_token_ids``), and
    ``min_tokens`` where it may leave no token to sample: with a grammar (one complete before
    then allows only the end of sequence, which ``min_tokens`` forbids), or over allowed
    tokens that each end the sequence. The engine checks it too, for callers of its own."""
    if params.token_bias is not None:
        params.token_bias.check_vocabulary(vocab_size)
    if params.structured_outputs is not None and params.min_tokens:
        raise RefusedRequest(f"min_tokens={params.min_tokens}: must be 0 with structured_outputs (a complete "
                             "grammar allows only the end of sequence, which min_tokens forbids)",
                             field="min_tokens", value=params.min_tokens, limit=0)
    _check_min_tokens(params, eos_token_ids)


def _check_min_tokens(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> None:
    """``allowed_token_ids`` that ``min_tokens`` masks whole leave the first steps nothing."""
    if not params.min_tokens or params.allowed_token_ids is None:
        return
    masked = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if set(params.allowed_token_ids) <= masked:
        raise RefusedRequest(f"min_tokens={params.min_tokens}: every one of allowed_token_ids "
                             f"{list(params.allowed_token_ids)} ends the sequence (the end-of-sequence and "
                             f"stop ids {sorted(masked)}), and min_tokens masks them, leaving no token to sample",
                             field="min_tokens", value=params.min_tokens, limit=0)


def _check_length(limits: PromptLimits, where: str, prompt_tokens: int, max_tokens: int) -> None:
    """Past ``max_model_len``: the prompt is the field to cut where it alone leaves no room
    for an output token (no ``max_tokens`` would fit it, as vLLM tells the two apart),
    else ``max_tokens``."""
    total = prompt_tokens + max_tokens
    if total > limits.max_model_len and prompt_tokens >= limits.max_model_len:
        raise RefusedRequest(f"{where}: {prompt_tokens} prompt tokens + max_tokens={max_tokens} = {total} "
                             f"exceeds max_model_len={limits.max_model_len}: the prompt alone leaves no room "
                             "for an output token", field="prompt", value=prompt_tokens,
                             limit=limits.max_model_len - 1)
    if total > limits.max_model_len:
        raise RefusedRequest(f"{where}: {prompt_tokens} prompt tokens + max_tokens={max_tokens} = {total} "
                             f"exceeds max_model_len={limits.max_model_len}",
                             field="max_tokens", value=total, limit=limits.max_model_len)
    pages = _pages_held(limits, total)
    if pages > limits.usable_pages:
        raise RefusedRequest(f"{where}: needs {pages} KV pages at once, the pool has "
                             f"{limits.usable_pages} ({prompt_tokens} prompt tokens + max_tokens="
                             f"{max_tokens}; a request's samples take turns in the pool)",
                             field="max_tokens", value=pages, limit=limits.usable_pages)


def _check_vocabulary(field: str, where: str, what: str, ids: tuple[int, ...], vocab_size: int) -> None:
    if ids and not _in_range(ids, vocab_size):   # the loop only to name one
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RefusedRequest(f"{where}: {what} {bad} is outside the vocabulary [0, {vocab_size})",
                             field=field, value=bad, limit=vocab_size)


def _in_range(ids: tuple[int, ...], vocab_size: int) -> bool:
    """Whether every id is in [0, vocab_size), at C speed: packed to 64-bit integers, then
    numpy's min and max (the builtins' took 0.3 ms of an 8k-token prompt's first token)."""
    try:
        values = np.frombuffer(struct.pack(f"{len(ids)}q", *ids), np.int64)
    except struct.error:   # past 64 bits: outside any vocabulary
        return False
    return bool(values.min() >= 0 and values.max() < vocab_size)
