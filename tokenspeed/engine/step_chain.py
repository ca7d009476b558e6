"""The overlap's chaining: which step, if any, is launched onto the step in flight before
its tokens are read.

While the same requests decode, the next decode step of all of them, its rows moved on a
position (``decode_chain``) and their inputs fed from the token column; while prompt work
is due (a waiting request should join, or a prompt is part-way computed), the next extend
batch, scheduled with the in-flight tokens counted (``Request.num_unread``): the rows of
requests whose newest token is in flight are fed from the column the same way. No chain
where something needs the host between steps: rows whose sampling reads their history
(chained onto an extend or a plain decode step), or drafts worth a verify step. A step with
constrained rows chains in two stages (``constrained_steps``).
"""

from tokenspeed.backends.metadata import DecodeColumns, DecodeRow
from tokenspeed.engine.decode_chain import next_columns
from tokenspeed.scheduling.request import Request
from tokenspeed.scheduling.step_records import InFlight, ScheduledBatch


class ChainedSteps:
    """Mixed into ``Engine``: reads its ``scheduler``, ``decode``, ``drafter`` and
    ``admit_every``, and keeps its ``_chained`` count."""

    def _chained_batch(self, last: InFlight) -> ScheduledBatch | None:
        """The batch to launch onto ``last`` (in flight, unread): the decode rows of the
        requests still running once more, or the next extend batch; None when the chain
        breaks."""
        live = [r for r in last.sampled if not r.finished]
        if not self._may_chain(last, live):
            self._chained = 0
            return None
        if self._admits_now() or len(self.scheduler.running) != len(live):
            self._chained = 0
            batch = self.scheduler.schedule_extend()
            return batch if batch.requests else None
        columns = self._chained_columns(last, live)
        if columns is None:
            self._chained = 0
            return None
        self._chained += 1
        return ScheduledBatch("decode", tuple(live), (1,) * len(live), columns)

    def _may_chain(self, last: InFlight, live: list[Request]) -> bool:
        if not live or not any(self._wants_another(r) for r in live):
            return False
        if last.columns is None and any(r.sampling.reads_history for r in live):
            return False    # (a chained decode step's rows were checked at the first)
        return self.drafter is None or not self._verify_pays(live, [self._would_draft(r) for r in live])

    def _chained_columns(self, last: InFlight, live: list[Request]) -> DecodeColumns | None:
        """The chained step's rows: ``last``'s moved on a position, or, chained onto an
        extend or an unchained decode step, built from each request's pages; None when a
        request finds no page for its row."""
        if last.columns is not None:
            kept = None if len(live) == len(last.sampled) else \
                [i for i, r in enumerate(last.sampled) if not r.finished]
            return next_columns(last.columns, kept, live, self.scheduler)
        rows = []
        for request in live:
            if not self.scheduler.grow(request, request.num_tokens):
                return None
            rows.append(DecodeRow(None, request.num_tokens - 1, *request.row_pages(), seat=request.seat))
        return self.decode.columns(rows)

    def _admits_now(self) -> bool:
        """Whether a waiting request joins now, ending the decode chain: when a seat is
        free, and at most every ``admit_every`` chained steps. A join is an extend step (about
        twice a decode step of as many rows, for the default model on an H200), and under a
        steady stream of arrivals (a server) joining each at once made most steps one."""
        return self.scheduler.has_free_seat and self._chained >= self.admit_every

    def _wants_another(self, request: Request) -> bool:
        """Whether ``request`` can still need a token after those it has (read or not)."""
        return request.num_output_tokens < request.max_output
