"""The engine's speculative path: a decode batch whose drafts are expected to pay for a
verify step verifies one window per request (module ``speculative``) instead of decoding.

A verify step is read at once (no overlap): its windows' tokens decide what each request
keeps, and the next step starts from them on the host. Drafts are proposed from the tokens
the host has read (``Request.token_array``); the back-off that spares a request whose
drafts keep failing is the drafter side's (``DraftBackoff``, per request id).
"""

from tokenspeed.scheduling.request import Request
from tokenspeed.engine.speculative import expected_kept_drafts, window_rows
from tokenspeed.scheduling.step_records import RunnerOutput, ScheduledBatch


class SpeculativeSteps:
    """Mixed into ``Engine``: reads its ``drafter``, ``verify``, ``verify_cost``, ``backoff``
    and ``scheduler``, appends tokens through its ``_append`` (which feeds a constrained
    request's matcher the tokens it keeps: the drafts it rejects never reach it) and masks
    windows through ``ConstrainedSteps``."""

    def _drafts(self, batch: ScheduledBatch) -> list[tuple[int, ...]] | None:
        """Each decode row's drafts (none where the request's sampling reads its history or
        it backs off; a constrained request's, as far as its grammar takes them)."""
        if batch.kind != "decode":
            return None
        limits = [self._draft_limit(r) for r in batch.requests]
        drafts = self._valid_drafts(batch.requests, self.drafter.propose_many(batch.requests, limits))
        for request, limit, draft in zip(batch.requests, limits, drafts):
            if not draft and limit > 0:
                self.backoff.note(request.id, False, request.num_known_tokens)
        return drafts

    def _would_draft(self, request: Request) -> int:
        """How many drafts ``request`` would verify now (for a chain to break); finding
        none counts towards its back-off, as in ``_drafts``."""
        limit = self._draft_limit(request)
        drafts = self.drafter.would_propose(request, limit) if limit > 0 else 0
        if limit > 0 and not drafts:
            self.backoff.note(request.id, False, request.num_known_tokens)
        return drafts

    def _verify_pays(self, requests, num_drafts: list[int]) -> bool:
        """Whether a verify step beats plain steps: it costs ``verify_cost`` chained plain
        steps (no overlap, wider rows) for the whole batch, and gains, per request with
        drafts, those its windows kept on average. Text that rarely repeats in a large
        batch decodes plainly, and repetitive text verifies."""
        if not any(num_drafts):
            return False
        gain = sum(expected_kept_drafts(r.stats, n) for r, n in zip(requests, num_drafts) if n)
        return gain >= (self.verify_cost - 1) * len(requests)

    def _draft_limit(self, request: Request) -> int:
        """How many drafts ``request`` may verify now: its tokens and context left, less the
        window's own sample; 0 while its sampling reads its history or it backs off."""
        if request.sampling.reads_history or request.num_known_tokens < self.backoff.drafts_from(request.id):
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
            pages, group_pages = request.row_pages()
            rows += window_rows(request.last_token, request.num_tokens, pages, draft, group_pages)
            sampling += [request.sampling] * (1 + len(draft))
            windows.append(draft)
        masks = self._step_masks(requests, windows)
        output, finished, row = RunnerOutput.read(self.verify.launch(rows, sampling, masks=masks)), [], 0
        for request, draft in zip(requests, windows):
            width = 1 + len(draft)
            kept = self._keep(request, draft, output.tokens[row:row + width], output.logprobs[row:row + width])
            request.stats.record_verify(kept, len(draft))
            if draft and not request.finished:
                self.backoff.note(request.id, kept > 1, request.num_known_tokens)
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
