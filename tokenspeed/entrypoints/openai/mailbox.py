"""A response's updates on their way from the report dispatcher to its handler."""

import asyncio


class Mailbox:
    """Items a handler has not taken yet, on one event loop. ``asyncio.Queue`` passes each
    item through several Python layers; a stream takes one per token per client, and such
    per-token work is most of what a busy server's process does."""

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take_all(self) -> list:
        """Every item that has arrived, once at least one has: a stream that fell behind
        the engine catches up in one write instead of one per token."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items
