"""The server's listening socket, bound before its engine starts: a port in use, a port
out of range or an address that is not this machine's is refused at once, not after the
model has loaded (minutes on a GPU), as vLLM binds its port first. It listens only once
served (asyncio's server calls ``listen``): a client meanwhile is refused at once, as by a
server that is down, rather than left connected and unanswered while the model loads."""

import contextlib
import socket

MAX_PORT = 65535
BACKLOG = 2048   # uvicorn's


@contextlib.contextmanager
def listening(host: str, port: int):
    """A socket bound to ``host:port`` (uvicorn's own choices of options), not yet
    listening; a ``ValueError`` naming the address where it cannot be."""
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"port={port}: must be in [0, {MAX_PORT}]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        yield sock
    finally:
        sock.close()
