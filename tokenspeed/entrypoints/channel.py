"""The engine process's channel to each client: pickled records in length-prefixed frames
over one end of a socket pair each.

``multiprocessing.Connection`` assumes a blocking socket, and uvloop's ``add_reader``
makes the HTTP process's end non-blocking: a record larger than the socket's buffer (a
1 MB stop string, a report of ``n=1000``) was written in part, the rest refused with
``EAGAIN``, and the channel lost its framing for good. Here the framing is ours, and each
end does what its process can: the engine's end blocks (``FrameSocket``: threads send
and read it), the HTTP process's end is a protocol on the event loop's transport
(``FrameProtocol``), which buffers what the socket cannot take yet and parses frames from
whatever arrives, in any pieces.
"""

import asyncio
import pickle
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

HEADER = struct.Struct("!Q")    # the payload's length in bytes


def frame(record) -> bytes:
    """``record`` pickled behind its length: one write for the transport or the socket."""
    payload = pickle.dumps(record, pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected ends: one for the engine process, one for a client."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


class FrameSocket:
    """A blocking end: ``send`` whole records from any thread (one at a time), ``recv``
    one from one thread; ``recv`` raises ``EOFError`` once the other end has closed."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self.sock = sock
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, record) -> None:
        data = frame(record)   # pickled first: a record that does not pickle writes nothing
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self):
        (size,) = HEADER.unpack(self._exactly(HEADER.size))
        return pickle.loads(self._exactly(size))

    def poll(self, timeout: float) -> bool:
        """Whether a read would not block, waiting up to ``timeout`` seconds."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def close(self) -> None:
        self.sock.close()

    def _exactly(self, size: int) -> bytearray:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            received = self.sock.recv_into(view[got:])
            if not received:
                raise EOFError("the other end of the channel closed")
            got += received
        return data


class FrameProtocol(asyncio.Protocol):
    """An event loop's end: ``on_record(record)`` for every frame that arrives, in order;
    ``on_close()`` once, when the other end closes (or the connection breaks).
    ``last_heard``: when anything last arrived (``time.monotonic``), for a heartbeat."""

    def __init__(self, on_record: Callable[[object], None], on_close: Callable[[], None]):
        self.on_record, self.on_close = on_record, on_close
        self.transport: asyncio.Transport | None = None
        self.last_heard = time.monotonic()
        self._buffer = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, record) -> None:
        """Queue ``record``: the transport writes what the socket takes and keeps the rest."""
        if self.transport is None or self.transport.is_closing():
            raise OSError("the engine's channel is closed")
        self.transport.write(frame(record))

    def data_received(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        buffer = self._buffer
        buffer += data
        for record in self._complete_records():
            self.on_record(record)

    def eof_received(self) -> bool:
        return False   # close our end too

    def connection_lost(self, exc) -> None:
        self.on_close()

    def _complete_records(self) -> list:
        """Every whole frame in the buffer, unpickled; the partial one stays."""
        buffer, start, records = self._buffer, 0, []
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if end > len(buffer):
                break
            records.append(pickle.loads(memoryview(buffer)[start + HEADER.size:end]))
            start = end
        del buffer[:start]
        return records


async def connect(sock: socket.socket, on_record, on_close) -> FrameProtocol:
    """``sock`` (an end a ``FrameSocket`` may have read from, whole frames only) handed
    to the running event loop, which owns and closes it from now on."""
    loop = asyncio.get_running_loop()
    _, protocol = await loop.connect_accepted_socket(lambda: FrameProtocol(on_record, on_close), sock)
    return protocol
