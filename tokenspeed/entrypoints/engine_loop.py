"""One thread owns the engine and steps it; callers only enqueue and read reports.

The server's engine process (``engine_process``) feeds ``inbox`` with ``Submit`` and
``Abort`` records from one or more clients (the API-server processes) and hands each
client a ``StepReport`` per step: the updates of its requests that gained text or tokens
in the step (one report per step, not one message per request) and the engine's load.
Requests from many callers join the running batch between steps; an abort (a client
that went away) finishes its request before the next step, returning its pages, and a
client that goes away (``ClientGone``) takes its requests with it. Nothing a request
does stops the loop: a step that fails takes every request then in the engine with it
(their pages return, each caller gets the error) and the loop serves on.

A report crosses a process boundary every step, and its records are built on the
engine's thread for every stream: they are ``msgspec`` Structs (``messages``), built in C
and encoded once, straight from the records.
"""

import queue
import threading

import attrs

from tokenspeed.entrypoints.messages import (Abort, ClientGone, Completed, CompletionDelta, EngineLoad, GroupUpdate,
                                             StepReport, Submit)
from tokenspeed.entrypoints.prompts import Prompt
from tokenspeed.runtime.request import Request
from tokenspeed.runtime.sampling_params import SamplingParams

IDLE_WAIT_S = 0.5


@attrs.define(eq=False)
class Submission:
    key: int
    prompt: Prompt
    params: SamplingParams
    client: int
    requests: list[Request] = attrs.Factory(list)
    streams: list = attrs.Factory(list)        # each request's TextStream, or None
    sent_tokens: list[int] = attrs.Factory(list)
    finish_sent: list[bool] = attrs.Factory(list)   # each completion's finish gone out


class EngineLoop:
    def __init__(self, llm, report, crashed, num_clients: int = 1, stream_interval: int = 1):
        """``report(client, StepReport)`` is called on the loop's thread (the engine
        process only queues it there: ``ReportSender``) after every step that changed
        something that client sees (its requests, or the load, which every client
        hears of); ``crashed(message)`` once if the loop itself fails (not a step: those
        fail their requests), after which it reports nothing. ``stream_interval``: a
        completion's update goes out with its first token, then once it has gained this
        many tokens, and when it finishes (as SGLang's ``--stream-interval``): fewer,
        larger updates cost the engine's thread less per step than one per token."""
        self.llm, self.report, self.crashed = llm, report, crashed
        self.stream_interval = stream_interval
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[tuple[int, int], Submission] = {}          # by (client, key)
        self.clients = set(range(num_clients))                    # those still connected
        self._updates: dict[int, list] = {}                        # by client
        self._load = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tokenspeed-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self.thread.join()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - its owner must hear of it
            self.crashed(f"the engine loop failed: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self.llm.engine.has_work)
            if self.llm.engine.has_work:
                self._step()
            self._send_reports()

    def _send_reports(self) -> None:
        load = self._engine_load()
        updates, self._updates = self._updates, {}
        for client in self.clients:
            if client in updates or load != self._load:
                self.report(client, StepReport(updates.get(client, []), load))
        self._load = load

    def _admit(self, block: bool) -> None:
        """Take what arrived: new submissions join, aborted ones and those of clients that
        went away leave."""
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            while True:
                if isinstance(item, Submit):
                    self._take(item)
                elif isinstance(item, Abort) and (item.client, item.key) in self.live:
                    self._abort(self.live[item.client, item.key])
                elif isinstance(item, ClientGone):
                    self._leave(item.client)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self, submit: Submit) -> None:
        submission = Submission(submit.key, submit.prompt, submit.params, submit.client)
        try:
            [submission.requests] = self.llm.add([submission.prompt], [submission.params])
        except ValueError as exc:   # the engine's own check: this submission alone fails
            self._queue(submission, GroupUpdate((), True, len(submission.prompt.token_ids), 0,
                                                f"refused: {exc}", ()))
            return
        submission.streams = [self.llm.text_of(request) for request in submission.requests]
        submission.sent_tokens = [0] * len(submission.requests)
        submission.finish_sent = [False] * len(submission.requests)
        self.live[submission.client, submission.key] = submission

    def _abort(self, submission: Submission) -> None:
        self.llm.abort(submission.requests)
        self._publish(submission)

    def _leave(self, client: int) -> None:
        self.clients.discard(client)
        for submission in [s for s in self.live.values() if s.client == client]:
            self._abort(submission)

    def _step(self) -> None:
        try:
            self.llm.step()
        except Exception as exc:  # noqa: BLE001 - the requests fail, the loop serves on
            self._fail_all(f"{type(exc).__name__}: {exc}")
            return
        due = self._due if self.stream_interval > 1 else None
        for submission in list(self.live.values()):
            if due is None or due(submission):
                self._publish(submission)

    def _due(self, submission: Submission) -> bool:
        """Whether a completion of ``submission`` finished, has its first token out, or
        gained ``stream_interval`` tokens since its last update."""
        for request, sent in zip(submission.requests, submission.sent_tokens):
            made = len(request.output)
            if request.finished or (made and not sent) or made - sent >= self.stream_interval:
                return True
        return False

    def _publish(self, submission: Submission) -> None:
        """Queue the submission's update if a completion gained text or tokens or finished.
        The update holds only those completions' deltas: a completion that finished in an
        earlier step is not sent again (its finish would repeat in every later chunk). Runs
        for every stream every step, on the engine's thread: one pass."""
        deltas, finished = [], True
        for index, request in enumerate(submission.requests):
            delta = self._delta(submission, index, request)
            if delta is not None:
                deltas.append(delta)
            finished = finished and request.finished
        if not (finished or deltas):
            return
        done = self._retire(submission) if finished else ()
        self._queue(submission, GroupUpdate(tuple(deltas), finished, len(submission.prompt.token_ids),
                                            sum(submission.sent_tokens), None, done))

    def _queue(self, submission: Submission, update: GroupUpdate) -> None:
        self._updates.setdefault(submission.client, []).append((submission.key, update))

    def _delta(self, submission: Submission, index: int, request: Request) -> CompletionDelta | None:
        """What the completion gained since the last update;
        None when it gained nothing and did not finish in this step."""
        stream, output = submission.streams[index], request.output
        kept = len(output) if stream is None or stream.kept_tokens is None else stream.kept_tokens
        start, submission.sent_tokens[index] = submission.sent_tokens[index], kept
        text = stream.take_unread() if stream is not None else ""
        finishes = request.finished and not submission.finish_sent[index]
        if not (text or kept > start or finishes):
            return None
        submission.finish_sent[index] = request.finished
        logprobs = tuple(request.logprobs[start:kept]) if request.params.logprobs is not None else ()
        return CompletionDelta(request.index, text, tuple(output[start:kept]), logprobs, request.finish_reason,
                               request.stop_reason)

    def _retire(self, submission: Submission) -> tuple[Completed, ...]:
        """Forget a finished submission; its completions' ``Completed`` records."""
        del self.live[submission.client, submission.key]
        self.llm.release(submission.requests)
        return tuple(map(completed, submission.requests, submission.sent_tokens))

    def _fail_all(self, message: str) -> None:
        for submission in list(self.live.values()):
            done = self._retire(submission)
            self._queue(submission, GroupUpdate((), True, len(submission.prompt.token_ids), 0, message, done))

    def _engine_load(self) -> EngineLoad:
        scheduler = self.llm.engine.scheduler
        in_use = scheduler.allocator.num_pages - 1 - scheduler.allocator.num_free
        return EngineLoad(len(scheduler.running), len(scheduler.waiting), in_use)


def completed(request: Request, num_tokens: int) -> Completed:
    """``num_tokens``: the tokens the completion kept (a stop string drops those after it)."""
    ttft = tpot = None
    if request.first_token_time is not None:
        ttft = request.first_token_time - request.arrival_time
        if num_tokens > 1 and request.finish_time is not None:
            tpot = (request.finish_time - request.first_token_time) / (num_tokens - 1)
    return Completed(num_tokens, request.finish_reason or "abort", ttft, tpot)
