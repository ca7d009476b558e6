"""The engine process's channel to each client: records encoded to msgpack (``msgspec``;
``messages`` says which records) in length-prefixed frames over one end of a socket pair
each. Each end decodes with the decoder of what it receives (``messages.RecordDecoder``).

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
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgspec

HEADER = struct.Struct("!Q")    # the payload's length in bytes


def frame(record) -> bytes:
    """``record`` encoded behind its length: one write for the transport or the socket."""
    payload = msgspec.msgpack.encode(record)
    return HEADER.pack(len(payload)) + payload


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected ends: one for the engine process, one for a client."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


class FrameSocket:
    """A blocking end: ``send`` whole records from any thread (one at a time), ``recv``
    one from one thread, decoded by ``decoder``; ``recv`` raises ``EOFError`` once the
    other end has closed."""

    def __init__(self, sock: socket.socket, decoder):
        sock.setblocking(True)
        self.sock, self.decoder = sock, decoder
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, record) -> None:
        data = frame(record)   # encoded first: a record that does not encode writes nothing
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self):
        (size,) = HEADER.unpack(self._exactly(HEADER.size))
        return self.decoder.decode(self._exactly(size))

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
    """An event loop's end: ``on_record(record)`` for every frame that arrives, in order
    (decoded by ``decoder``);
    ``on_close()`` once, when the other end closes (or the connection breaks).
    ``last_heard``: when anything last arrived (``time.monotonic``), for a heartbeat."""

    def __init__(self, on_record: Callable[[object], None], on_close: Callable[[], None], decoder):
        self.on_record, self.on_close, self.decoder = on_record, on_close, decoder
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
        """Every whole frame in the buffer, decoded; the partial one stays."""
        buffer, start, records = self._buffer, 0, []
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if end > len(buffer):
                break
            records.append(self.decoder.decode(memoryview(buffer)[start + HEADER.size:end]))
            start = end
        del buffer[:start]
        return records


async def connect(sock: socket.socket, on_record, on_close, decoder) -> FrameProtocol:
    """``sock`` (an end a ``FrameSocket`` may have read from, whole frames only) handed
    to the running event loop, which owns and closes it from now on."""
    loop = asyncio.get_running_loop()
    _, protocol = await loop.connect_accepted_socket(lambda: FrameProtocol(on_record, on_close, decoder), sock)
    return protocol
