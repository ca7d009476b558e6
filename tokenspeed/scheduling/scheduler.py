"""Continuous batching with chunked prefill, page allocation and preemption.

Every step is either an extend batch (prompt chunks, plus the decode rows, which take
their tokens and pages first) or, when no prompt work is pending, a decode batch. When
pages run out a decode batch preempts the newest request: its pages are freed and it is
recomputed later, so no live request is ever corrupted.

A request holds a page list per cache group (``ModelConfig.cache_groups``), all drawn from
the one pool. In a group whose layers have a sliding window (its retention), the pages no
later row can read (wholly behind the window of its first uncached position, with a
position of slack) return to the pool while the request runs, so long generations need
bounded memory there; their places in the list become the null page. A group's pages are
allocated with every other group's, in one call, so a step that runs out takes nothing.

With prefix caching, a request admitted takes the cached pages of its longest cached
prefix (``page_digests``) and computes only the rest, and every page a request fills is
remembered for the next one. Without it, the samples of one prompt still share its pages.
Either way a later sample waits until the first has computed the prompt, and the last
prompt token is always computed anew (its logits give the request's first token).

A model with recurrent layers (``recurrent``) resumes a prefix only where its state at the
prefix's end was kept (``state_checkpoints``): with prefix caching a cached prefix is cut
back to the last page with a kept state (none: the prompt is computed whole), and prompt
chunks end at page boundaries so that each request's state passes them between steps; its
samples share no pages (their first sample's state is its own).
"""

from collections import deque

import numpy as np

from tokenspeed.backends.metadata import NULL_PAGE
from tokenspeed.scheduling.block_allocator import BlockAllocator, OutOfPages
from tokenspeed.scheduling.page_digests import PageDigests
from tokenspeed.scheduling.request import Request, RequestStatus
from tokenspeed.scheduling.state_checkpoints import StateCheckpoints
from tokenspeed.scheduling.step_records import ScheduledBatch
from tokenspeed.execution.token_column import NULL_SEAT, Seats


class Scheduler:
    def __init__(self, allocator: BlockAllocator, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_caching: bool = False,
                 retentions: tuple[int, ...] = (0,), max_chunk_tokens: int | None = None,
                 recurrent: bool = False, checkpoints: StateCheckpoints | None = None):
        """``retentions``: each cache group's (``ModelConfig.cache_groups``): positions
        behind a row that its layers read, 0 for all of them. ``max_chunk_tokens``: the
        most new tokens a step takes of one request (default: the step's budget).
        ``recurrent``: the model has recurrent layers; with prefix caching it needs
        ``checkpoints`` to keep their states in."""
        if recurrent and prefix_caching and checkpoints is None:
            raise ValueError("prefix caching for a model with recurrent layers needs state checkpoints")
        self.recurrent, self.checkpoints = recurrent, checkpoints if prefix_caching else None
        self.allocator, self.page_size, self.retentions = allocator, page_size, tuple(retentions)
        self.prefix_caching, self.digests = prefix_caching, PageDigests(page_size)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_chunk_tokens = max_num_batched_tokens if max_chunk_tokens is None else max_chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.seats = Seats(max_num_seqs)    # of the token column, one per running request

    @property
    def num_groups(self) -> int:
        return len(self.retentions)

    def add(self, request: Request) -> None:
        request.clear_pages(self.num_groups)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_free_seat(self) -> bool:
        """Whether a waiting request could join (pages permitting)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def schedule(self) -> ScheduledBatch:
        """The next batch; when nothing fits, the newest running request makes room."""
        while True:
            batch = self.schedule_extend()
            if not batch.requests:
                batch = self._schedule_decode()
            if batch.requests or not self.running:
                return batch
            self._preempt(self.running[-1])

    def finish(self, request: Request) -> None:
        """Take ``request`` out of the queues and return its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def schedule_extend(self) -> ScheduledBatch:
        """Prompt chunks and, with them, the decode rows, which come first for tokens and
        pages (up to half the budget, so prompts always advance): a long prompt never
        stalls the requests already generating. No prompt work, no extend batch. (A
        request whose last token is in flight needs no row after it.)"""
        decoding = [r for r in self.running if r.status is RequestStatus.DECODING and r.num_uncached
                    and r.num_output_tokens < r.max_output]
        first = decoding[:self.max_num_batched_tokens // 2]
        decodes: list = []
        budget = self._take_all(first, self.max_num_batched_tokens, decodes)
        prompts: list = []
        for request in [r for r in self.running if r.status is RequestStatus.PREFILLING]:
            budget = self._take(request, budget, prompts)
        budget = self._admit(budget, prompts)
        if not prompts:
            return ScheduledBatch("extend", (), ())
        self._take_all(decoding[len(first):], budget, decodes)
        picked = decodes + prompts
        return ScheduledBatch("extend", tuple(r for r, _ in picked), tuple(n for _, n in picked))

    def _take_all(self, requests, budget: int, picked: list) -> int:
        for request in requests:
            budget = self._take(request, budget, picked)
        return budget

    def _admit(self, budget: int, picked: list) -> int:
        """Waiting requests join while seats, budget and pages allow; the budget left."""
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            if self._awaits_shared_pages(self.waiting[0]):
                break
            self._attach_shared_pages(self.waiting[0])
            left = self._take(self.waiting[0], budget, picked)
            if left == budget:
                self._release(self.waiting[0])  # a waiting request holds no pages
                break
            budget = left
            self._start_running(self.waiting.popleft())
        return budget

    def _start_running(self, request: Request) -> None:
        self.running.append(request)
        request.take_seat(self.seats.take())
        if self.checkpoints is not None:
            self.checkpoints.take_mark(request)
        request.start_running()

    def _awaits_shared_pages(self, request: Request) -> bool:
        """Whether the sample ``request`` shares pages with is still computing them."""
        source = request.share_from
        if source is None or request.pages or self.recurrent:
            return False
        return source.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.PREFILLING)

    def _attach_shared_pages(self, request: Request) -> None:
        """Hold the full pages already computed for this request's tokens: the cached ones
        with prefix caching, else those of the sample it shares a prompt with. A windowed
        group needs only the pages inside the window of the first uncached position."""
        if request.pages:
            return
        usable = (request.num_tokens - 1) // self.page_size   # the last token is computed
        if self.prefix_caching:
            found, digests = [], self.digests(request, usable)
            for g, retention in enumerate(self.retentions):   # full groups first: they cap the rest
                cap = min(map(len, found), default=usable)
                names = digests[:cap] if g == 0 else [_in_group(d, g) for d in digests[:cap]]
                found.append(self.allocator.cached_pages(names) if retention else self.allocator.cached_prefix(names))
        elif request.share_from is not None and not request.share_from.finished and not self.recurrent:
            source = request.share_from   # only the prompt's pages: past it, their tokens differ
            shared = min(usable, len(request.prompt) // self.page_size, source.num_cached // self.page_size)
            lists = source.page_lists()
            found = [[p if p != NULL_PAGE else None for p in pages[:min(shared, len(pages))]] for pages in lists]
        else:
            return
        k = self._usable_prefix(found)
        if k and self.checkpoints is not None:
            k = self.checkpoints.resumable(request, digests, k)
        if not k:
            return
        lists = request.page_lists()
        for g, retention in enumerate(self.retentions):
            start = self._first_read(k, retention)
            lists[g][:] = [NULL_PAGE] * start + self.allocator.share(found[g][start:k])
            request.num_dropped[g] = start
        request.num_pages_remembered = k
        request.num_cached = k * self.page_size
        if request.stats.first_token_time is None:
            request.stats.num_cached_prompt_tokens = request.num_cached

    def _first_read(self, pages: int, retention: int) -> int:
        """The first page a row after ``pages`` full pages reads in a group of ``retention``."""
        return max((pages * self.page_size - retention) // self.page_size, 0) if retention else 0

    def _usable_prefix(self, found) -> int:
        """The most leading pages every group can supply: ``found`` holds each group's page
        (or None) per leading page, and a group needs those from the first its next row
        reads. A miss at index i rules out every count up to the one it sits under (the
        first page read only grows with the count), so the search jumps to i."""
        k = min(map(len, found))
        misses = [_last_miss(f, k) for f in found]
        while k:
            blocking = [m[k] for m, r in zip(misses, self.retentions) if m[k] >= self._first_read(k, r)]
            if not blocking:
                return k
            k = max(blocking)
        return 0

    def remember_full_pages(self, request: Request) -> None:
        """Let the allocator know the pages ``request`` has filled since the last call, as
        far as the host knows their tokens (the engine calls again as it reads the rest)."""
        if not self.prefix_caching or request.num_cached // self.page_size <= request.num_pages_remembered:
            return   # (every row of every step calls: the common case first)
        full = min(request.num_cached, request.num_known_tokens) // self.page_size
        if full <= request.num_pages_remembered:
            return
        full = min(full, len(request.pages))
        digests = self.digests(request, full)
        for g, pages in enumerate(request.page_lists()):
            for index in range(request.num_pages_remembered, full):
                if pages[index] != NULL_PAGE:
                    self.allocator.remember(pages[index], _in_group(digests[index], g))
        request.num_pages_remembered = full

    def _take(self, request: Request, budget: int, picked: list) -> int:
        """Add up to ``budget`` of ``request``'s uncached tokens if pages allow; new budget."""
        chunk = min(request.num_uncached, budget, self.max_chunk_tokens)
        if self.checkpoints is not None:   # a chunk past a page boundary ends at the last it passes
            boundary = (request.num_cached + chunk) // self.page_size * self.page_size
            chunk = boundary - request.num_cached if boundary > request.num_cached else chunk
        if chunk <= 0 or not self.grow(request, request.num_cached + chunk):
            return budget
        picked.append((request, chunk))
        return budget - chunk

    def _schedule_decode(self) -> ScheduledBatch:
        """Oldest first; a request that cannot grow makes room by preempting the newest
        running request (itself, when it is the newest)."""
        ready = []
        for request in [r for r in self.running if r.status is RequestStatus.DECODING]:
            while request in self.running and not self.grow(request, request.num_tokens):
                self._preempt(self.running[-1])
            if request in self.running:
                ready.append(request)
        return ScheduledBatch("decode", tuple(ready), (1,) * len(ready))

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` tokens of a request in every group; False (nothing taken)
        if the pool cannot supply them."""
        for g, retention in enumerate(self.retentions):
            if retention:
                self._drop_behind_window(request, g, retention)
        needed = -(-num_tokens // self.page_size) - len(request.pages)
        if needed <= 0:  # most decode steps: the last page still has room
            return True
        lists = request.page_lists()
        try:
            new = self.allocator.allocate(needed * len(lists))
        except OutOfPages:
            return False
        for g, pages in enumerate(lists):
            pages.extend(new[g * needed:(g + 1) * needed])
        return True

    def pages_may_change(self, positions: np.ndarray) -> np.ndarray:
        """Which rows of a decode chain ``grow`` may change a page list of: a row at a
        position after one that grew, its request's tokens cached up to the position, takes
        a page at a page boundary, and in a windowed group returns one where the window's
        start crosses one (``_drop_behind_window``)."""
        changes = positions % self.page_size == 0
        for retention in self.retentions:
            if retention:
                changes |= (positions - retention) % self.page_size == 0
        return changes

    def _drop_behind_window(self, request: Request, group: int, retention: int) -> None:
        """Return the pages of ``group`` wholly before ``num_cached - retention``. Every row
        from now on sits at ``num_cached`` or later (so does the row of a decode step still
        in flight: it is the first uncached position), so none of the group's layers reads
        a key before ``num_cached - retention + 1``; one position of slack. (Every row of
        every step calls: nothing is built unless a page boundary passed.)"""
        end = (request.num_cached - retention) // self.page_size
        if end <= request.num_dropped[group]:
            return
        pages = request.page_lists()[group]
        for index in range(request.num_dropped[group], min(end, len(pages))):
            if pages[index] != NULL_PAGE:
                self.allocator.free([pages[index]])
                pages[index] = NULL_PAGE
        request.num_dropped[group] = end

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        """Return its pages and its seat (a waiting request holds neither); its mark is
        kept where the host knows the tokens its state covers."""
        if self.checkpoints is not None:
            marked = self.checkpoints.marked(request)
            known = marked and marked <= request.num_known_tokens
            self.checkpoints.release(request, self.digests(request, marked // self.page_size)[-1] if known else None)
        for pages in request.page_lists():
            self.allocator.free([p for p in pages if p != NULL_PAGE])
        request.clear_pages(self.num_groups)
        request.num_cached, request.num_pages_remembered = 0, 0
        if request.seat != NULL_SEAT:
            self.seats.give_back(request.seat)
            request.take_seat(NULL_SEAT)


def _last_miss(found: list, n: int) -> list[int]:
    """Entry j: the index of the last None among ``found[:j]`` (-1 where none), j <= n."""
    last = [-1] * (n + 1)
    for i in range(n):
        last[i + 1] = i if found[i] is None else last[i]
    return last


def _in_group(digest: bytes, group: int) -> bytes:
    """The name of a page's content in cache group ``group``: the groups' pages share one
    allocator, and the same tokens fill one page in each group."""
    return digest if group == 0 else digest + group.to_bytes(4, "little")
