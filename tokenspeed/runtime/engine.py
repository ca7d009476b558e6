"""The engine loop: schedule a batch, run it (the runner samples), advance requests.

With ``overlap``, a decode batch is launched and left in flight; the next step launches
the same rows again (their input tokens fed on the device) before reading the first
one's tokens, so the host's scheduling and metadata work hides behind the GPU. A request
that stops on a token is found one step late: the extra row's token is dropped.
"""

import attrs
import torch

from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.runtime.outputs import RequestOutput
from tokenspeed.runtime.request import Request
from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.scheduler import ScheduledBatch, Scheduler


@attrs.frozen
class InFlight:
    requests: tuple[Request, ...]
    future: object


class Engine:
    def __init__(self, scheduler: Scheduler, prefill, decode, model_config, max_model_len: int,
                 overlap: bool = True):
        """``prefill`` and ``decode``: runners (``run(chunks | rows, params) -> tokens``)."""
        self.scheduler, self.prefill, self.decode = scheduler, prefill, decode
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.overlap = overlap
        self.in_flight: InFlight | None = None
        self._next_id = 0

    def request(self, index: int, prompt, params: SamplingParams) -> Request:
        """A validated request; raises naming prompt ``index`` before any work starts."""
        prompt = tuple(int(t) for t in prompt)
        where = f"prompt {index}"
        if not prompt:
            raise ValueError(f"{where} is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"{where}: {len(prompt)} prompt tokens + max_tokens={params.max_tokens} "
                             f"= {total} exceeds max_model_len={self.max_model_len}")
        pages, pool = -(-total // self.scheduler.page_size), self.scheduler.allocator.num_pages - 1
        if pages > pool:
            raise ValueError(f"{where}: needs {pages} KV pages, the pool has {pool}")
        self._next_id += 1
        return Request(self._next_id - 1, prompt, params)

    def run(self, requests: list[Request]) -> list[RequestOutput]:
        """Serve ``requests`` to completion; a failure drops every request and its pages."""
        for request in requests:
            self.scheduler.add(request)
        try:
            with torch.inference_mode():
                while self.has_work:
                    self.step()
        except BaseException:
            self.in_flight = None  # nothing of this call may leak into the next one
            self.scheduler.abort_all()
            raise
        return [r.to_output() for r in requests]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            self.in_flight = self._chain(flight)
            return self._collect(flight)
        batch = self.scheduler.schedule()
        if batch.kind == "decode" and batch.requests and self.overlap:
            future = self.decode.launch(_decode_rows(batch.requests),
                                        [r.params for r in batch.requests])
            self.in_flight = InFlight(batch.requests, future)
            return []
        if not batch.requests:  # validation guarantees a lone request fits: never spin
            raise RuntimeError(f"no batch could be scheduled for {len(self.scheduler.waiting)} waiting "
                               f"requests ({self.scheduler.allocator.num_free} free KV pages)")
        sampled = [r for r, n in zip(batch.requests, batch.chunk_lens) if r.num_cached + n == r.num_tokens]
        tokens = self._forward(batch, [r.params for r in sampled])
        for request, n in zip(batch.requests, batch.chunk_lens):
            request.num_cached += n
        return [r for r, t in zip(sampled, tokens) if self._append(r, t)]

    def _chain(self, flight: InFlight) -> InFlight | None:
        """Launch the same rows once more, if nothing else waits and pages allow."""
        requests, scheduler = flight.requests, self.scheduler
        if scheduler.waiting or len(scheduler.running) != len(requests) or \
                not any(self._wants_another(r) for r in requests):
            return None
        rows = []
        for request in requests:  # one pass over the rows: this is host time of every step
            position = request.num_tokens
            if not scheduler.grow(request, position + 1):
                return None
            rows.append(DecodeRow(0, position, tuple(request.pages)))
        return InFlight(requests, self.decode.launch(rows, [r.params for r in requests], chained=True))

    def _wants_another(self, request: Request) -> bool:
        """Whether ``request`` can still need a token after the one in flight."""
        return len(request.output) + 1 < request.params.max_tokens and \
            request.num_tokens + 1 < self.max_model_len

    def _collect(self, flight: InFlight) -> list[Request]:
        finished = []
        for request, token in zip(flight.requests, flight.future.tokens()):
            if request.finish_reason is None:  # else it stopped a step earlier: drop the row
                request.num_cached += 1
                if self._append(request, token):
                    finished.append(request)
        return finished

    def _forward(self, batch: ScheduledBatch, params) -> list[int]:
        if batch.kind == "decode":
            return self.decode.run(_decode_rows(batch.requests), params)
        chunks = [ExtendChunk(r.tokens[r.num_cached:r.num_cached + n], r.num_cached, tuple(r.pages),
                              r.num_cached + n == r.num_tokens)
                  for r, n in zip(batch.requests, batch.chunk_lens)]
        return self.prefill.run(chunks, params)

    def _append(self, request: Request, token: int) -> bool:
        request.output.append(token)
        p = request.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            request.finish_reason = "stop"
        elif len(request.output) >= p.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish_reason = "length"
        else:
            return False
        self.scheduler.finish(request)
        return True


def _decode_rows(requests) -> list[DecodeRow]:
    """Each request's next decode row: its last token at the position after its cache."""
    return [DecodeRow(r.last_token, r.num_tokens - 1, tuple(r.pages)) for r in requests]
