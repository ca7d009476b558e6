"""The name of a full page's content: a digest of its tokens chained with the digest of
the page before it, so equal digests mean equal tokens from position 0 on, and so equal
keys and values in the cache. 128-bit BLAKE2b: a collision (two contents, one name) would
hand a request another's cache, so the name is a cryptographic digest, not ``hash``."""

import hashlib
from array import array

DIGEST_BYTES = 16


def page_digests(request, num_pages: int, page_size: int) -> list[bytes]:
    """The digests of ``request``'s first ``num_pages`` pages (prompt then output tokens),
    computed once each and kept on the request."""
    digests = request.page_digests
    for page in range(len(digests), num_pages):
        tokens = _tokens(request.prompt, request.output, page * page_size, (page + 1) * page_size)
        parent = digests[-1] if digests else b""
        digests.append(hashlib.blake2b(parent + array("q", tokens).tobytes(),
                                       digest_size=DIGEST_BYTES).digest())
    return digests[:num_pages]


def _tokens(prompt, output, start: int, end: int) -> list[int]:
    split = len(prompt)
    return [*prompt[start:min(end, split)], *output[max(start - split, 0):max(end - split, 0)]]
