"""The engine loop, as nano-vllm's ``LLMEngine.step``: schedule, launch, then postprocess
the step before, over two records (``step_records``): the batch the scheduler decided and
what the runner produced.

With ``overlap``, a decode or extend batch is launched and left in flight; the next step
is launched before the first one's tokens are read, so the host's scheduling and metadata
work hides behind the GPU: the decode rows of the same requests (``step_chain``), or,
while prompts wait or are part-way computed, the next extend batch. Rows whose inputs are
tokens the host has not read take them on the device from the token column
(``token_column``); the host counts those tokens (``Request.num_unread``) but never holds
a stand-in for them. A request that stops on a token is found one step late: the extra
row's token is dropped, and the chain goes on without its row. Waiting requests join
every few steps (``admit_every``). Rows whose sampling reads the tokens generated so far
(penalties, ``min_tokens``) are not chained.

Under a chained decode step, the step before it is read at the start of the next ``step``
(``unread``), just before the next launch: what the caller does between two calls (a
server publishes every stream's tokens and admits arrivals) runs while the GPU has two
steps queued, and only the next launch is left between one step's end on the GPU and the
next one's start (reading each step at once would leave a served engine's GPU waiting
for its host 0.16-0.22 ms of a decode step on average, and about 1.2 ms of an extend:
docs/PERFORMANCE.md). The step read late may be an extend, so a request's first token
comes a decode step later.

A step with constrained rows (``structured_outputs``, ``allowed_token_ids``, ``logit_bias``:
``constrained_steps``) is launched in two stages: its forward, chained like any other, and
left in flight with the step before unread; at the next call, once that step is read and
its tokens have advanced the rows' grammars, the step after is prepared on the host, the
draw enqueued under the masks, and at once the step after. So what the caller does
between calls runs while the device has a forward queued, and the next step's host work
and the masks are done while that forward runs.

The engine is not thread-safe: its owner (``ts.LLM``, the server's loop) serialises calls.
"""

import functools
import time
from collections.abc import Callable

import torch

from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.errors import InternalError
from tokenspeed.execution.outputs import TokenLogprobs
from tokenspeed.scheduling.prompt_limits import PromptLimits, output_limit
from tokenspeed.scheduling.request import Request, RequestStatus
from tokenspeed.execution.sample_streams import stream_key
from tokenspeed.execution.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from tokenspeed.scheduling.scheduler import Scheduler
from tokenspeed.engine.speculative import DraftBackoff
from tokenspeed.engine.constrained_steps import ConstrainedSteps
from tokenspeed.engine.speculative_steps import SpeculativeSteps
from tokenspeed.engine.step_chain import ChainedSteps
from tokenspeed.scheduling.step_records import AwaitingMasks, InFlight, RunnerOutput, ScheduledBatch
from tokenspeed.execution.token_column import FedRows

ADMIT_EVERY_STEPS = 4


class Engine(ChainedSteps, SpeculativeSteps, ConstrainedSteps):
    def __init__(self, scheduler: Scheduler, *, prefill, decode, model_config, max_model_len: int,
                 overlap: bool = True, seed: int = 0, verify=None, drafter=None,
                 verify_cost: float = 1.0, admit_every: int = ADMIT_EVERY_STEPS, grammars=None,
                 states=None):
        """``prefill``: a runner (``launch(chunks, sampling, fed) -> future``, or in two
        stages: ``forward``, then ``draw(forward, masks)``); ``decode``: one whose steps the
        engine prepares on the host (``prepare(rows, sampling, fed)``), then enqueues
        (``enqueue(prepared) -> forward``) and draws (``draw(forward, masks) -> future``);
        ``model_config``: the model's (its ``eos_token_ids`` and ``vocab_size``); ``seed``
        draws the noise seeds of requests that bring none; ``verify``: the runner of
        speculative windows, with ``drafter`` the one that proposes them
        (``speculative.PerRequestDrafts``' methods); ``verify_cost``: a verify step's cost
        in chained plain steps (``_verify_pays``);
        ``admit_every``: while a decode chain runs, requests wait up to this many steps to
        join (``_admits_now``); ``grammars``: compiles ``structured_outputs`` against the
        model's vocabulary (``engine.grammars.Grammars``; None: no tokenizer, refused);
        ``states``: a recurrent model's state pools (``StatePools``), where the scheduler's
        state checkpoints are copied to and from."""
        if (verify is None) != (drafter is None):
            raise InternalError("speculative decoding needs both a verify runner and its drafter, "
                                f"got verify={verify!r}, drafter={drafter!r}")
        if scheduler.checkpoints is not None and states is None:
            raise InternalError("the scheduler keeps state checkpoints, and the engine has no state pools")
        self.scheduler, self.prefill, self.decode, self.states = scheduler, prefill, decode, states
        self.verify, self.drafter, self.verify_cost = verify, drafter, verify_cost
        self.backoff = DraftBackoff()
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
        self.grammars = grammars
        self._num_constrained = 0    # unfinished requests with a constraint: none, no mask work
        self._mask_filler = self._mask_buffers = None   # made at the first constrained step
        self._preparer = None        # the thread for host work beside a long fill (``_drawn_beside``)

    @property
    def limits(self) -> PromptLimits:
        scheduler = self.scheduler   # a step's chunk of one request: at most max_chunk_tokens of the budget
        return PromptLimits(self.vocab_size, self.max_model_len, scheduler.page_size,
                            scheduler.allocator.num_pages - 1, scheduler.retentions,
                            min(scheduler.max_chunk_tokens, scheduler.max_num_batched_tokens),
                            tuple(self.eos_token_ids))

    def add(self, prompt: tuple[int, ...], params: SamplingParams) -> list[Request]:
        """Queue ``params.n`` samples of a checked prompt; the later ones share its pages.
        Each sample's noise stream comes from the seed and its index (``stream_key``). The
        samples are made (their sampling settings converted) before any is queued: a value
        that cannot be sampled, a grammar that does not compile or a token id outside the
        vocabulary refuses the request and leaves the engine as it was."""
        seed = params.seed if params.seed is not None else \
            int(torch.randint(INT64_MIN, INT64_MAX, (1,), generator=self.seeds))
        eos = () if params.ignore_eos else self.eos_token_ids
        stop_ids = tuple(dict.fromkeys(eos + params.stop_token_ids))
        max_output = min(output_limit(self.limits, "prompt", len(prompt), params),
                         self.max_model_len - len(prompt))
        requests = []
        for index, constraint in enumerate(self._constraints(params)):
            requests.append(Request(self._next_id + index, prompt, params, stream_key(seed, index), index,
                                    requests[0] if requests else None, stop_ids, max_output=max_output,
                                    constraint=constraint))
        self._next_id += params.n
        self._num_constrained += sum(r.constraint is not None for r in requests)
        for request in requests:
            self.scheduler.add(request)
        return requests

    def finish(self, request: Request, reason: str, stop_token: int | None = None) -> None:
        """End ``request`` now (a stop string, an abort; ``stop_token``: the end-of-sequence
        or stop token it sampled last): its pages and seat return at once; a token of it
        still unread is dropped."""
        if request.finished:
            return
        request.finish_reason, request.stop_token = reason, stop_token
        request.status, request.num_unread = RequestStatus.FINISHED, 0
        request.stats.finish_time = time.time()
        self.num_finished += 1
        if request.constraint is not None:
            self._num_constrained -= 1
            request.constraint.release()
        self.scheduler.finish(request)
        self.backoff.release(request.id)
        if self.drafter is not None:
            self.drafter.release(request)

    def abort_all(self) -> None:
        """After a failed step: nothing of it may leak into the next one."""
        self.in_flight, self.unread, self._chained = None, None, 0
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.finish(request, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or self.unread is not None

    def step(self) -> list[Request]:
        """Postprocess the step left unread; schedule and launch the next step (chained onto
        the one in flight where it can be) and postprocess the one before it, unless the
        new step is a chained decode step (then that one is read at the next call). Returns
        the requests that finished in what was read."""
        flight, self.unread = self.unread, None
        finished = self._postprocess(flight) if flight is not None else []
        last = self.in_flight
        if last is not None and last.awaits_masks and all(r.finished for r in last.sampled):
            last = self.in_flight = None   # its requests all finished in the step read: never drawn
        if last is not None:
            return finished + self._follow(last)
        return finished + self._fresh_step() if self.scheduler.has_work else finished

    def _follow(self, last: InFlight) -> list[Request]:
        """Launch the step chained onto ``last`` if one can be; postprocess ``last`` now
        unless that step is a chained decode step. A ``last`` awaiting its masks (its
        tokens' step just read) is drawn between the new step's host work (done beside its
        masks' fill where that is long: ``_drawn_beside``) and its enqueue: that work runs
        while the device runs ``last``'s forward, and only the enqueue is left between the
        draw and the next forward."""
        self.in_flight = None
        batch = self._chained_batch(last)
        if batch is None:
            return self._postprocess(self._drawn(last))
        enqueue, last = self._drawn_beside(last, functools.partial(self._prepare_launch, batch, last))
        self.in_flight = enqueue()
        if batch.kind == "decode" or self.in_flight.awaits_masks:
            self.unread = last
            return []
        return self._postprocess(last)

    def _fresh_step(self) -> list[Request]:
        """With nothing in flight: schedule a batch and launch it, left in flight with
        overlap, else postprocessed at once (a verify step always is)."""
        batch = self.scheduler.schedule()
        if not batch.requests:  # validation guarantees a lone request fits: never spin
            raise InternalError(f"no batch could be scheduled for {len(self.scheduler.waiting)} waiting "
                                f"requests ({self.scheduler.allocator.num_free} free KV pages)")
        drafts = self._drafts(batch) if self.drafter is not None else None
        if drafts and any(drafts) and self._verify_pays(batch.requests, list(map(len, drafts))):
            return self._verify(batch.requests, drafts)
        flight = self._drawn(self._launch(batch))   # the masks are filled while its forward runs
        if self.overlap and flight.sampled:   # the next step may chain onto it
            self.in_flight = flight
            return []
        return self._postprocess(flight)

    def _launch(self, batch: ScheduledBatch, last: InFlight | None = None) -> InFlight:
        """Launch ``batch`` (``last``: the step it is chained onto); its rows' inputs count as
        cached and its sampled rows' tokens as unread from now on."""
        if batch.kind == "decode":
            return self._prepare_launch(batch, last)()
        sampled = tuple(r for r, n in zip(batch.requests, batch.chunk_lens) if r.num_cached + n == r.num_tokens)
        chunks, fed = self._chunks(batch)
        if self.scheduler.checkpoints is not None:   # resumed states reach the seats first
            self.states.copy_slots(self.scheduler.checkpoints.restores(batch.requests))
        sampling = [r.sampling for r in sampled]
        future = AwaitingMasks(self.prefill.forward(chunks, sampling, fed)) if self._constrained(sampled) \
            else self.prefill.launch(chunks, sampling, fed)
        for request, n in zip(batch.requests, batch.chunk_lens):
            request.count_cached(n)
            self.scheduler.remember_full_pages(request)
        for request in sampled:
            request.num_unread += 1
        self._keep_marks(batch.requests)
        return InFlight(batch, sampled, future)

    def _prepare_launch(self, batch: ScheduledBatch, last: InFlight | None = None) -> Callable[[], InFlight]:
        """``batch``'s launch (``last``: the step it is chained onto) in two parts: the host's
        work now (a decode step's rows, from its requests or moved on from ``last``'s, and
        its metadata and settings: ``DecodeRunner.prepare``), and the rest returned, to be
        called once the device may take the step."""
        if batch.kind != "decode":
            return lambda: self._launch(batch, last)
        requests = batch.requests
        if batch.columns is None:
            fed, rows = None, _decode_rows(requests)
        else:
            fed = last.fed if last.fed is not None and len(last.fed.rows) == len(requests) else \
                FedRows(tuple(range(len(requests))), tuple(r.seat for r in requests))
            rows = batch.columns
        inputs = self.decode.prepare(rows, [r.sampling for r in requests], fed)
        return lambda: self._enqueue_decode(batch, inputs, fed)

    def _enqueue_decode(self, batch: ScheduledBatch, inputs, fed: FedRows | None) -> InFlight:
        """A prepared decode step (``inputs``: the runner's) enqueued: its forward, then its
        draw unless a row awaits its mask; its rows' inputs count as cached and their tokens
        as unread from now on."""
        requests, forward = batch.requests, self.decode.enqueue(inputs)
        future = AwaitingMasks(forward) if self._constrained(requests) else self.decode.draw(forward)
        remember = self.scheduler.remember_full_pages if self.scheduler.prefix_caching else None
        for request in requests:
            request.num_cached += 1
            request.num_unread += 1
            if remember is not None:
                remember(request)
        self._keep_marks(requests)
        return InFlight(batch, requests, future, fed)

    def _keep_marks(self, requests) -> None:
        """After a launch: the states of rows that reached a page boundary, copied to their
        requests' marks (``state_checkpoints``) before the next launch can move them on."""
        if self.scheduler.checkpoints is not None:
            self.states.copy_slots(self.scheduler.checkpoints.marks(requests, self.scheduler.page_size))

    def _chunks(self, batch: ScheduledBatch) -> tuple[list[ExtendChunk], FedRows | None]:
        """The batch's chunks; a chunk reaching a token the host has not read ends in a fed
        row (``ExtendChunk.fed``), whose input the column holds at its request's seat."""
        chunks, rows, seats, row = [], [], [], 0
        for request, n in zip(batch.requests, batch.chunk_lens):
            start, known = request.num_cached, request.num_known_tokens
            end = start + n
            pages, group_pages = request.row_pages()
            chunks.append(ExtendChunk(request.tokens_between(start, min(end, known)), start, pages,
                                      end == request.num_tokens, group_pages, fed=end > known, seat=request.seat))
            row += n
            if end > known:
                rows.append(row - 1)
                seats.append(request.seat)
        return chunks, FedRows(tuple(rows), tuple(seats)) if rows else None

    def _postprocess(self, flight: InFlight) -> list[Request]:
        """Read a launched step's tokens into its requests; the finished ones."""
        output, finished = RunnerOutput.read(flight.future), []
        for request, token, logprobs in zip(flight.sampled, output.tokens, output.logprobs):
            if request.finished:   # it stopped a step earlier: drop the row
                continue
            request.num_unread -= 1
            if self._append(request, token, logprobs):
                finished.append(request)
        return finished

    def _append(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> bool:
        """Add a sampled token the host has read (a page whose tokens it completes is
        remembered now: ``remember_full_pages``); True when it ends the request."""
        request.output.append(token)
        completes = request.constraint is not None and self._accept(request, token)
        if request.finished:   # its constraint took no token: ended, with its error
            return True
        scheduler = self.scheduler   # (every row of every step: the common case first)
        if scheduler.prefix_caching and request.num_cached // scheduler.page_size > request.num_pages_remembered:
            scheduler.remember_full_pages(request)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        if request.stats.first_token_time is None:
            request.stats.first_token_time = time.time()
        if token in request.stop_ids and len(request.output) >= request.params.min_tokens:
            self.finish(request, "stop", stop_token=token)
            return True
        if completes or len(request.output) >= request.max_output:   # a complete grammar stops
            self.finish(request, "stop" if completes else "length")
            return True
        return False


def _decode_rows(requests) -> list[DecodeRow]:
    """Each request's next decode row: its last token at the position after its cache."""
    return [DecodeRow(r.last_token, r.num_tokens - 1, *r.row_pages(), seat=r.seat) for r in requests]
