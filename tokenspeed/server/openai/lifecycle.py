"""How a server process runs and ends: uvicorn's server, drained for a bounded grace
period on SIGTERM, and stopped (to exit non-zero) when its engine process goes away.

uvicorn waits for every open response before it shuts down, without a limit by default: a
long stream held a SIGTERM'd server up for minutes. Here, once ``shutdown_timeout`` seconds
of the drain have passed, every request still in flight is failed (a stream ends with an
error event and ``data: [DONE]``) and uvicorn cancels what has still not finished
``FINAL_WRITE_S`` later. A server whose engine process exited unasked serves nothing more
(every request would be a 503): it stops, and its process exits non-zero so that a
supervisor restarts it, as vLLM's does.
"""

import asyncio

import uvicorn

from tokenspeed.server.openai.protocol import APIError

SHUTDOWN_TIMEOUT_S = 10.0
FINAL_WRITE_S = 2.0     # for the failed requests' last writes, after the drain


class ServerExited(RuntimeError):
    """A process of the server (an API server or the engine) exited unasked; the others
    were stopped."""


def uvicorn_config(app, host: str, port: int, log_level: str,
                   shutdown_timeout: float = SHUTDOWN_TIMEOUT_S) -> uvicorn.Config:
    """uvloop's event loop and httptools' parser, named rather than left to uvicorn's "auto"
    (which takes asyncio and h11 when they are missing): with 64 streaming clients the
    server's process does little else than per-token writes, which these make cheaper."""
    check_timeout("shutdown_timeout", shutdown_timeout)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, loop="uvloop", http="httptools",
                          timeout_graceful_shutdown=shutdown_timeout + FINAL_WRITE_S)


def check_timeout(name: str, seconds: float | None) -> None:
    if seconds is not None and not seconds > 0:
        raise ValueError(f"{name} must be a number of seconds above 0, got {seconds!r}")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown fails what is still in flight (``fail_all``) once
    ``config.timeout_graceful_shutdown - FINAL_WRITE_S`` seconds have passed, and which
    stops when the app's ``Server`` says its engine has gone (``stop_serving``)."""

    def __init__(self, config: uvicorn.Config, server):
        super().__init__(config)
        self.app_server = server
        server.stop_serving = self.stop_serving

    def stop_serving(self) -> None:
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown - FINAL_WRITE_S
        error = APIError(503, f"the server is shutting down (its {grace:g} s grace period has passed)", None,
                         "ServiceUnavailableError")
        timer = asyncio.get_running_loop().call_later(grace, self.app_server.fail_all, error)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run(app, config: uvicorn.Config, sockets=None) -> None:
    """Serve ``app`` (its ``state.server``, a ``Server``) until SIGINT or SIGTERM have
    drained it; raise ``ServerExited`` if it stopped because its engine process went away."""
    server = app.state.server
    DrainingServer(config, server).run(sockets=sockets)
    if server.exit_message is not None:
        raise ServerExited(f"{server.exit_message}; the server stopped")
