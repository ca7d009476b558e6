"""Recurrent states kept at page boundaries, so that a cached prefix resumes a hybrid model.

A cached prefix's pages resume attention layers; a recurrent layer keeps no per-token
cache, only its state after the last token it read, so resuming it needs that state at
exactly the prefix's end. Such states live in the state pools' slots past the seats
(``first_slot`` on), a checkpoint each. A running request holds one as its mark: its
state at the last page boundary it passed, copied from its seat as each boundary passes
(prompt chunks end at page boundaries, ``Scheduler._take``, so every one passes between
two steps). When it lets go (finish, abort, preemption) the mark is kept under the
digest of the page it ends, as a full page is; a later request whose cached pages reach
that page copies the state into its seat before its first chunk and computes from there.

Checkpoint slots are handed out, shared and kept as pages are (a ``BlockAllocator`` of
their own: a kept one nobody holds is evicted, least recently kept first, when a mark
needs a slot). A request that finds no slot free runs without a mark: its state is simply
not kept. Copies are (source slot, destination slot) pairs the engine makes on the
device, in stream order with the steps around them.
"""

import attrs

from tokenspeed.scheduling.block_allocator import BlockAllocator, OutOfPages


@attrs.define
class Mark:
    """A running request's checkpoint and how many of its tokens the state there covers."""
    checkpoint: int
    tokens: int = 0


class StateCheckpoints:
    def __init__(self, first_slot: int, count: int):
        if count < 1:
            raise ValueError(f"state checkpoints: count={count}, need at least 1")
        self.first_slot, self.count = first_slot, count
        self._slots = BlockAllocator(count + 1)   # ids 1..count (its id 0 is unused)
        self._marks: dict[object, Mark] = {}         # by request
        self._restores: dict[object, int] = {}       # by request: the checkpoint its seat takes first

    def slot(self, checkpoint: int) -> int:
        return self.first_slot + checkpoint - 1

    @property
    def num_kept(self) -> int:
        return self._slots.num_cached

    def holders(self, checkpoint: int) -> int:
        return self._slots.holders(checkpoint)

    def take_mark(self, request) -> None:
        """A slot for ``request``'s mark, if one is free (or kept and unheld)."""
        try:
            self._marks[request] = Mark(self._slots.allocate(1)[0])
        except OutOfPages:
            pass

    def resumable(self, request, digests: list[bytes], pages: int) -> int:
        """The most of ``pages`` leading pages (named by ``digests``) whose end has a kept
        state; that state is held for ``request`` until ``restores`` copies it."""
        kept = self._slots.cached_pages(digests[:pages])
        found = next((n for n in range(pages, 0, -1) if kept[n - 1] is not None), 0)
        if found:
            self._restores[request] = self._slots.share([kept[found - 1]])[0]
        return found

    def restores(self, requests) -> list[tuple[int, int]]:
        """The copies into the seats of ``requests`` that resume a kept state (before their
        first chunk's launch); the states are let go once copied."""
        copies = []
        for request in requests:
            checkpoint = self._restores.pop(request, None)
            if checkpoint is not None:
                copies.append((self.slot(checkpoint), request.seat))
                self._slots.free([checkpoint])
        return copies

    def marks(self, requests, page_size: int) -> list[tuple[int, int]]:
        """The copies from the seats of ``requests`` whose launched rows end at a page
        boundary they had not reached (after the launch, before the next)."""
        copies = []
        for request in requests:
            mark = self._marks.get(request)
            if mark is not None and request.num_cached % page_size == 0 and request.num_cached > mark.tokens:
                mark.tokens = request.num_cached
                copies.append((request.seat, self.slot(mark.checkpoint)))
        return copies

    def marked(self, request) -> int:
        """The tokens ``request``'s mark holds the state of (0: none yet, or no mark)."""
        mark = self._marks.get(request)
        return 0 if mark is None else mark.tokens

    def release(self, request, digest: bytes | None) -> None:
        """``request`` lets go: its mark is kept under ``digest`` (the page it ends; None:
        its tokens are not all known, so nothing is kept), a state held for it returns."""
        restore = self._restores.pop(request, None)
        if restore is not None:
            self._slots.free([restore])
        mark = self._marks.pop(request, None)
        if mark is not None:
            if digest is not None and mark.tokens:
                self._slots.remember(mark.checkpoint, digest)
            self._slots.free([mark.checkpoint])
