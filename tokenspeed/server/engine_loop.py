"""One thread owns the engine and steps it; callers only enqueue and read reports.

The server's engine process (``engine_process``) feeds ``inbox`` with ``Submit``,
``Abort`` and ``Finish`` records from one or more clients (the API-server processes) and
hands each client a ``StepReport`` per step: the token updates of its prompts that gained
tokens or finished in the step (one report per step, not one message per request) and
the engine's load. The loop drives the engine through its client interface
(``EngineCore``), keyed by (client, the client's key). It sends token ids only: each client
detokenizes and matches stop strings itself (``PromptOutput``), and sends a ``Finish`` for
a completion a stop string ended. Requests from many callers join the running batch
between steps; an abort (a client that went away) finishes its request before the next
step, returning its pages, and a client that goes away (``ClientGone``) takes its requests
with it. Nothing a request does stops the loop: a step that fails takes every request then
in the engine with it (their pages return, each caller gets the error) and the loop serves on.

A report crosses a process boundary every step, and its records are built on the
engine's thread for every stream that gained tokens: they are ``msgspec`` Structs
(``messages``), built in C and encoded once, straight from the records.
"""

import logging
import queue
import threading

from tokenspeed.api.engine_core import EngineCore
from tokenspeed.api.messages import Abort, ClientGone, Finish, StepReport, Submit, TokenUpdate

IDLE_WAIT_S = 0.5


class EngineLoop:
    def __init__(self, core: EngineCore, report, crashed, num_clients: int = 1):
        """``report(client, StepReport)`` is called on the loop's thread (the engine
        process only queues it there: ``ReportSender``) after every step that changed
        something that client sees (its prompts, or the load, which every client
        hears of); ``crashed(message)`` once if the loop itself fails (not a step: those
        fail their requests), after which it reports nothing."""
        self.core, self.report, self.crashed = core, report, crashed
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
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
            self._admit(block=not self.core.has_work)
            if self.core.has_work:
                self._step()
            self._send_reports()

    def _send_reports(self) -> None:
        load = self.core.load()
        updates, self._updates = self._updates, {}
        for client in self.clients:
            if client in updates or load != self._load:
                self.report(client, StepReport(updates.get(client, []), load))
        self._load = load

    def _admit(self, block: bool) -> None:
        """Take what arrived: new submissions join, aborted ones, completions a client's stop
        string ended and those of clients that went away leave."""
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            while True:
                if isinstance(item, Submit):
                    self._take(item)
                elif isinstance(item, Abort):
                    self.core.abort((item.client, item.key))
                elif isinstance(item, Finish):
                    self.core.finish((item.client, item.key), item.index)
                elif isinstance(item, ClientGone):
                    self._leave(item.client)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self, submit: Submit) -> None:
        try:
            self.core.add((submit.client, submit.key), submit.prompt.token_ids, submit.params, submit.at_end)
        except ValueError as exc:   # the engine's own refusal: this submission alone fails
            self._queue(submit.client, submit.key,
                        TokenUpdate((), True, len(submit.prompt.token_ids), str(exc), (), refused=True))

    def _leave(self, client: int) -> None:
        self.clients.discard(client)
        for key in [key for key in self.core.keys if key[0] == client]:
            self.core.abort(key)

    def _step(self) -> None:
        """One step; its updates, each to its client. A step that fails ends its requests,
        which the next step reports, with the error, to their callers; its traceback is
        logged here (an internal fault is fixed in the code, not in the input)."""
        try:
            updates = self.core.step()
        except Exception:  # noqa: BLE001 - the requests fail, the loop serves on
            logging.getLogger(__name__).exception("an engine step failed; its requests fail with it")
            return
        for (client, key), update in updates:
            self._queue(client, key, update)

    def _queue(self, client: int, key: int, update: TokenUpdate) -> None:
        self._updates.setdefault(client, []).append((key, update))
