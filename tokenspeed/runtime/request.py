"""A request's life: prompt, generated tokens, the pages holding its cache, its timings.

A prompt with ``n`` samples becomes ``n`` requests; each after the first names the first
as ``share_from`` and reuses the full KV pages of its prompt instead of computing them.
"""

import enum
import time
from array import array

import attrs

from tokenspeed.runtime.outputs import CompletionOutput, TokenLogprobs
from tokenspeed.runtime.sampler import RowSampling
from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.speculative import backoff_tokens


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
    output: list[int] = attrs.Factory(list)
    logprobs: list[TokenLogprobs] = attrs.Factory(list)
    pages: list[int] = attrs.Factory(list)
    num_cached: int = 0                    # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0      # of the prompt, found cached when admitted
    page_digests: list[bytes] = attrs.Factory(list)   # of its full pages (page_digests.py)
    page_tokens: bytearray = attrs.Factory(bytearray)  # those pages' tokens, as the digests read them
    num_pages_remembered: int = 0          # of its pages, those the allocator knows by digest
    group_pages: list[list[int]] = attrs.Factory(list)   # of cache groups 1.. (group 0's: pages)
    num_dropped: list[int] = attrs.Factory(list)   # per group: leading pages returned behind its window
    num_verify_steps: int = 0              # its speculative windows (with drafts)
    num_verified_tokens: int = 0           # tokens those windows kept
    draft_misses: int = 0                  # windows in a row whose drafts were all rejected
    pending: bool = False                  # output[-1] stands in for a token in flight (engine)
    drafts_from: int = 0                   # no drafts until it has this many tokens (back-off)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    arrival_time: float = attrs.Factory(time.time)
    first_token_time: float | None = None
    finish_time: float | None = None
    max_output: int = attrs.field(default=None, kw_only=True)   # max_tokens, less if the context ends first

    def clear_pages(self, num_groups: int) -> None:
        """No pages in any of ``num_groups`` cache groups: as it joins a scheduler, and
        when its pages are released."""
        self.pages, self.group_pages = [], [[] for _ in range(num_groups - 1)]
        self.num_dropped = [0] * num_groups

    def page_lists(self) -> list[list[int]]:
        """Its pages in each cache group (the lists themselves, to edit). Every list has one
        entry per page of its tokens; a windowed group's entries behind the window are the
        null page."""
        return [self.pages, *self.group_pages]

    def group_page_tuples(self) -> tuple[tuple[int, ...], ...]:
        """The pages of groups 1.., for a metadata row (``DecodeRow.group_pages``)."""
        return tuple(map(tuple, self.group_pages))

    @property
    def tokens(self) -> tuple[int, ...]:
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
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

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
        """Count ``num_tokens`` more of its tokens as cached (a prompt chunk launched); with
        at most one left to compute, it decodes."""
        self.num_cached += num_tokens
        if self.status is RequestStatus.PREFILLING and self.num_uncached <= 1:
            self.status = RequestStatus.DECODING

    def record_verify(self, kept: int, drafted: int) -> None:
        """Count a window of ``drafted`` drafts that kept ``kept`` tokens (a window without
        drafts, a plain row in a verify step, is not a speculative window); after windows
        that kept none of their drafts, wait ever longer before drafting again."""
        if drafted:
            self.num_verify_steps += 1
            self.num_verified_tokens += kept
            self.note_drafts(kept > 1)

    def expected_kept_drafts(self, num_drafts: int) -> float:
        """Drafts of a window of ``num_drafts`` this request is expected to keep: the mean
        of its windows so far, starting from half the window (weighing one window)."""
        kept = self.num_verified_tokens - self.num_verify_steps   # less each window's own sample
        return min(num_drafts, (kept + num_drafts / 2) / (self.num_verify_steps + 1))

    def note_drafts(self, useful: bool) -> None:
        """After drafts that were all rejected, or none found, wait ever longer before
        drafting again (searching costs host time every step; a window, GPU time)."""
        self.draft_misses = 0 if useful else self.draft_misses + 1
        self.drafts_from = self.num_tokens + backoff_tokens(self.draft_misses) if self.draft_misses else 0

    def token_array(self) -> array:
        """``tokens`` as an array of int64, kept and extended by the new outputs on each call
        (drafting searches it every step; rebuilding it took ~30 us per 1000 tokens)."""
        known = len(self._token_array) - len(self.prompt)
        if known < len(self.output):
            self._token_array.extend(self.output[known:])
        return self._token_array

    sampling: RowSampling = attrs.field(init=False)  # its sampled rows (reads output live)

    _token_array: array = attrs.field(init=False)

    def __attrs_post_init__(self):
        if self.max_output is None:
            self.max_output = self.params.max_tokens
        self.sampling = RowSampling(self.params, self.seed, self.prompt, self.output, self.stop_ids)
        self._token_array = array("q", self.prompt)

    def completion(self, text: str | None = None, num_tokens: int | None = None) -> CompletionOutput:
        """``num_tokens``: keep only the first tokens (those up to a stop string)."""
        kept = slice(None) if num_tokens is None else slice(num_tokens)
        logprobs = tuple(self.logprobs[kept]) if self.params.logprobs is not None else None
        return CompletionOutput(self.index, tuple(self.output[kept]), self.finish_reason, text,
                                self.stop_reason, logprobs)
