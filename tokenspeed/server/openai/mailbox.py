"""A response's updates on their way from the report dispatcher to its handler."""

import asyncio


class Mailbox:
    """Items a handler has not taken yet, on one event loop, and the error that ends them
    if they will not all come (the engine process exited, the server is stopping, the
    request's deadline passed). ``asyncio.Queue`` passes each item through several Python
    layers; a stream takes one per token per client, and such per-token work is most of
    what a busy server's process does."""

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def put(self, item) -> None:
        self._items.append(item)
        self._wake()

    def fail(self, error: Exception) -> None:
        """No more items will come: ``take_all`` raises ``error`` once it has handed over
        those that came before it. The first error stands."""
        if self._error is None:
            self._error = error
            self._wake()

    def fail_after(self, seconds: float, error: Exception) -> None:
        """``fail(error)`` in ``seconds``, unless ``close`` comes first."""
        self._deadline = asyncio.get_running_loop().call_later(seconds, self.fail, error)

    def close(self) -> None:
        """The handler is done with it: a pending ``fail_after`` is cancelled."""
        if self._deadline is not None:
            self._deadline.cancel()

    async def take_all(self) -> list:
        """Every item that has arrived, once at least one has: a stream that fell behind
        the engine catches up in one write instead of one per token."""
        while not self._items:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
