"""The engine process's reports, sent from a thread of their own.

Every step ends with a report to each client: encoded, then written down its channel. On the
engine's thread that was a tenth of its busy time at 64 streams (py-spy, docs/PERFORMANCE.md),
and a write blocks it outright while a lagging HTTP process leaves the socket full. Here the
engine's thread only queues the report; one sender thread encodes and writes them in the
order queued (a client's reports must arrive in step order). Encoding still takes the
interpreter lock from the engine's thread, whenever it runs; what the thread is spared is
the write, and waiting on a full socket. The queue is bounded: a client that stops reading
still holds the engine back, as its full socket did, only later.
"""

import contextlib
import queue
import threading
from collections.abc import Callable

MAX_QUEUED = 256     # reports (one per client per step) the engine may run ahead


class ReportSender:
    """``send(client, message)`` queues; ``close()`` sends what is queued, then stops.
    ``failure(text)`` is the message every client gets, once, if a message cannot be sent
    (encoding failed, say); nothing is sent after it, as after a loop that failed."""

    def __init__(self, conns: list, failure: Callable[[str], object]):
        self._conns, self._failure = conns, failure
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._thread = threading.Thread(target=self._run, name="tokenspeed-reports", daemon=True)
        self._thread.start()

    def send(self, client: int, message) -> None:
        self._queue.put((client, message))

    def send_all(self, message) -> None:
        for client in range(len(self._conns)):
            self.send(client, message)

    def fail(self, text: str) -> None:
        """Queue ``failure(text)`` for every client."""
        self.send_all(self._failure(text))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        failed = False
        while (item := self._queue.get()) is not None:
            failed = failed or self._send(*item)

    def _send(self, client: int, message) -> bool:
        """Send ``message``; whether sending failed (the clients were told)."""
        try:
            self._conns[client].send(message)
        except OSError:   # a client gone: its ClientGone is on its way
            return False
        except Exception as exc:  # noqa: BLE001 - every client must hear of it
            failure = self._failure(f"the engine could not send a report: {type(exc).__name__}: {exc}")
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send(failure)
            return True
        return False
