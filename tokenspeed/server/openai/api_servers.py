"""Several API-server processes over one engine process (``tokenspeed serve --api-servers N``).

With many streaming clients the HTTP process does Python work for every token of every
client (server-sent events, the writes) and becomes as busy as the engine it feeds
(docs/PERFORMANCE.md, serving). As vLLM's ``--api-server-count`` does, N processes share
one listening socket, bound here and inherited by each, so the kernel spreads the
connections among them. This parent closes its own copy once they hold theirs: when they
close theirs to drain, the kernel then refuses a new connection rather than queue it for
no one. Each has its own channel to the engine process, which routes every request's
updates to the process that submitted it. Their metrics are pooled through
prometheus_client's multiprocess folder (``metrics``). This parent only supervises: once
any of its children exits (an API server exits too once the engine has gone), or on
Ctrl-C / SIGTERM, it stops them all: each drains for the grace period (``lifecycle``).
"""

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading

import attrs

from tokenspeed.server.engine_process import EngineInfo, EngineProcess, EngineSpec
from tokenspeed.server.openai.access import Access
from tokenspeed.server.openai.chat_parsers import ParserFlags
from tokenspeed.server.openai.lifecycle import FINAL_WRITE_S, SHUTDOWN_TIMEOUT_S, ServerExited, check_timeout
from tokenspeed.server.openai.listening import BACKLOG, listening

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"   # read when a process imports prometheus_client
KILL_MARGIN_S = 5.0     # past an API server's own limit for its shutdown, before it is killed

__all__ = ["ServerExited", "serve_many"]


@attrs.frozen
class Timeouts:
    """``shutdown``: the drain's grace period on SIGTERM; ``request``: each request's
    deadline, or None (``Server``)."""
    shutdown: float = SHUTDOWN_TIMEOUT_S
    request: float | None = None

    def __attrs_post_init__(self):
        check_timeout("shutdown_timeout", self.shutdown)
        check_timeout("request_timeout", self.request)


def serve_many(spec: EngineSpec, model_name: str, host: str, port: int, api_key: str | None,
               count: int, log_level: str = "info", shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
               request_timeout: float | None = None, access: Access = Access(),
               parser_flags: ParserFlags = ParserFlags()) -> None:
    """Start the engine (an ``EngineStartError`` says why it could not), then ``count`` API
    servers on ``host:port``; return once Ctrl-C or SIGTERM has stopped them, or raise
    ``ServerExited`` once one has exited unasked and the others are stopped."""
    timeouts = Timeouts(shutdown_timeout, request_timeout)
    with listening(host, port) as sock:   # a port in use is refused before the engine starts
        engine = EngineProcess(spec, num_clients=count)
        try:
            info = engine.start()
            sock.listen(BACKLOG)   # connections queue for whichever server starts first
            lifeline, parent_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
            with tempfile.TemporaryDirectory(prefix="tokenspeed-metrics-") as metrics_dir, \
                    _environment(MULTIPROC_ENV, metrics_dir), parent_end:
                servers = [_api_server(engine, i, info, spec.tokenizer, model_name, api_key, sock, metrics_dir,
                                       log_level, lifeline, timeouts, access, parser_flags) for i in range(count)]
                sock.close()   # the servers' copies alone: closed as they drain, a new connection is refused
                lifeline.close()
                for channel in engine.channels:   # each now held by its server alone: when one
                    channel.close()               # exits, the engine drops its requests
                print(f"tokenspeed: {count} API servers on http://{host}:{port} (pids "
                      f"{', '.join(str(s.pid) for s in servers)})", flush=True)
                exited = _supervise(servers, engine, timeouts.shutdown + FINAL_WRITE_S + KILL_MARGIN_S)
        finally:
            engine.stop()
    if exited is not None:
        raise ServerExited(f"{exited.name} exited (code {exited.exitcode}); the server stopped")


def _api_server(engine: EngineProcess, index: int, info: EngineInfo, tokenizer, model_name, api_key, sock,
                metrics_dir, log_level, lifeline, timeouts: Timeouts, access: Access,
                parser_flags: ParserFlags) -> multiprocessing.Process:
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=api_server_main, name=f"tokenspeed-api-{index}", daemon=True,
                              args=(engine.channels[index].sock, info, tokenizer, model_name, api_key, sock,
                                    metrics_dir, log_level, lifeline, timeouts, access, parser_flags))
    process.start()
    return process


def api_server_main(engine_end, info: EngineInfo, tokenizer, model_name: str, api_key: str | None, sock,
                    metrics_dir: str, log_level: str, lifeline, timeouts: Timeouts = Timeouts(),
                    access: Access = Access(), parser_flags: ParserFlags = ParserFlags()) -> None:
    """A child: one uvicorn server on the shared socket, linked to the engine by
    ``engine_end`` (its channel's socket). When ``lifeline`` (the parent's pipe) closes, it
    sends itself SIGTERM: a parent killed outright leaves no server behind (and, their
    channels closed, no engine). Exits 1 if the engine process goes away."""
    from tokenspeed.server.channel import FrameSocket
    from tokenspeed.api.messages import from_engine_decoder
    from tokenspeed.server.openai.lifecycle import run, uvicorn_config
    from tokenspeed.server.openai.server import Server, server_app
    threading.Thread(target=_stop_when_closed, args=(lifeline,), daemon=True).start()
    server = Server(lambda: (FrameSocket(engine_end, from_engine_decoder()), info, None), tokenizer, model_name,
                    api_key, metrics_dir=metrics_dir, request_timeout=timeouts.request, parser_flags=parser_flags)
    host, port = sock.getsockname()[:2]
    app = server_app(server, access)
    try:
        run(app, uvicorn_config(app, host, port, log_level, timeouts.shutdown), sockets=[sock])
    except ServerExited as exc:
        sys.exit(f"{multiprocessing.current_process().name}: {exc}")


def _stop_when_closed(lifeline) -> None:
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()   # nothing is ever sent: this returns when the parent's end closes
    os.kill(os.getpid(), signal.SIGTERM)


def _supervise(servers: list[multiprocessing.Process], engine: EngineProcess,
               stop_wait: float) -> multiprocessing.Process | None:
    """Wait until a child exits or this process is told to stop, then stop the servers
    (SIGTERM: each drains, within its limit) and, through their closed channels, the
    engine; a server still up ``stop_wait`` seconds later is killed. Returns the child that
    exited unasked, if one did."""
    children = {c.sentinel: c for c in [*servers, engine.process]}
    with _stop_on(signal.SIGTERM):
        try:
            exited = children[multiprocessing.connection.wait(list(children))[0]]
            exited.join()   # its sentinel is ready as its files close, a moment before its exit code
        except KeyboardInterrupt:   # asked to stop (the children may be stopping already)
            exited = None
    for server in servers:
        if server.is_alive():
            server.terminate()
    for server in servers:
        server.join(stop_wait)
        if server.is_alive():
            server.kill()
            server.join()
    return exited


@contextlib.contextmanager
def _stop_on(signum: int):
    """``signum`` raises KeyboardInterrupt here, as Ctrl-C does, while inside."""
    def interrupt(*_):
        raise KeyboardInterrupt
    previous = signal.signal(signum, interrupt)
    try:
        yield
    finally:
        signal.signal(signum, previous)


@contextlib.contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` while inside: the children spawned meanwhile inherit it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous
