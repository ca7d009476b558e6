"""The engine loop: schedule a batch, run it (the runner samples), advance requests."""

from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.runtime.request import Request
from tokenspeed.runtime.scheduler import ScheduledBatch, Scheduler


class Engine:
    def __init__(self, scheduler: Scheduler, prefill, decode, eos_token_ids=(), max_model_len=0):
        self.scheduler, self.prefill, self.decode = scheduler, prefill, decode
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        sampled = [r for r, n in zip(batch.requests, batch.chunk_lens) if r.num_cached + n == r.num_tokens]
        tokens = self._forward(batch, [r.params for r in sampled])
        for request, n in zip(batch.requests, batch.chunk_lens):
            request.num_cached += n
        return [r for r, t in zip(sampled, tokens) if self._append(r, t)]

    def _forward(self, batch: ScheduledBatch, params) -> list[int]:
        if batch.kind == "decode":
            rows = [DecodeRow(r.tokens[-1], r.num_tokens - 1, tuple(r.pages)) for r in batch.requests]
            return self.decode.run(rows, params)
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
        if request.finish_reason:
            self.scheduler.finish(request)
        return request.finish_reason is not None
