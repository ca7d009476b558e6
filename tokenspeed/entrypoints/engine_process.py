"""The server's engine in a process of its own.

Streaming to many clients is Python work per token (JSON, server-sent events, the HTTP
writes), and so is stepping the engine; in one process they take turns on one interpreter
lock, and every token a client receives lengthens the next step (docs/PERFORMANCE.md,
serving). So, as vLLM's engine core does, the engine and its loop run in a child process
and the HTTP process only sends ``Submit``/``Abort`` records down a pipe and reads one
``StepReport`` per step back (packed: ``PackedReport``).

``EngineSpec.build`` makes the ``LLM`` inside the child: any picklable callable (a path
and options through ``functools.partial(LLM, ...)``, or a module-level factory).
"""

import asyncio
import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple

import attrs

from tokenspeed.entrypoints.engine_loop import Abort, ClientGone, EngineLoop, PackedReport, StepReport, Submit
from tokenspeed.entrypoints.frozen_heap import frozen_heap
from tokenspeed.entrypoints.report_sender import ReportSender
from tokenspeed.runtime.prompt_limits import PromptLimits

START_TIMEOUT_S = 900.0      # a cold start compiles kernels and captures graphs
STOP_TIMEOUT_S = 10.0
EXIT_WAIT_S = 1.0
RELAY_SWITCH_INTERVAL_S = 2e-4   # see engine_main


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer of at least 1, got {value!r}")


@attrs.frozen
class EngineSpec:
    """``build()`` returns the ``LLM`` (called in the child); ``tokenizer``: where the HTTP
    process loads the same tokenizer from (a model path), or None for token ids only;
    ``stream_interval``: a completion's tokens go out every this many (``EngineLoop``)."""
    build: Callable
    tokenizer: str | None = None
    stream_interval: int = attrs.field(default=1, validator=_positive)

    @classmethod
    def of(cls, model, stream_interval: int = 1, **options) -> "EngineSpec":
        """``ts.LLM(model, **options)``, its tokenizer read from the same path."""
        from tokenspeed.entrypoints.llm import LLM, tokenizer_path
        from tokenspeed.models.gguf import default_model_path
        path = str(model if model is not None else default_model_path())
        return cls(functools.partial(LLM, path, **options), tokenizer_path(path), stream_interval)


class EngineInfo(NamedTuple):
    """What the HTTP process learns of the engine once it has started."""
    limits: PromptLimits
    has_tokenizer: bool


class EngineFailed(NamedTuple):
    message: str


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why)."""


MAX_REPORTS_PER_READ = 16    # then the event loop's other callbacks get their turn


class EngineProcess:
    """The child process that owns the engine, and the parent's ends of its pipes: one per
    client (API-server process), each of which may be handed to another process."""

    def __init__(self, spec: EngineSpec, num_clients: int = 1):
        context = multiprocessing.get_context("spawn")   # CUDA cannot cross a fork
        pipes = [context.Pipe() for _ in range(num_clients)]
        self.conns = [ours for ours, _ in pipes]
        self.process = context.Process(target=engine_main, args=(spec, [theirs for _, theirs in pipes]),
                                       daemon=True, name="tokenspeed-engine")
        self.info: EngineInfo | None = None

    def start(self) -> EngineInfo:
        """Start the child and wait until its engine is ready (blocking); once."""
        if self.info is None:
            self.process.start()
            self.info = _first_message(self.conns[0], self)
            for conn in self.conns[1:]:
                conn.recv()   # every client's copy of the same
        return self.info

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def reap(self) -> None:
        """Wait briefly for a child that is exiting, so its exit code is known."""
        self.process.join(EXIT_WAIT_S)

    def stop(self) -> None:
        """Close every client's pipe (the engine stops once all are closed), then wait."""
        if self.process.is_alive():
            for conn in self.conns:
                with contextlib.suppress(OSError):   # it may be exiting already
                    conn.send(None)
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


def _first_message(conn, process: EngineProcess) -> EngineInfo:
    if not conn.poll(START_TIMEOUT_S):
        process.stop()
        raise EngineStartError(f"the engine process did not start in {START_TIMEOUT_S:.0f} s")
    try:
        first = conn.recv()
    except (EOFError, OSError):
        process.reap()
        first = EngineFailed(f"the engine process exited (code {process.exitcode})")
    if not isinstance(first, EngineInfo):
        process.process.join()
        raise EngineStartError(f"the engine process failed to start: {first.message}")
    return first


class EngineClient:
    """One client's side of the engine process (the HTTP process's, or one API server's of
    several): sends it work, hands each report to ``on_report`` and ``on_exit(message)``
    once if the engine goes away unasked, both on the thread of the event loop that
    ``listen`` was given. ``process``: the engine process, where this process owns it."""

    def __init__(self, conn, info: EngineInfo, on_report: Callable[[StepReport], None],
                 on_exit: Callable[[str], None], process: EngineProcess | None = None):
        self.info, self.on_report, self.on_exit, self.process = info, on_report, on_exit, process
        self._conn = conn
        self._poller = select.poll()   # Connection.poll builds a selector per call: 6 us, not 0.6
        self._stopping = self._listening = self._closed = False
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()

    def listen(self, event_loop: asyncio.AbstractEventLoop) -> None:
        """Start handing reports over (those sent meanwhile wait in the pipe). The event loop
        reads the pipe itself: a reader thread handing reports to a busy loop waited for the
        interpreter lock (up to its 5 ms switch interval) at every report, the pipe filled,
        and the engine stalled on its sends (served throughput fell by a third, at random)."""
        if not self._listening and not self._closed:
            self._listening, self._event_loop = True, event_loop
            self._poller.register(self._conn.fileno(), select.POLLIN)
            event_loop.add_reader(self._conn.fileno(), self._read, event_loop)

    @property
    def alive(self) -> bool:
        return self._listening and (self.process is None or self.process.alive)

    def exit_message(self) -> str:
        code = "" if self.process is None else f" (code {self.process.exitcode})"
        return f"the engine process exited{code}"

    def submit(self, key: int, prompt, params) -> None:
        """Queue a checked prompt; its updates will carry ``key`` (the caller's, unique)."""
        with self._send_lock:
            self._conn.send(Submit(key, prompt, params))

    def abort(self, key: int) -> None:
        with self._send_lock:
            self._conn.send(Abort(key))

    def stop(self) -> None:
        """Stop listening and close this client's pipe; the engine process too, if owned."""
        self._stopping = True
        if self.process is not None:
            self.process.stop()
        if self._listening:   # a closed pipe must not stay watched
            self._listening = False
            self._event_loop.remove_reader(self._conn.fileno())
            self._poller.unregister(self._conn.fileno())
        with contextlib.suppress(OSError):
            self._conn.close()

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            if self.process is not None:
                self.process.reap()
            return EngineFailed(self.exit_message())

    def _read(self, event_loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(MAX_REPORTS_PER_READ):
            if not self._poller.poll(0):
                return
            message = self._receive()
            if not isinstance(message, PackedReport):
                self._listening, self._closed = False, True
                event_loop.remove_reader(self._conn.fileno())
                if not self._stopping:
                    self.on_exit(message.message)
                return
            self.on_report(message.unpack())


def engine_main(spec: EngineSpec, conns: list) -> None:
    """The child: build the engine, report ready to every client, relay their records to
    its loop until all have closed their pipes (or the parent has gone away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    try:
        llm = spec.build()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        for conn in conns:
            conn.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
        return
    sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)
    # The relay below needs the interpreter lock for every record it reads, while the
    # engine's thread holds it through each step's host work: at the default 5 ms switch
    # interval a record waited ~5 ms (median, CPU trial) behind a busy thread, so the 64
    # requests of a wave of clients reached a busy engine one per step, each admitted in a
    # prefill step of its own. At 0.2 ms it waits ~0.6 ms; an idle relay costs nothing.
    with frozen_heap():   # the model's and graphs' objects, never walked again
        info = EngineInfo(llm.engine.limits, llm.tokenizer is not None)
        for conn in conns:
            conn.send(info)
        loop, sender = start_loop(llm, conns, spec.stream_interval)
        try:
            _relay(conns, loop.inbox)
        finally:
            loop.stop()
            sender.close()


def start_loop(llm, conns: list, stream_interval: int = 1) -> tuple[EngineLoop, ReportSender]:
    """The engine's loop, started, its reports sent to ``conns`` by a ``ReportSender``."""
    sender = ReportSender(conns, EngineFailed)
    loop = EngineLoop(llm, sender.send, sender.fail, num_clients=len(conns), stream_interval=stream_interval)
    return loop.start(), sender


def _relay(conns: list, inbox) -> None:
    """Each client's records into the loop's inbox, tagged with the client; a closed pipe
    (or ``None``, a client's goodbye) becomes a ``ClientGone``."""
    open_conns = dict(enumerate(conns))
    by_conn = {conn: client for client, conn in open_conns.items()}
    while open_conns:
        for conn in multiprocessing.connection.wait(list(open_conns.values())):
            client = by_conn[conn]
            try:
                record = conn.recv()
            except (EOFError, OSError):
                record = None
            if record is None:
                del open_conns[client]
                inbox.put(ClientGone(client))
            else:
                inbox.put(record._replace(client=client))
