"""Pages of the KV pool: handed out, shared, taken back, and kept for reuse.

A page several requests hold (the prompt pages of ``n`` samples, a prefix found in the
cache) is counted once per holder. A full page whose content is known (``remember``: the
digest of its tokens, chained with every page before it) stays cached when its last holder
lets go: a later request whose tokens chain to the same digest takes it back
(``cached_prefix``) instead of computing it. Cached pages nobody holds are evicted, least
recently released first, only when the free pages run out; a held page is never evicted,
and page 0 (the null page) is never handed out, shared or cached.
"""

from collections import OrderedDict

from tokenspeed.backends.metadata import NULL_PAGE
from tokenspeed.errors import InternalError


class OutOfPages(RuntimeError):
    """Raised before any page changes hands: the allocator's state is as it was."""


class BlockAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the null page)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._holders: dict[int, int] = {}
        self._unheld_cached: OrderedDict[int, None] = OrderedDict()   # oldest release first
        self._digest_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages an ``allocate`` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._unheld_cached)

    @property
    def num_cached(self) -> int:
        return len(self._digest_of)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} of {self.num_pages - 1} free")
        pages = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        self._holders.update(dict.fromkeys(pages, 1))
        return pages

    def share(self, pages) -> list[int]:
        """One more holder of each of ``pages`` (held or cached); returns them."""
        pages = list(pages)
        for page in pages:
            if page not in self._holders and page not in self._unheld_cached:
                raise InternalError(f"page {page} is neither allocated nor cached")
        for page in pages:
            self._unheld_cached.pop(page, None)
            self._holders[page] = self._holders.get(page, 0) + 1
        return pages

    def free(self, pages) -> None:
        for page in pages:
            if page not in self._holders:
                raise InternalError(f"page {page} is not allocated")
            self._holders[page] -= 1
            if not self._holders[page]:
                del self._holders[page]
                if page in self._digest_of:
                    self._unheld_cached[page] = None
                else:
                    self._free.append(page)

    def holders(self, page: int) -> int:
        return self._holders.get(page, 0)

    def remember(self, page: int, digest: bytes) -> None:
        """``page`` (held, full) holds the tokens ``digest`` names; the first page to
        hold a content is the one kept."""
        if page in self._holders and digest not in self._page_of and page not in self._digest_of:
            self._page_of[digest], self._digest_of[page] = page, digest

    def cached_prefix(self, digests) -> list[int]:
        """The cached pages of the longest run of ``digests`` from the first."""
        pages = []
        for digest in digests:
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def cached_pages(self, digests) -> list[int | None]:
        """The cached page of each of ``digests``, None where there is none (a windowed
        cache group needs only the pages inside its window, not a whole prefix)."""
        return [self._page_of.get(d) for d in digests]

    def _evict(self) -> int:
        page, _ = self._unheld_cached.popitem(last=False)
        del self._page_of[self._digest_of.pop(page)]
        return page
