"""The ``draft`` drafter: a smaller model of the same vocabulary proposes each request's
next tokens, greedily, from its own KV pool through its own prefill and decode runners
(and their graphs).

Per request the drafter keeps its own pages and how many of the request's tokens its cache
holds. A proposal first extends the cache over the tokens it has not seen (the prompt at
first, then the tokens the last verify step kept), sampling the first draft from that
extend, then runs ``k - 1`` decode steps for the rest, all requests batched. Only the
request's own tokens count as cached afterwards: the drafts' cache rows are overwritten
when the next proposal extends over what was kept.

Drafts are the draft model's argmax even for sampled requests: a window keeps a target
sample only where it equals the draft (``speculative``), which the most likely draft
token makes most likely. A request the pool cannot hold gets no drafts (a plain row).
"""

import attrs

from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.scheduling.block_allocator import BlockAllocator, OutOfPages
from tokenspeed.execution.sampler import RowSampling
from tokenspeed.execution.sampling_params import SamplingParams

GREEDY = RowSampling(SamplingParams(temperature=0.0), seed=0)


@attrs.define
class DraftState:
    pages: list[int] = attrs.Factory(list)
    cached: int = 0                      # the request's tokens the draft cache holds


class DraftModelDrafter:
    def __init__(self, prefill, decode, num_pages: int, page_size: int, num_tokens: int):
        """``prefill``/``decode``: the draft model's runners over its own pool of
        ``num_pages`` pages; ``num_tokens``: drafts per request and step (at most)."""
        self.prefill, self.decode = prefill, decode
        self.allocator, self.page_size, self.num_tokens = BlockAllocator(num_pages), page_size, num_tokens
        self.states: dict[int, DraftState] = {}

    def propose_many(self, requests, limits: list[int]) -> list[tuple[int, ...]]:
        """Up to ``min(num_tokens, limit)`` drafts per request (none where the limit is 0
        or the pool is full)."""
        drafting = [(i, r, min(self.num_tokens, n)) for i, (r, n) in enumerate(zip(requests, limits))
                    if n > 0 and self._reserve(r, r.num_tokens + min(self.num_tokens, n) - 1)]
        drafts = [[] for _ in requests]
        if not drafting:
            return [()] * len(requests)
        chunks = [self._catch_up(r) for _, r, _ in drafting]
        for (i, _, _), token in zip(drafting, self.prefill.launch(chunks, [GREEDY] * len(chunks)).tokens()):
            drafts[i].append(token)
        for j in range(1, max(k for _, _, k in drafting)):
            going = [(i, r) for i, r, k in drafting if k > j]
            rows = [DecodeRow(drafts[i][-1], r.num_tokens + j - 1, tuple(self.states[r.id].pages))
                    for i, r in going]
            for (i, _), token in zip(going, self.decode.launch(rows, [GREEDY] * len(rows)).tokens()):
                drafts[i].append(token)
        return [tuple(d) for d in drafts]

    def would_propose(self, request, limit: int) -> int:
        """A draft model always has guesses (the pool permitting, found when proposing)."""
        return min(self.num_tokens, limit)

    def release(self, request) -> None:
        """The request is over: its pages return to the draft pool."""
        state = self.states.pop(request.id, None)
        if state is not None:
            self.allocator.free(state.pages)

    def _reserve(self, request, num_positions: int) -> bool:
        """Pages for ``num_positions`` positions of ``request`` in the draft pool."""
        state = self.states.setdefault(request.id, DraftState())
        needed = -(-num_positions // self.page_size) - len(state.pages)
        try:
            state.pages.extend(self.allocator.allocate(needed) if needed > 0 else ())
        except OutOfPages:
            return False
        return True

    def _catch_up(self, request) -> ExtendChunk:
        """The request's tokens the draft cache lacks (at least its last one, whose logits
        give the first draft); afterwards the cache holds all of them."""
        state, tokens = self.states[request.id], request.tokens
        start = min(state.cached, len(tokens) - 1)
        state.cached = len(tokens)
        return ExtendChunk(tuple(tokens[start:]), start, tuple(state.pages), True)
