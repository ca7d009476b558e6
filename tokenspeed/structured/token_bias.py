"""``TokenBias``: OpenAI's ``logit_bias`` and vLLM's ``allowed_token_ids``, as one record.

``allowed_token_ids`` joins the grammar's route: a packed row (``allowed_words``) ANDed
into the request's mask row (``MaskRow.allowed``). ``logit_bias`` is added to the row's
logits before sampling (``add_logit_bias_``), as OpenAI and vLLM add it: -100 makes a
token all but impossible, +100 all but certain. Values are checked when the record is
made; ids, against the model's vocabulary, by ``check_vocabulary``.
"""

import math
import numbers
from collections.abc import Mapping, Sequence

import attrs
import torch

from tokenspeed.errors import RefusedRequest
from tokenspeed.structured.bitmask import pack_allowed

MAX_BIAS = 100.0
MAX_KEY_CHARS = 32   # a token id's digits, with room for spaces around them


def _token_id(field: str, key: object) -> int:
    """An id as JSON carries it (OpenAI's keys are strings of ASCII digits, short enough for
    ``int``: past 4,300 digits it raises) or as an int."""
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() and len(key) <= MAX_KEY_CHARS:
        return int(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool) and key >= 0:
        return int(key)
    raise RefusedRequest(f"{field}: {key!r} is not a token id (an integer >= 0)",
                         field=field, value=key, limit=None)


def bias_pairs(value: Mapping | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and \
            all(isinstance(p, Sequence) and len(p) == 2 for p in value):
        value = dict(value)   # (id, bias) pairs, as the record holds them (and msgpack carries them)
    if not isinstance(value, Mapping):
        raise RefusedRequest(f"logit_bias={value!r}: must map token ids to biases",
                             field="logit_bias", value=value, limit=None)
    return tuple(sorted((_token_id("logit_bias", k), _bias("logit_bias", k, v)) for k, v in value.items()))


def _bias(field: str, key: object, value: object) -> float:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not real or not -MAX_BIAS <= value <= MAX_BIAS:
        raise RefusedRequest(f"{field}[{key!r}]={value!r}: must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
                             field=field, value=value, limit=MAX_BIAS)
    return float(value)


def allowed_ids(value: Sequence | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not len(value):
        raise RefusedRequest(f"allowed_token_ids={value!r}: must be a non-empty list of token ids",
                             field="allowed_token_ids", value=value, limit=None)
    return tuple(_token_id("allowed_token_ids", t) for t in value)


@attrs.frozen
class TokenBias:
    """``logit_bias``: (token id, bias) pairs in id order; ``allowed_token_ids``: the only
    tokens a request may sample, or None for all of them."""

    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=None, converter=bias_pairs)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=allowed_ids)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuses an id outside [0, vocab_size), naming its field."""
        for field, ids in (("logit_bias", [t for t, _ in self.logit_bias]),
                           ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise RefusedRequest(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})",
                                     field=field, value=bad, limit=vocab_size)

    def allowed_words(self, vocab_size: int) -> torch.Tensor | None:
        """The packed mask row of ``allowed_token_ids``, or None when every token is allowed."""
        return None if self.allowed_token_ids is None else pack_allowed(self.allowed_token_ids, vocab_size)


def add_logit_bias_(logits: torch.Tensor, rows: Sequence[tuple[int, TokenBias]]) -> torch.Tensor:
    """Adds each ``(row, bias)``'s ``logit_bias`` to ``logits [rows, vocab]`` in place."""
    pairs = [(row, t, b) for row, bias in rows for t, b in bias.logit_bias]
    if pairs:
        index = torch.tensor([[r, t] for r, t, _ in pairs], dtype=torch.int64).T.to(logits.device)
        values = torch.tensor([b for *_, b in pairs], dtype=logits.dtype, device=logits.device)
        logits.index_put_((index[0], index[1]), values, accumulate=True)
    return logits
