"""The name of a full page's content: a digest of its tokens chained with the digest of
the page before it, so equal digests mean equal tokens from position 0 on, and so equal
keys and values in the cache. 128-bit BLAKE2b: a collision (two contents, one name) would
hand a request another's cache, so the name is a cryptographic digest, not ``hash``."""

import hashlib
from array import array
from collections import OrderedDict

DIGEST_BYTES = 16
TOKEN_BYTES = 8      # a token id as a signed 64-bit integer
REMEMBERED_REQUESTS = 64


class PageDigests:
    """The digests of requests' full pages (prompt then output tokens), computed once each
    and kept on the request.

    A conversation's next turn repeats its history: its first thousands of tokens are an
    earlier request's, whose digests are known (at about 2 us a page, an 8k-token history
    took 1.1 ms of the follow-up's time to first token on the H200's host). So the latest
    requests are remembered by their first page's digest, and a new request copies the
    digests of the pages whose tokens, compared byte for byte, equal such a request's: an
    exact match, so no digest is trusted that its own tokens would not give."""

    def __init__(self, page_size: int, remembered: int = REMEMBERED_REQUESTS):
        self.page_size, self.remembered = page_size, remembered
        self._by_first_page: OrderedDict[bytes, object] = OrderedDict()   # a Request each

    def __call__(self, request, num_pages: int) -> list[bytes]:
        """The digests of ``request``'s first ``num_pages`` pages."""
        digests = request.page_digests
        if len(digests) < num_pages:
            start = len(digests) * self.page_size
            data = _token_bytes(request.prompt, request.output, start, num_pages * self.page_size)
            offset = self._copy_known(request, data) if not digests else 0
            _chain(digests, data, offset, self.page_size * TOKEN_BYTES)
            request.page_tokens += data
        return digests[:num_pages]

    def _copy_known(self, request, data: bytes) -> int:
        """Fill ``request``'s leading digests from the latest request with the same first
        page, as far as their tokens agree; how many bytes of ``data`` that covered."""
        step = self.page_size * TOKEN_BYTES
        _chain(request.page_digests, data[:step], 0, step)
        first = request.page_digests[0]
        known = self._by_first_page.get(first)
        self._by_first_page[first] = request
        self._by_first_page.move_to_end(first)
        if len(self._by_first_page) > self.remembered:
            self._by_first_page.popitem(last=False)
        if known is None:
            return step
        pages = _common_pages(data, known.page_tokens, step)
        request.page_digests[1:] = known.page_digests[1:pages]
        return max(pages, 1) * step


def _chain(digests: list, data: bytes, offset: int, step: int) -> None:
    parent = digests[-1] if digests else b""
    for at in range(offset, len(data), step):
        parent = hashlib.blake2b(parent + data[at:at + step], digest_size=DIGEST_BYTES).digest()
        digests.append(parent)


def _common_pages(a: bytes, b: bytes, step: int) -> int:
    """How many leading pages of ``step`` bytes ``a`` and ``b`` share (memcmp, and a
    bisection only where they differ)."""
    lo, hi = 0, min(len(a), len(b)) // step
    if a[:hi * step] == b[:hi * step]:
        return hi
    while lo + 1 < hi:   # a[:lo] agrees, a[:hi] does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid * step] == b[:mid * step] else (lo, mid)
    return lo


def _token_bytes(prompt, output, start: int, end: int) -> bytes:
    split = len(prompt)
    tokens = array("q", prompt[start:min(end, split)])
    tokens.extend(output[max(start - split, 0):max(end - split, 0)])
    return tokens.tobytes()
