"""A server on a free loopback port, in a thread of the test's process: shared by the
server's tests (test_server, test_server_lifecycle, openai/)."""

import contextlib
import socket
import threading
import time

import uvicorn

from tokenspeed.server.openai.server import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """``app`` served on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(1200):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "the server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
