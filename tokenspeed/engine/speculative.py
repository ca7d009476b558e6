"""Speculative decoding: a request's decode step verifies a window of candidate tokens.

Row 0 of a request's window is its last token, rows 1..k are drafts; every row is
sampled as a plain decode row at its position (the keyed Gumbel-max, so a row samples
what plain decoding would sample there given the same prefix), and the request keeps the
samples while each draft equals the sample before it. Drafts are proposed
deterministically (n-grams, a draft model's argmax), so keeping a sample when it equals
the draft is rejection sampling with a one-hot proposal: greedy and sampled outputs are
those of plain decoding, up to the rounding by which any two batch shapes differ (a
window runs other kernels and batch sizes than a plain step, so near-tied logits can
break the other way, as they can between batch sizes without speculation). A request
with no draft verifies a window of one row.

``draft`` runs a smaller model of the same vocabulary (``draft_model``,
``draft_model.py``). ``ngram`` (prompt lookup) proposes the tokens that followed the latest
earlier occurrence of the longest suffix of the request's own tokens (``ngram_max`` down
to ``ngram_min`` tokens): no extra model. It finds nothing on text that does not repeat,
and then the step is a plain decode step. A request whose drafts keep failing backs off
(``DraftBackoff``).
"""

import math
import numbers
from array import array

import attrs

from tokenspeed.backends.metadata import DecodeRow
from tokenspeed.execution.compile_config import integer_in
from tokenspeed.execution.ladders import MAX_DRAFT_TOKENS

METHODS = ("ngram", "draft")


def _cost(instance, attribute, value):
    """A finite number >= 1 (an infinite cost would never verify, silently)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"speculative {attribute.name}={value!r}: must be a finite number >= 1")
    if not 1 <= value < math.inf:
        raise ValueError(f"speculative {attribute.name}={value!r}: must be a finite number >= 1")


class PerRequestDrafts:
    """The engine's drafter interface over a ``propose(tokens, limit)`` of one request:
    ``propose_many`` (a decode batch's drafts), ``would_propose`` (how many drafts it
    would propose now: a chained step breaks for drafts worth verifying) and ``release``
    (a request ended)."""

    def propose_many(self, requests, limits: list[int]) -> list[tuple[int, ...]]:
        return [self.propose(r.token_array(), n) if n > 0 else () for r, n in zip(requests, limits)]

    def would_propose(self, request, limit: int) -> int:
        return len(self.propose(request.token_array(), limit))

    def release(self, request) -> None:
        pass


@attrs.frozen
class SpeculativeConfig(PerRequestDrafts):
    """``num_tokens``: drafts per step (the verify window is ``num_tokens + 1`` rows);
    ``draft_model`` (method ``draft``): a model path or a tokenspeed model of the target's
    vocabulary, loaded on the target's device with its compile options. ``verify_cost``:
    what a verify step costs in plain decode steps; a batch verifies only when its requests'
    drafts are expected to gain more (``Engine._verify_pays``; 1 verifies whenever there
    are drafts). On the H200 a verify step costs 2.3-2.7 plain steps at batch 1 and 16
    (docs/PERFORMANCE.md). The config is itself the ``ngram`` drafter; for ``draft``
    ``ts.LLM`` builds a ``DraftModelDrafter``."""
    method: str = "ngram"
    num_tokens: int = attrs.field(default=3, validator=integer_in(1, MAX_DRAFT_TOKENS))
    ngram_max: int = attrs.field(default=4, validator=integer_in(1))
    ngram_min: int = attrs.field(default=2, validator=integer_in(1))   # one token matches too often
    draft_model: object = None
    verify_cost: float = attrs.field(default=2.5, validator=_cost)

    def __attrs_post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method={self.method!r}: expected one of {METHODS}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(f"speculative method={self.method!r} with draft_model={self.draft_model!r}: "
                             "a draft model is what method 'draft' needs, and only it")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative ngram_min={self.ngram_min} > ngram_max={self.ngram_max}")

    @property
    def window(self) -> int:
        return self.num_tokens + 1

    def propose(self, tokens, limit: int) -> tuple[int, ...]:
        """Up to ``min(num_tokens, limit)`` drafts to follow ``tokens``."""
        limit = min(self.num_tokens, limit)
        return propose_ngram(tokens, limit, self.ngram_max, self.ngram_min) if limit > 0 else ()


def window_rows(last_token: int, num_tokens: int, pages: tuple[int, ...], draft,
                group_pages: tuple[tuple[int, ...], ...] = ()) -> list[DecodeRow]:
    """A request's verify window: its last token at the position after its cache, then its
    drafts at the positions after that. Every row writes its key before any row attends
    and reads only positions up to its own, so a rejected draft's key is rewritten by the
    next window (which starts at the first position not kept) before a row reads it."""
    return [DecodeRow(t, num_tokens - 1 + j, pages, group_pages) for j, t in enumerate((last_token, *draft))]


ITEM = array("q").itemsize
MAX_BACKOFF_TOKENS = 64


def backoff_tokens(misses: int) -> int:
    """Tokens to generate without drafts after ``misses`` windows in a row kept none of
    theirs: a window costs more than a plain step (no overlap, the unfused kernels), so
    text that does not repeat soon stops paying for it."""
    return min(2 ** misses, MAX_BACKOFF_TOKENS)


@attrs.frozen
class Backoff:
    """A request's back-off: windows in a row whose drafts were all rejected (or none
    found), and the token count before which it drafts no more."""
    misses: int = 0
    drafts_from: int = 0


class DraftBackoff:
    """The drafting policy's memory, per request id: after drafts that were all rejected,
    or none found, a request waits ever longer before drafting again (searching costs host
    time every step; a window, GPU time)."""

    def __init__(self):
        self._by_request: dict[int, Backoff] = {}

    def drafts_from(self, request_id: int) -> int:
        """No drafts for the request until it has this many tokens."""
        backoff = self._by_request.get(request_id)
        return 0 if backoff is None else backoff.drafts_from

    def note(self, request_id: int, useful: bool, num_tokens: int) -> None:
        """Drafts were ``useful`` (a window kept one) or not, the request at ``num_tokens``."""
        if useful:
            self._by_request.pop(request_id, None)
            return
        misses = self._by_request.get(request_id, Backoff()).misses + 1
        self._by_request[request_id] = Backoff(misses, num_tokens + backoff_tokens(misses))

    def release(self, request_id: int) -> None:
        self._by_request.pop(request_id, None)


def expected_kept_drafts(stats, num_drafts: int) -> float:
    """Drafts of a window of ``num_drafts`` a request is expected to keep: the mean of its
    windows so far (``RequestStats``), starting from half the window (weighing one window)."""
    kept = stats.num_verified_tokens - stats.num_verify_steps   # less each window's own sample
    return min(num_drafts, (kept + num_drafts / 2) / (stats.num_verify_steps + 1))


def propose_ngram(tokens, k: int, n_max: int, n_min: int = 1) -> tuple[int, ...]:
    """The (up to) ``k`` tokens after the latest earlier occurrence of the longest suffix
    n-gram of ``tokens`` (``n_max`` down to ``n_min``); () if none recurs. The search runs
    over the tokens' bytes (``bytes.rfind``), not a Python loop per position."""
    data = (tokens if isinstance(tokens, array) else array("q", tokens)).tobytes()
    count = len(data) // ITEM
    for n in range(min(n_max, count - 1), n_min - 1, -1):
        pattern = data[(count - n) * ITEM:]
        end = (count - 1) * ITEM          # an occurrence must end before the last token
        while (found := data.rfind(pattern, 0, end)) >= 0:
            if found % ITEM == 0:
                start = found // ITEM + n
                return tuple(tokens[start:start + k])   # an array's slice is an array
            end = found + len(pattern) - 1
    return ()
