"""A request's life: prompt, generated tokens, the pages holding its cache, its status.

A prompt with ``n`` samples becomes ``n`` requests; each after the first names the first
as ``share_from`` and reuses the full KV pages of its prompt instead of computing them.

``output`` holds the tokens the host has read. With overlap, up to two of a request's
tokens may be sampled on the device and not read yet (``num_unread``); they count
towards ``num_tokens`` (scheduling and page growth count them), and the rows that take
them as inputs read them from the token column at the request's seat (``token_column``).
"""

import enum
from array import array

import attrs

from tokenspeed.errors import InternalError
from tokenspeed.execution.outputs import TokenLogprobs
from tokenspeed.scheduling.constraint import Constraint
from tokenspeed.scheduling.request_stats import RequestStats
from tokenspeed.execution.sampler import RowSampling
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.execution.token_column import NULL_SEAT


class RequestStatus(enum.Enum):
    """Where a request stands in the scheduler. A running request is DECODING once at
    most one of its tokens is left to compute: its next row is a decode row (the last
    prompt token's, after a chunked prefill, or its newest token's)."""
    WAITING = "waiting"          # queued, never run
    PREFILLING = "prefilling"    # running, more than one token to compute
    DECODING = "decoding"        # running, one token to compute (or its token in flight)
    PREEMPTED = "preempted"      # queued again, its pages freed: recomputed when it rejoins
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    index: int = 0                         # which of its prompt's n samples
    share_from: "Request | None" = None
    stop_ids: tuple[int, ...] = ()         # end-of-sequence and stop_token_ids
    output: list[int] = attrs.Factory(list)   # the tokens the host has read
    logprobs: list[TokenLogprobs] = attrs.Factory(list)
    num_unread: int = 0                    # sampled on the device, not read yet (module doc)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_token: int | None = None          # the end-of-sequence or stop token that ended it
    error: str | None = None               # why it was ended alone, mid-run (its constraint's)
    num_cached: int = 0                    # tokens whose K/V are in the cache (or being written)
    num_dropped: list[int] = attrs.Factory(list)   # per group: leading pages returned behind its window
    page_digests: list[bytes] = attrs.Factory(list)   # of its full pages (page_digests.py)
    page_tokens: bytearray = attrs.Factory(bytearray)  # those pages' tokens, as the digests read them
    num_pages_remembered: int = 0          # of its pages, those the allocator knows by digest
    seat: int = NULL_SEAT                  # its seat of the token column while it runs
    stats: RequestStats = attrs.Factory(RequestStats)
    max_output: int = attrs.field(default=None, kw_only=True)   # max_tokens, less if the context ends first
    constraint: Constraint | None = attrs.field(default=None, kw_only=True)   # masks of its tokens
    sampling: RowSampling = attrs.field(init=False)  # its sampled rows (reads output live)
    _page_lists: list[list[int]] = attrs.field(init=False, factory=lambda: [[]])
    _token_array: array = attrs.field(init=False)

    def __attrs_post_init__(self):
        if self.max_output is None:
            self.max_output = self.params.max_tokens
        if self.max_output is None:   # max_tokens None: the pool and the context decide (Engine.add)
            raise InternalError("a Request of max_tokens=None needs its max_output (prompt_limits.output_limit)")
        self.sampling = RowSampling(self.params, self.seed, self.prompt, self.output, self.stop_ids)
        self._token_array = array("q", self.prompt)

    def page_lists(self) -> list[list[int]]:
        """Its pages in each cache group (the lists themselves, to edit). Every list has one
        entry per page of its tokens; a windowed group's entries behind the window are the
        null page."""
        return self._page_lists

    @property
    def pages(self) -> list[int]:
        """Cache group 0's pages; every group holds as many entries, so its length is the
        request's page count."""
        return self._page_lists[0]

    def row_pages(self) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Its pages as a metadata row takes them: group 0's, then those of groups 1..
        (``DecodeRow.pages``, ``DecodeRow.group_pages``)."""
        first, *rest = self._page_lists
        return tuple(first), tuple(map(tuple, rest))

    def clear_pages(self, num_groups: int) -> None:
        """No pages in any of ``num_groups`` cache groups: as it joins a scheduler, and
        when its pages are released."""
        self._page_lists = [[] for _ in range(num_groups)]
        self.num_dropped = [0] * num_groups

    def take_seat(self, seat: int) -> None:
        """Hold ``seat`` of the token column: its sampled rows write their tokens there."""
        self.seat = seat
        self.sampling = attrs.evolve(self.sampling, seat=seat)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens the host knows (``num_unread`` more are on the device)."""
        return self.prompt + tuple(self.output)

    def tokens_between(self, start: int, end: int) -> tuple[int, ...]:
        """``tokens[start:end]`` without building ``tokens`` (a decode row's chunk, every step)."""
        split = len(self.prompt)
        if start >= split:
            return tuple(self.output[start - split:end - split])
        return self.prompt[start:end] + tuple(self.output[:max(end - split, 0)])

    @property
    def last_token(self) -> int:
        """``tokens[-1]`` without building ``tokens`` (a decode row's input, every step)."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_tokens(self) -> int:
        """Its tokens, those not read yet included."""
        return len(self.prompt) + len(self.output) + self.num_unread

    @property
    def num_output_tokens(self) -> int:
        return len(self.output) + self.num_unread

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def start_running(self) -> None:
        """As it joins the running requests (its shared or cached pages attached)."""
        self.status = RequestStatus.PREFILLING if self.num_uncached > 1 else RequestStatus.DECODING

    def count_cached(self, num_tokens: int) -> None:
        """Count ``num_tokens`` more of its tokens as cached (their rows launched); with at
        most one left to compute, it decodes."""
        self.num_cached += num_tokens
        if self.status is RequestStatus.PREFILLING and self.num_uncached <= 1:
            self.status = RequestStatus.DECODING

    def token_array(self) -> array:
        """``tokens`` as an array of int64, kept and extended by the new outputs on each call
        (drafting searches it every step; rebuilding it took ~30 us per 1000 tokens). Only
        read tokens are ever in ``output``, so nothing it caches is later replaced."""
        known = len(self._token_array) - len(self.prompt)
        if known < len(self.output):
            self._token_array.extend(self.output[known:])
        return self._token_array

    @property
    def arrival_time(self) -> float:
        return self.stats.arrival_time

    @property
    def first_token_time(self) -> float | None:
        return self.stats.first_token_time

    @property
    def finish_time(self) -> float | None:
        return self.stats.finish_time

    @property
    def num_cached_prompt_tokens(self) -> int:
        return self.stats.num_cached_prompt_tokens

    @property
    def num_verify_steps(self) -> int:
        return self.stats.num_verify_steps

    @property
    def num_verified_tokens(self) -> int:
        return self.stats.num_verified_tokens
