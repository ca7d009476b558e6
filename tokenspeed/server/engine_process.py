"""The server's engine in a process of its own.

Streaming to many clients is Python work per token (JSON, server-sent events, the HTTP
writes), and so is stepping the engine; in one process they take turns on one interpreter
lock, and every token a client receives lengthens the next step (docs/PERFORMANCE.md,
serving). So, as vLLM's engine core does, the engine and its loop run in a child process
and the HTTP process only sends ``Submit``, ``Abort`` and ``Finish`` records down a channel
(``channel``; the records: ``messages``) and reads one ``StepReport`` per step back, and a ``Heartbeat``
every ``HEARTBEAT_INTERVAL_S`` from a thread of its own: an engine stopped outright (SIGSTOP,
a hung driver) falls silent, and the HTTP process's health check says so.

``EngineSpec.build`` makes the ``LLM`` inside the child (the loop drives its engine, not
it): any picklable callable (a path and options through ``functools.partial(LLM, ...)``,
or a module-level factory).
"""

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
from collections.abc import Callable

import attrs
import msgspec

from tokenspeed.server.channel import FrameSocket, socket_pair
from tokenspeed.api.engine_core import EngineCore
from tokenspeed.server.engine_loop import EngineLoop
from tokenspeed.server.frozen_heap import frozen_heap
from tokenspeed.api.messages import (ClientGone, EngineFailed, EngineInfo, Heartbeat, from_engine_decoder,
                                             to_engine_decoder)
from tokenspeed.server.report_sender import ReportSender

START_TIMEOUT_S = 900.0      # a cold start compiles kernels and captures graphs
STOP_TIMEOUT_S = 10.0
EXIT_WAIT_S = 1.0
RELAY_SWITCH_INTERVAL_S = 2e-4   # see engine_main
HEARTBEAT_INTERVAL_S = 0.2
BEAT_JOIN_S = 1.0


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer of at least 1, got {value!r}")


@attrs.frozen
class EngineSpec:
    """``build()`` returns the ``LLM`` (called in the child); ``tokenizer``: where the HTTP
    process loads the same tokenizer from (a model path), or None for token ids only;
    ``stream_interval``: a completion's tokens go out every this many (``EngineCore``)."""
    build: Callable
    tokenizer: str | None = None
    stream_interval: int = attrs.field(default=1, validator=_positive)

    @classmethod
    def of(cls, model, stream_interval: int = 1, **options) -> "EngineSpec":
        """``ts.LLM(model, **options)``, its tokenizer read from the same path (a model id
        resolved here, once, so that both processes read one snapshot)."""
        from tokenspeed.api.llm import LLM, tokenizer_path
        from tokenspeed.api.model_source import model_path
        path = model_path(model, options.pop("revision", None))
        return cls(functools.partial(LLM, str(path), **options), tokenizer_path(path), stream_interval)


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why)."""


class EngineProcess:
    """The child process that owns the engine, and the parent's ends of its channels: one
    per client (API-server process), each of which may be handed to another process."""

    def __init__(self, spec: EngineSpec, num_clients: int = 1):
        context = multiprocessing.get_context("spawn")   # CUDA cannot cross a fork
        pairs = [socket_pair() for _ in range(num_clients)]
        self.channels = [FrameSocket(ours, from_engine_decoder()) for ours, _ in pairs]
        self._engine_ends = [theirs for _, theirs in pairs]
        self.process = context.Process(target=engine_main, args=(spec, self._engine_ends),
                                       daemon=True, name="tokenspeed-engine")
        self.info: EngineInfo | None = None

    def start(self) -> EngineInfo:
        """Start the child and wait until its engine is ready (blocking); once. Ctrl-C or
        SIGTERM while it loads kills it: it has nothing to drain, and it ignores both
        signals, so the interpreter's exit would otherwise wait on it for ever (or, killed
        by SIGTERM, leave it loading on its own)."""
        if self.info is None:
            with _terminate_interrupts():
                try:
                    self._start()
                except BaseException:
                    self.kill()
                    raise
        return self.info

    def _start(self) -> None:
        self.process.start()
        for end in self._engine_ends:   # the child's alone now: its exit closes them
            end.close()
        self.info = _first_message(self.channels[0], self)
        for channel in self.channels[1:]:
            channel.recv()   # every client's copy of the same

    def kill(self) -> None:
        """Stop the child at once (one that has not started serving)."""
        for channel in self.channels:
            channel.close()
        if self.process.pid is not None:
            self.process.kill()
            self.process.join()

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
        """Close every client's end still here (the engine stops once all are closed), then
        wait; an engine that has not stopped within ``STOP_TIMEOUT_S`` is killed (it ignores
        SIGTERM: ``engine_main``)."""
        for channel in self.channels:
            channel.close()
        if self.process.is_alive():
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@contextlib.contextmanager
def _terminate_interrupts():
    """SIGTERM raised as KeyboardInterrupt (as vLLM's server treats it) while the engine
    loads, in the main thread: uvicorn's own handlers take over once it serves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _first_message(channel: FrameSocket, process: EngineProcess) -> EngineInfo:
    if not channel.poll(START_TIMEOUT_S):
        process.stop()
        raise EngineStartError(f"the engine process did not start in {START_TIMEOUT_S:.0f} s")
    try:
        first = channel.recv()
    except (EOFError, OSError):
        process.reap()
        first = EngineFailed(f"the engine process exited (code {process.exitcode})")
    if not isinstance(first, EngineInfo):
        process.process.join()
        raise EngineStartError(f"the engine process failed to start: {first.message}")
    return first


def engine_main(spec: EngineSpec, ends: list) -> None:
    """The child: build the engine, report ready to every client, relay their records to
    its loop until all have closed their ends (or the parent has gone away)."""
    for signum in (signal.SIGINT, signal.SIGTERM):   # the parent's to handle: Ctrl-C reaches the whole
        signal.signal(signum, signal.SIG_IGN)        # process group, and so does the SIGTERM of systemd's
    # default kill mode or of `timeout`; the parent drains its requests, then stops the engine by closing
    # its channels (``EngineProcess.stop``, which kills it if it must). Ended by SIGTERM, the engine
    # dropped every request in flight, the drain's included.
    channels = [FrameSocket(end, to_engine_decoder()) for end in ends]
    try:
        llm = spec.build()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        for channel in channels:
            channel.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
        return
    sys.setswitchinterval(RELAY_SWITCH_INTERVAL_S)
    # The relay below needs the interpreter lock for every record it reads, while the
    # engine's thread holds it through each step's host work: at the default 5 ms switch
    # interval a record waited ~5 ms (median, CPU trial) behind a busy thread, so the 64
    # requests of a wave of clients reached a busy engine one per step, each admitted in a
    # prefill step of its own. At 0.2 ms it waits ~0.6 ms; an idle relay costs nothing.
    with frozen_heap():   # the model's and graphs' objects, never walked again
        info = EngineInfo(llm.engine.limits, llm.tokenizer is not None, llm.sampling_defaults)
        try:
            for channel in channels:
                channel.send(info)
        except (BrokenPipeError, ConnectionResetError):   # the parent has gone: no one to serve
            return
        loop, sender = start_loop(llm, channels, spec.stream_interval)
        with beating(channels):
            try:
                _relay(channels, loop.inbox)
            finally:
                loop.stop()
                sender.close()


def start_loop(llm, channels: list, stream_interval: int = 1) -> tuple[EngineLoop, ReportSender]:
    """The loop over ``llm``'s engine (through an ``EngineCore`` of its own: the ``LLM`` only
    built it), started, its reports sent to ``channels`` by a ``ReportSender``."""
    sender = ReportSender(channels, EngineFailed)
    core = EngineCore(llm.engine, stream_interval)
    loop = EngineLoop(core, sender.send, sender.fail, num_clients=len(channels))
    return loop.start(), sender


@contextlib.contextmanager
def beating(channels: list, interval: float = HEARTBEAT_INTERVAL_S):
    """A ``Heartbeat`` to every channel every ``interval`` seconds while inside, from a
    thread of its own: it beats while the engine's thread is busy in a long step (its
    kernels release the interpreter lock), and falls silent only if the process stops."""
    stop = threading.Event()
    thread = threading.Thread(target=_beat, args=(channels, stop, interval), name="tokenspeed-heartbeat",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(BEAT_JOIN_S)   # a beat blocked on a client that stopped reading stays behind


def _beat(channels: list, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        for channel in channels:
            with contextlib.suppress(OSError):   # a client gone: its ClientGone is on its way
                channel.send(Heartbeat())


def _relay(channels: list, inbox) -> None:
    """Each client's records into the loop's inbox, tagged with the client; a closed end
    becomes a ``ClientGone``."""
    open_channels = dict(enumerate(channels))
    by_channel = {channel: client for client, channel in open_channels.items()}
    while open_channels:
        for channel in multiprocessing.connection.wait(list(open_channels.values())):
            client = by_channel[channel]
            try:
                inbox.put(msgspec.structs.replace(channel.recv(), client=client))
            except (EOFError, OSError):
                del open_channels[client]
                inbox.put(ClientGone(client))
