"""One thread owns the engine and steps it; callers only enqueue and read updates.

A server's handlers call ``submit`` (from any thread or event loop) and receive each
completion's new text and tokens after every engine step through their ``on_update``
callback, all of a step's updates handed over at once (``deliver``: one wake-up of the
server's event loop per step, not one per request); requests from many callers join the
running batch between steps. ``abort`` (a client that went away) finishes a request
before the next step, returning its pages. Nothing a request does stops the loop: a step
that fails takes every request then in the engine with it (their pages return, each
caller gets the error) and the loop serves on.
"""

import queue
import threading

import attrs

from tokenspeed.entrypoints.prompts import Prompt
from tokenspeed.runtime.request import Request
from tokenspeed.runtime.sampling_params import SamplingParams

IDLE_WAIT_S = 0.5


@attrs.frozen
class CompletionDelta:
    """What one completion gained in a step."""
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple
    finish_reason: str | None
    stop_reason: str | int | None


@attrs.frozen
class GroupUpdate:
    """A prompt's completions after a step; ``finished`` once all are; ``error`` when a
    step failed and took the request with it."""
    deltas: tuple[CompletionDelta, ...]
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None


@attrs.define(eq=False)
class Submission:
    prompt: Prompt
    params: SamplingParams
    on_update: object
    requests: list[Request] = attrs.Factory(list)
    sent_tokens: list[int] = attrs.Factory(list)
    aborted: bool = False
    done: bool = False


class EngineLoop:
    def __init__(self, llm, metrics=None, deliver=None):
        """``metrics``: an object with ``admitted(submission)``, ``completed(request)`` and
        ``refresh(engine)`` (after every step and every batch of arrivals), or None.
        ``deliver(pairs)``: runs ``on_update(update)`` for each ``(on_update, update)``
        where the callers want it (default: here, on the loop's thread)."""
        self.llm, self.metrics = llm, metrics
        self.deliver = deliver or call_each
        self._outbox: list = []
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: list[Submission] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tokenspeed-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self.thread.join()

    def submit(self, prompt: Prompt, params: SamplingParams, on_update) -> Submission:
        """Queue a checked prompt; ``on_update(GroupUpdate)`` runs on the loop's thread."""
        submission = Submission(prompt, params, on_update)
        self.inbox.put(submission)
        return submission

    def abort(self, submission: Submission) -> None:
        submission.aborted = True
        self.inbox.put(submission)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self.llm.engine.has_work)
            if self.llm.engine.has_work:
                self._step()
            if self._outbox:
                outbox, self._outbox = self._outbox, []
                self.deliver(outbox)
            if self.metrics is not None:
                self.metrics.refresh(self.llm.engine)

    def _admit(self, block: bool) -> None:
        """Take what arrived: new submissions join, aborted ones leave."""
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            while True:
                if item is not None:
                    self._take(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self, submission: Submission) -> None:
        if submission.aborted:
            self._abort(submission)
        elif not submission.requests:
            [submission.requests] = self.llm.add([submission.prompt], [submission.params])
            submission.sent_tokens = [0] * len(submission.requests)
            self.live.append(submission)
            if self.metrics is not None:
                self.metrics.admitted(submission)

    def _abort(self, submission: Submission) -> None:
        if submission.done:  # it finished before the abort arrived
            return
        self.llm.abort(submission.requests)
        self._publish(submission)

    def _step(self) -> None:
        try:
            self.llm.step()
        except Exception as exc:  # noqa: BLE001 - the requests fail, the loop serves on
            self._fail_all(f"{type(exc).__name__}: {exc}")
            return
        for submission in list(self.live):
            self._publish(submission)

    def _publish(self, submission: Submission) -> None:
        deltas = tuple(self._delta(submission, i) for i in range(len(submission.requests)))
        finished = all(r.finished for r in submission.requests)
        if not finished and not any(d.text or d.token_ids for d in deltas):
            return
        if finished:
            self._retire(submission)
        self._outbox.append((submission.on_update, GroupUpdate(
            deltas, finished, len(submission.prompt.token_ids), sum(submission.sent_tokens))))

    def _delta(self, submission: Submission, index: int) -> CompletionDelta:
        request = submission.requests[index]
        stream = self.llm.text_of(request)
        kept = len(request.output) if stream is None or stream.kept_tokens is None else stream.kept_tokens
        start, submission.sent_tokens[index] = submission.sent_tokens[index], kept
        text = stream.take_unread() if stream is not None else ""
        logprobs = tuple(request.logprobs[start:kept]) if request.params.logprobs is not None else ()
        return CompletionDelta(request.index, text, tuple(request.output[start:kept]), logprobs,
                               request.finish_reason, request.stop_reason)

    def _retire(self, submission: Submission) -> None:
        submission.done = True
        if submission in self.live:
            self.live.remove(submission)
        self.llm.release(submission.requests)
        if self.metrics is not None:
            for request in submission.requests:
                self.metrics.completed(request)

    def _fail_all(self, message: str) -> None:
        for submission in list(self.live):
            self._retire(submission)
            self._outbox.append((submission.on_update, GroupUpdate(
                (), True, len(submission.prompt.token_ids), 0, message)))


def call_each(pairs) -> None:
    for on_update, update in pairs:
        on_update(update)
