"""The engine's constrained requests: their constraints made as they are added, their
masks computed for each step that samples them, and the two-stage decode launch that
keeps the overlap.

A step's masks need the tokens of the step before, which the overlapped loop reads only
after launching the next step. So a step with constrained rows is launched in two stages:
its forward (``DecodeRunner.prepare`` and ``enqueue``: the model and the unconstrained
draw, its inputs from the token column; ``PrefillRunner.forward``: the model) at once,
which leaves it ``AwaitingMasks`` in flight, the step before unread, across the caller's
work; at the engine's next call the host reads the step before, its tokens advance the
matchers, the next step's host work is done (its rows, metadata and settings staged:
``DecodeRunner.prepare``) and the masks are filled (llguidance's native code, without the
GIL; with eight constrained rows or more the two at once, the host work on a helper thread), all
while the device runs the forward; then the draw (masks copied to the device,
the constrained rows drawn, the column written, the tokens' copy to the host), and at once
the next step's enqueue, so the device is never left with only a draw queued for long. A
verify step, read at once, masks each window row by the grammar's state after the drafts
before it (drafts the grammar refuses are cut first).

Nothing here runs for a batch without a constrained request (``_num_constrained``).
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import attrs
import torch

from tokenspeed.errors import RefusedRequest
from tokenspeed.execution.step_masks import MaskBuffers, StepMasks
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.scheduling.constraint import Constraint
from tokenspeed.scheduling.prompt_limits import check_constraint
from tokenspeed.scheduling.step_records import InFlight
from tokenspeed.structured import MaskFiller

BESIDE_FILL_ROWS = 8
T = TypeVar("T")


def _in_mode(prepare: Callable[[], T], inference: bool) -> T:
    """``prepare()`` under the caller's inference mode (torch keeps it per thread)."""
    with torch.inference_mode(inference):
        return prepare()


def _wait_out(pending: Future) -> None:
    """Wait until ``pending`` is done, even through an interrupt (raised after): an engine
    used again at once must not meet its preparation still staging."""
    interrupt = None
    while not pending.done():
        try:
            wait([pending])
        except BaseException as exc:   # KeyboardInterrupt: its wait is cut short, not the helper
            interrupt = exc
    if interrupt is not None:
        raise interrupt


class ConstrainedSteps:
    """Mixed into ``Engine``: reads its ``grammars``, ``vocab_size``, ``eos_token_ids``,
    ``decode`` and ``_num_constrained`` (running constrained requests), and keeps its mask
    filler and the thread that prepares a step beside a fill."""

    def _constraints(self, params: SamplingParams) -> list[Constraint | None]:
        """The constraint of each of ``params.n`` samples (None: unconstrained); a grammar
        that does not compile, a token id outside the vocabulary or ``min_tokens`` that may
        leave nothing to sample is refused by field."""
        if not params.constrained:
            return [None] * params.n
        check_constraint(params, self.vocab_size, self.eos_token_ids)
        bias = params.token_bias
        matchers = [None] * params.n
        if params.structured_outputs is not None:
            matchers = self._grammars_for(params).matchers(params.structured_outputs, params.n)
        allowed = bias.allowed_words(self.vocab_size) if bias is not None else None
        kept_bias = bias if bias is not None and bias.logit_bias else None
        return [Constraint(m, allowed, kept_bias) for m in matchers]

    def _grammars_for(self, params: SamplingParams):
        if self.grammars is None:
            raise RefusedRequest("structured_outputs: this engine has no tokenizer, and a grammar is "
                                 "compiled against the model's vocabulary as its tokenizer spells it",
                                 field="structured_outputs", value=params.structured_outputs, limit=None)
        return self.grammars

    def _step_masks(self, requests, drafts=None) -> StepMasks | None:
        """The masks of a step's sampled rows, one row per request in order (with ``drafts``,
        a verify step's: each request's window, ``1 + len(drafts[i])`` rows); None when no
        row is constrained."""
        if not self._num_constrained:
            return None
        windows = [()] * len(requests) if drafts is None else [tuple(d) for d in drafts]
        rows, biases, row = [], [], 0
        for request, draft in zip(requests, windows):
            constraint = request.constraint
            if constraint is not None and not request.finished:
                rows += [constraint.mask_row(row, draft)] if constraint.masks else []
                biases += [(row + j, constraint.bias) for j in range(1 + len(draft))] if constraint.bias else []
            row += 1 + len(draft)
        if not rows and not biases:
            return None
        return StepMasks(self._filled(rows, row) if rows else None, tuple(biases))

    def _filled(self, rows, num_rows: int) -> torch.Tensor:
        """The host bitmask of a step of ``num_rows`` rows with ``rows`` masked (the filler and
        its buffers are made at the first constrained step: an engine that never sees one
        starts no mask threads)."""
        if self._mask_filler is None:
            self._mask_filler = MaskFiller()
            self._mask_buffers = MaskBuffers(self.vocab_size, pinned=torch.cuda.is_available())
        return self._mask_filler.fill(rows, self._mask_buffers.take(num_rows))

    def _constrained(self, requests) -> bool:
        return bool(self._num_constrained) and any(r.constraint is not None for r in requests)

    def _drawn(self, flight: InFlight) -> InFlight:
        """``flight`` with its draw enqueued if it awaits its rows' masks (every token of its
        requests read: their matchers are where the step samples)."""
        if not flight.awaits_masks:
            return flight
        runner = self.decode if flight.batch.kind == "decode" else self.prefill
        future = runner.draw(flight.future.forward, self._step_masks(flight.sampled))
        return attrs.evolve(flight, future=future)

    def _drawn_beside(self, flight: InFlight, prepare: Callable[[], T]) -> tuple[T, InFlight]:
        """``prepare()`` (the next step's host work) and ``flight`` drawn (``_drawn``). Where
        ``flight`` awaits the masks of ``BESIDE_FILL_ROWS`` constrained rows or more,
        ``prepare`` runs on a helper thread while this one fills them: llguidance fills
        without the GIL, so the helper's Python runs meanwhile instead of after (a
        constrained batch of 32 is bound by the host's one thread). Fewer rows fill in tens
        of microseconds, less than the hand-off."""
        masked = sum(r.constraint is not None and r.constraint.masks and not r.finished
                     for r in flight.sampled) if flight.awaits_masks else 0
        if masked < BESIDE_FILL_ROWS:
            return prepare(), self._drawn(flight)
        if self._preparer is None:
            self._preparer = ThreadPoolExecutor(1, thread_name_prefix="tokenspeed-prepare")
        pending = self._preparer.submit(_in_mode, prepare, torch.is_inference_mode_enabled())
        try:
            drawn = self._drawn(flight)
        finally:   # a failed draw raises once the helper has finished too
            _wait_out(pending)
        return pending.result(), drawn

    def _valid_drafts(self, requests, drafts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Each request's drafts, a constrained one's cut where its grammar stops taking them."""
        if not self._num_constrained:
            return drafts
        return [r.constraint.valid_drafts(d) if d and r.constraint is not None else d
                for r, d in zip(requests, drafts)]

    def _accept(self, request, token: int) -> bool:
        """Feed a read token to the request's constraint; True when its grammar is complete.
        A grammar that takes no token here ends this request alone, with its error."""
        constraint = request.constraint
        try:
            constraint.accept(token)
        except RefusedRequest as exc:
            request.error = str(exc)
            self.finish(request, "abort")
            return True
        return constraint.finished
