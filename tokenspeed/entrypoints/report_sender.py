"""The engine process's reports, sent from a thread of their own.

Every step ends with a report to each client: pickled, then written down its pipe. On the
engine's thread that was a tenth of its busy time at 64 streams (py-spy, docs/PERFORMANCE.md),
and a write blocks it outright while a lagging HTTP process leaves the pipe full. Here the
engine's thread only queues the report; one sender thread pickles and writes them in the
order queued (a client's reports must arrive in step order), mostly while the engine's
thread waits for the GPU with the interpreter lock released.
"""

import contextlib
import queue
import threading


class ReportSender:
    """``send(client, message)`` queues; ``close()`` sends what is queued, then stops."""

    def __init__(self, conns: list):
        self._conns = conns
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tokenspeed-reports", daemon=True)
        self._thread.start()

    def send(self, client: int, message) -> None:
        self._queue.put((client, message))

    def send_all(self, message) -> None:
        for client in range(len(self._conns)):
            self.send(client, message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            client, message = item
            with contextlib.suppress(OSError):   # a client gone: its ClientGone is on its way
                self._conns[client].send(message)
