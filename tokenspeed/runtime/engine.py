"""The engine loop: schedule a batch, run it (the runner samples), advance requests.

With ``overlap``, a decode or extend batch is launched and left in flight; the next step
is launched before the first one's tokens are read, so the host's scheduling and metadata
work hides behind the GPU: the decode rows of the same requests, or, while prompts wait or
are part-way computed, the next extend batch, whose rows for those requests take their
input tokens on the device (the host holds a stand-in, ``PENDING``, in their outputs until
the step in flight is read, within the same ``step``). A request that stops on a token is
found one step late: the extra row's token is dropped, and the chain goes on without its
row. Waiting requests join every few steps (``admit_every``). Rows whose sampling reads
the tokens generated so far (penalties, ``min_tokens``) are not chained.

Under a chained decode step, the step before it is read at the start of the next ``step``
(``unread``), just before the next launch: what the caller does between two calls (a
server publishes every stream's tokens and admits arrivals) runs while the GPU has two
steps queued, and only the next launch is left between one step's end on the GPU and the
next one's start (reading each step at once would leave a served engine's GPU waiting
for its host 0.16-0.22 ms of a decode step on average, and about 1.2 ms of an extend:
docs/PERFORMANCE.md). The step read late may be an extend, so a request's first token
comes a decode step later.

The engine is not thread-safe: its owner (``ts.LLM``, the server's loop) serialises calls.
"""

import time

import attrs
import torch

from tokenspeed.backends.metadata import DecodeColumns, DecodeRow, ExtendChunk
from tokenspeed.runtime.decode_chain import next_columns
from tokenspeed.runtime.outputs import TokenLogprobs
from tokenspeed.runtime.prompt_limits import PromptLimits
from tokenspeed.runtime.request import Request, RequestStatus
from tokenspeed.runtime.sample_streams import stream_key
from tokenspeed.runtime.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from tokenspeed.runtime.scheduler import ScheduledBatch, Scheduler
from tokenspeed.runtime.speculative import window_rows
from tokenspeed.runtime.step_future import FedTokens

ADMIT_EVERY_STEPS = 4
PENDING = 0     # a chained extend's host-side input for a token its device feeds (module doc)


@attrs.frozen
class InFlight:
    """A launched step whose tokens the host has not read. ``counted``: its rows' input
    tokens are counted as cached (an extend counts its chunks when launched; a decode
    step's rows are counted when the next step is prepared: ``_settled``). A chained
    decode step keeps its rows' ``columns``: the next one in the chain moves them on."""
    requests: tuple[Request, ...]
    future: object
    counted: bool = False
    columns: DecodeColumns | None = None   # a chained decode step's rows (``decode_chain``)


class Engine:
    def __init__(self, scheduler: Scheduler, *, prefill, decode, model_config, max_model_len: int,
                 overlap: bool = True, seed: int = 0, verify=None, drafter=None,
                 verify_cost: float = 1.0, admit_every: int = ADMIT_EVERY_STEPS):
        """``prefill`` and ``decode``: runners (``launch(chunks | rows, sampling) -> future``);
        ``model_config``: the model's (its ``eos_token_ids`` and ``vocab_size``);
        ``seed`` draws the noise seeds of requests that bring none; ``verify``: the runner
        of speculative windows, with ``drafter`` the one that proposes them
        (``speculative.PerRequestDrafts``' methods); ``verify_cost``: a verify step's cost
        in chained plain steps (``_verify_pays``);
        ``admit_every``: while a decode chain runs, requests wait up to this many steps to
        join (``_admits_now``)."""
        if (verify is None) != (drafter is None):
            raise ValueError("speculative decoding needs both a verify runner and its drafter")
        self.scheduler, self.prefill, self.decode = scheduler, prefill, decode
        self.verify, self.drafter, self.verify_cost = verify, drafter, verify_cost
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.overlap, self.admit_every = overlap, admit_every
        self._chained = 0            # steps chained since the chain last broke
        self.in_flight: InFlight | None = None   # launched last
        self.unread: InFlight | None = None      # launched before it, its tokens not yet read
        self.seeds = torch.Generator().manual_seed(seed)
        self._next_id = 0
        self.num_finished = 0        # requests finished so far: callers rescan theirs when it moves

    @property
    def limits(self) -> PromptLimits:
        scheduler = self.scheduler
        return PromptLimits(self.vocab_size, self.max_model_len, scheduler.page_size,
                            scheduler.allocator.num_pages - 1, scheduler.retentions,
                            scheduler.max_num_batched_tokens)

    def add(self, prompt: tuple[int, ...], params: SamplingParams) -> list[Request]:
        """Queue ``params.n`` samples of a checked prompt; the later ones share its pages.
        Each sample's noise stream comes from the seed and its index (``stream_key``). The
        samples are made (their sampling settings converted) before any is queued: a value
        that cannot be sampled refuses the request and leaves the engine as it was."""
        seed = params.seed if params.seed is not None else \
            int(torch.randint(INT64_MIN, INT64_MAX, (1,), generator=self.seeds))
        eos = () if params.ignore_eos else self.eos_token_ids
        stop_ids = tuple(dict.fromkeys(eos + params.stop_token_ids))
        max_output = min(params.max_tokens, self.max_model_len - len(prompt))
        requests = []
        for index in range(params.n):
            requests.append(Request(self._next_id + index, prompt, params, stream_key(seed, index), index,
                                    requests[0] if requests else None, stop_ids, max_output=max_output))
        self._next_id += params.n
        for request in requests:
            self.scheduler.add(request)
        return requests

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        """End ``request`` now (a stop string, an abort): its pages return at once; a
        token of it still in flight is dropped."""
        if request.finished:
            return
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.status = RequestStatus.FINISHED
        request.finish_time = time.time()
        self.num_finished += 1
        self.scheduler.finish(request)
        if self.drafter is not None:
            self.drafter.release(request)

    def abort_all(self) -> None:
        """After a failed step: nothing of it may leak into the next one."""
        self.in_flight, self.unread, self._chained = None, None, 0
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if request.pending:         # its step failed before the token was read
                _forget_pending([request])
            self.finish(request, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or self.unread is not None

    def step(self) -> list[Request]:
        """Read the step left unread, then launch or run one batch; returns the requests
        that finished in what was read."""
        flight, self.unread = self.unread, None
        finished = self._collect(flight) if flight is not None else []
        if self.in_flight is None:
            return finished + self._schedule_step() if self.scheduler.has_work else finished
        flight, self.in_flight = self._settled(self.in_flight), None
        self.in_flight = self._chain(flight)
        if self.in_flight is not None and self.in_flight.columns is not None:
            self.unread = flight       # a chained decode step: no stand-in waits for it
            return finished
        return finished + self._collect(flight)

    def _schedule_step(self) -> list[Request]:
        """With nothing in flight: schedule a batch and launch it (or run it, and return
        the requests it finished)."""
        batch = self.scheduler.schedule()
        drafts = self._drafts(batch) if self.drafter is not None else None
        if drafts and any(drafts) and self._verify_pays(batch.requests, list(map(len, drafts))):
            return self._verify(batch.requests, drafts)
        if batch.kind == "decode" and batch.requests and self.overlap:
            self.in_flight = InFlight(batch.requests, self.decode.launch(
                _decode_rows(batch.requests), [r.sampling for r in batch.requests]))
            return []
        if not batch.requests:  # validation guarantees a lone request fits: never spin
            raise RuntimeError(f"no batch could be scheduled for {len(self.scheduler.waiting)} waiting "
                               f"requests ({self.scheduler.allocator.num_free} free KV pages)")
        flight = self._extend(batch)
        if self.overlap and flight.requests:   # the next step may chain onto it
            self.in_flight = flight
            return []
        return self._collect(flight)

    def _extend(self, batch: ScheduledBatch, fed: FedTokens | None = None) -> InFlight:
        """Launch an extend batch and count its chunks as cached; in flight: its sampled rows."""
        sampled = [r for r, n in zip(batch.requests, batch.chunk_lens) if r.num_cached + n == r.num_tokens]
        future = self._launch(batch, sampled, fed)
        for request, n in zip(batch.requests, batch.chunk_lens):
            request.count_cached(n)
            self.scheduler.remember_full_pages(request)
        return InFlight(tuple(sampled), future, counted=True)

    def _settled(self, flight: InFlight) -> InFlight:
        """``flight`` with its decode rows' input tokens counted as cached: every step
        launched from now on runs after it."""
        if flight.counted:
            return flight
        remember = self.scheduler.remember_full_pages if self.scheduler.prefix_caching else None
        for request in flight.requests:   # every row of every step: nothing more than needed
            if not request.finished:
                request.num_cached += 1
                if remember is not None:
                    remember(request)
        return InFlight(flight.requests, flight.future, True, flight.columns)

    def _chain(self, flight: InFlight) -> InFlight | None:
        """Launch the rows of the requests still running once more, or, when prompt work is
        due (a waiting request should join, or a prompt is part-way computed), the next
        extend batch; None when something needs the host between steps."""
        live = [r for r in flight.requests if not r.finished]
        if not live or not any(self._wants_another(r) for r in live) or \
                (flight.columns is None and any(r.sampling.reads_history for r in live)) or \
                (self.drafter is not None and
                 self._verify_pays(live, [self._would_draft(r) for r in live])):
            self._chained = 0
            return None
        if self._admits_now() or len(self.scheduler.running) != len(live):
            self._chained = 0
            return self._chain_extend(flight, live) if self.drafter is None else None
        kept = None if len(live) == len(flight.requests) else \
            [i for i, r in enumerate(flight.requests) if not r.finished]
        columns = self._chained_columns(flight, live, kept)
        if columns is None:
            self._chained = 0
            return None
        self._chained += 1
        future = self.decode.launch(columns, [r.sampling for r in live], flight.future.on_device(kept))
        return InFlight(tuple(live), future, columns=columns)

    def _chained_columns(self, flight: InFlight, live: list[Request], kept) -> DecodeColumns | None:
        """The chained step's rows (their input tokens fed on the device): the flight's
        moved on a position, or, chained on an extend or an unchained decode step, built
        from each request's pages; None when a request finds no page for its row.
        (A chained step's rows never read their history: ``_chain`` checked at the first.)"""
        if flight.columns is not None:
            return next_columns(flight.columns, kept, live, self.scheduler)
        rows = []
        for request in live:
            position = request.num_tokens
            if not self.scheduler.grow(request, position + 1):
                return None
            rows.append(DecodeRow(0, position, tuple(request.pages), request.group_page_tuples()))
        return self.decode.columns(rows)

    def _chain_extend(self, flight: InFlight, live: list[Request]) -> InFlight | None:
        """The next extend batch, scheduled as if the flight's tokens were known: each live
        request that wants another token holds ``PENDING`` in their place, and its row, if
        the batch has one, takes the token on the device. None when there is no prompt
        work after all (the stand-ins go)."""
        pending = [r for r in live if self._wants_another(r)]
        for request in pending:
            request.output.append(PENDING)
            request.pending = True
        try:
            batch = self.scheduler.schedule_extend()
            if batch.requests:
                return self._extend(batch, _fed(flight, batch))
        except BaseException:
            _forget_pending(pending)
            raise
        _forget_pending(pending)
        return None

    def _admits_now(self) -> bool:
        """Whether a waiting request joins now, ending the decode chain: when a seat is
        free, and at most every ``admit_every`` chained steps. A join is an extend step (about
        twice a decode step of as many rows, for the default model on an H200), and under a
        steady stream of arrivals (a server) joining each at once made most steps one."""
        return self.scheduler.has_free_seat and self._chained >= self.admit_every

    def _drafts(self, batch: ScheduledBatch) -> list[tuple[int, ...]] | None:
        """Each decode row's drafts (none where the request's sampling reads its history or
        it backs off)."""
        if batch.kind != "decode":
            return None
        limits = [self._draft_limit(r) for r in batch.requests]
        drafts = self.drafter.propose_many(batch.requests, limits)
        for request, limit, draft in zip(batch.requests, limits, drafts):
            if not draft and limit > 0:
                request.note_drafts(False)
        return drafts

    def _would_draft(self, request: Request) -> int:
        """How many drafts ``request`` would verify now (for a chain to break); finding
        none counts towards its back-off, as in ``_drafts``."""
        limit = self._draft_limit(request)
        drafts = self.drafter.would_propose(request, limit) if limit > 0 else 0
        if limit > 0 and not drafts:
            request.note_drafts(False)
        return drafts

    def _verify_pays(self, requests, num_drafts: list[int]) -> bool:
        """Whether a verify step beats plain steps: it costs ``verify_cost`` chained plain
        steps (no overlap, wider rows) for the whole batch, and gains, per request with
        drafts, those its windows kept on average. Text that rarely repeats in a large
        batch decodes plainly, and repetitive text verifies."""
        if not any(num_drafts):
            return False
        gain = sum(r.expected_kept_drafts(n) for r, n in zip(requests, num_drafts) if n)
        return gain >= (self.verify_cost - 1) * len(requests)

    def _draft_limit(self, request: Request) -> int:
        """How many drafts ``request`` may verify now: its tokens and context left, less the
        window's own sample; 0 while its sampling reads its history or it backs off."""
        if request.sampling.reads_history or request.num_tokens < request.drafts_from:
            return 0
        room = request.max_output - len(request.output)
        return max(room - 1, 0)

    def _verify(self, requests, drafts) -> list[Request]:
        """One window per request, its last token then its drafts; each request keeps the
        samples while every draft equals the sample before it (module ``speculative``)."""
        rows, sampling, windows = [], [], []
        for request, draft in zip(requests, drafts):
            if not self.scheduler.grow(request, request.num_tokens + len(draft)):
                draft = ()                   # no pages for the drafts: a plain row
            rows += window_rows(request.last_token, request.num_tokens, tuple(request.pages), draft,
                                request.group_page_tuples())
            sampling += [request.sampling] * (1 + len(draft))
            windows.append(draft)
        future = self.verify.launch(rows, sampling)
        tokens, logprobs, finished, row = future.tokens(), future.logprobs(), [], 0
        for request, draft in zip(requests, windows):
            width = 1 + len(draft)
            kept = self._keep(request, draft, tokens[row:row + width], logprobs[row:row + width])
            request.record_verify(kept, len(draft))
            if request.finished:
                finished.append(request)
            row += width
        return finished

    def _keep(self, request: Request, draft, tokens, logprobs) -> int:
        """Append the window's samples while the drafts match them; how many were kept."""
        for j, (token, lp) in enumerate(zip(tokens, logprobs)):
            request.num_cached += 1        # row j's input is now a token of the request
            self.scheduler.remember_full_pages(request)
            if self._append(request, token, lp) or j == len(tokens) - 1 or draft[j] != token:
                return j + 1
        return len(tokens)

    def _wants_another(self, request: Request) -> bool:
        """Whether ``request`` can still need a token after the one in flight."""
        return len(request.output) + 1 < request.max_output

    def _collect(self, flight: InFlight) -> list[Request]:
        """Read a settled flight's tokens into its requests; the finished ones."""
        finished = []
        future = flight.future
        for request, token, logprobs in zip(flight.requests, future.tokens(), future.logprobs()):
            if not request.finished:  # else it stopped a step earlier: drop the row
                if self._append(request, token, logprobs):
                    finished.append(request)
        return finished

    def _launch(self, batch: ScheduledBatch, sampled: list[Request], fed: FedTokens | None = None):
        sampling = [r.sampling for r in sampled]
        if batch.kind == "decode":
            return self.decode.launch(_decode_rows(batch.requests), sampling)
        chunks = [ExtendChunk(r.tokens_between(r.num_cached, r.num_cached + n), r.num_cached, tuple(r.pages),
                              r.num_cached + n == r.num_tokens, r.group_page_tuples())
                  for r, n in zip(batch.requests, batch.chunk_lens)]
        return self.prefill.launch(chunks, sampling, fed)

    def _append(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> bool:
        """Add a sampled token (in its stand-in's place); True when it ends the request."""
        if request.pending:
            request.output[-1], request.pending = token, False
            self.scheduler.remember_full_pages(request)
        else:
            request.output.append(token)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.time()
        if token in request.stop_ids and len(request.output) >= request.params.min_tokens:
            self.finish(request, "stop", token if token in request.params.stop_token_ids else None)
            return True
        if len(request.output) >= request.max_output:
            self.finish(request, "length")
            return True
        return False


def _fed(flight: InFlight, batch: ScheduledBatch) -> FedTokens:
    """The token rows of ``batch`` whose inputs are ``flight``'s samples (its pending
    requests' rows, one token each), with those samples on the device."""
    flight_row = {id(r): i for i, r in enumerate(flight.requests)}
    rows, sources, row = [], [], 0
    for request, n in zip(batch.requests, batch.chunk_lens):
        if request.pending:
            rows.append(row)
            sources.append(flight_row[id(request)])
        row += n
    return FedTokens(tuple(rows), flight.future.on_device(sources))


def _forget_pending(requests) -> None:
    for request in requests:
        request.output.pop()
        request.pending = False


def _decode_rows(requests) -> list[DecodeRow]:
    """Each request's next decode row: its last token at the position after its cache."""
    return [DecodeRow(r.last_token, r.num_tokens - 1, tuple(r.pages), r.group_page_tuples()) for r in requests]
