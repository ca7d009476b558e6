"""Several API-server processes over one engine process (``tokenspeed serve --api-servers N``).

With many streaming clients the HTTP process does Python work for every token of every
client (server-sent events, the writes) and becomes as busy as the engine it feeds
(docs/PERFORMANCE.md, serving). As vLLM's ``--api-server-count`` does, N processes share
one listening socket, bound here and inherited by each, so the kernel spreads the
connections among them; each has its own pipe to the engine process, which routes every
request's updates to the process that submitted it. Their metrics are pooled through
prometheus_client's multiprocess folder (``metrics``). This parent only supervises: once
any of its children exits, or on Ctrl-C / SIGTERM, it stops them all.
"""

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import threading

import uvicorn

from tokenspeed.entrypoints.engine_process import EngineInfo, EngineProcess, EngineSpec

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"   # read when a process imports prometheus_client
STOP_WAIT_S = 10.0


class ServerExited(RuntimeError):
    """A process of the server (an API server or the engine) exited unasked; the others
    were stopped."""


def serve_many(spec: EngineSpec, model_name: str, host: str, port: int, api_key: str | None,
               count: int, log_level: str = "info") -> None:
    """Start the engine (an ``EngineStartError`` says why it could not), then ``count`` API
    servers on ``host:port``; return once Ctrl-C or SIGTERM has stopped them, or raise
    ``ServerExited`` once one has exited unasked and the others are stopped."""
    with _listening(host, port) as sock:   # a port in use is refused before the engine starts
        engine = EngineProcess(spec, num_clients=count)
        try:
            info = engine.start()
            lifeline, parent_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
            with tempfile.TemporaryDirectory(prefix="tokenspeed-metrics-") as metrics_dir, \
                    _environment(MULTIPROC_ENV, metrics_dir), parent_end:
                servers = [_api_server(engine, i, info, spec.tokenizer, model_name, api_key, sock, metrics_dir,
                                       log_level, lifeline) for i in range(count)]
                lifeline.close()
                for conn in engine.conns:   # each now held by its server alone: when one exits,
                    conn.close()            # the engine sees its pipe close and drops its requests
                print(f"tokenspeed: {count} API servers on http://{host}:{port} (pids "
                      f"{', '.join(str(s.pid) for s in servers)})", flush=True)
                exited = _supervise(servers, engine)
        finally:
            engine.stop()
    if exited is not None:
        raise ServerExited(f"{exited.name} exited (code {exited.exitcode}); the server stopped")


def _api_server(engine: EngineProcess, index: int, info: EngineInfo, tokenizer, model_name, api_key, sock,
                metrics_dir, log_level, lifeline) -> multiprocessing.Process:
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=api_server_main, name=f"tokenspeed-api-{index}", daemon=True,
                              args=(engine.conns[index], info, tokenizer, model_name, api_key, sock,
                                    metrics_dir, log_level, lifeline))
    process.start()
    return process


def api_server_main(conn, info: EngineInfo, tokenizer, model_name: str, api_key: str | None, sock,
                    metrics_dir: str, log_level: str, lifeline) -> None:
    """A child: one uvicorn server on the shared socket, linked to the engine by ``conn``.
    When ``lifeline`` (the parent's pipe) closes, it sends itself SIGTERM: a parent killed
    outright leaves no server behind (and, their pipes closed, no engine)."""
    from tokenspeed.entrypoints.openai.server import Server, server_app, uvicorn_config
    threading.Thread(target=_stop_when_closed, args=(lifeline,), daemon=True).start()
    server = Server(lambda: (conn, info, None), tokenizer, model_name, api_key, metrics_dir=metrics_dir)
    host, port = sock.getsockname()[:2]
    uvicorn.Server(uvicorn_config(server_app(server), host, port, log_level)).run(sockets=[sock])


def _stop_when_closed(lifeline) -> None:
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()   # nothing is ever sent: this returns when the parent's end closes
    os.kill(os.getpid(), signal.SIGTERM)


def _supervise(servers: list[multiprocessing.Process], engine: EngineProcess) -> multiprocessing.Process | None:
    """Wait until a child exits or this process is told to stop, then stop the servers
    (SIGTERM: uvicorn finishes its responses) and, through their closed pipes, the engine.
    Returns the child that exited unasked, if one did."""
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
        server.join(STOP_WAIT_S)
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
def _listening(host: str, port: int):
    """A socket bound and listening on ``host:port`` (uvicorn's own choices of options)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        sock.listen(2048)
        yield sock
    finally:
        sock.close()


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
