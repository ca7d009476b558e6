"""Hypothesis strategies for decode batches, extend batches and block tables.

Every drawn batch is realistic: each request owns distinct non-null pages, exactly as
many as its positions need.
"""

import attrs
from hypothesis import strategies as st

from tokenspeed.backends.metadata import DecodeRow, ExtendChunk

PAGE_SIZES = (1, 2, 4, 8, 16)


@attrs.frozen
class DecodeCase:
    rows: tuple[DecodeRow, ...]
    num_rows: int          # padded size >= len(rows)
    max_pages: int
    page_size: int


@attrs.frozen
class VerifyCase:
    lengths: tuple[int, ...]           # each request's tokens (its last one not cached)
    pages: tuple[tuple[int, ...], ...]
    drafts: tuple[tuple[int, ...], ...]
    num_rows: int
    max_pages: int
    page_size: int


@attrs.frozen
class ExtendCase:
    chunks: tuple[ExtendChunk, ...]
    num_rows: int
    max_pages: int
    page_size: int


def page_sizes():
    return st.sampled_from(PAGE_SIZES)


@st.composite
def _owned_pages(draw, lengths, page_size):
    """Distinct non-null pages for requests holding ``lengths`` tokens each."""
    counts = [-(-n // page_size) for n in lengths]
    pool = draw(st.permutations(range(1, sum(counts) + 1 + draw(st.integers(0, 8)))))
    out, i = [], 0
    for c in counts:
        out.append(tuple(pool[i:i + c]))
        i += c
    return out


@st.composite
def decode_cases(draw, max_batch: int = 12, max_len: int = 64):
    page_size = draw(page_sizes())
    lengths = draw(st.lists(st.integers(1, max_len), min_size=0, max_size=max_batch))
    pages = draw(_owned_pages(lengths, page_size))
    rows = tuple(DecodeRow(draw(st.integers(0, 999)), n - 1, p) for n, p in zip(lengths, pages))
    num_rows = len(rows) + draw(st.integers(0 if rows else 1, 8))
    max_pages = -(-max_len // page_size) + draw(st.integers(0, 2))
    return DecodeCase(rows, num_rows, max_pages, page_size)


@st.composite
def verify_cases(draw, max_batch: int = 8, max_len: int = 48, max_window: int = 5):
    """A verify batch: each request (``lengths`` tokens, its cache one short) verifies a
    window of its last token and ``widths - 1`` drafts; its pages cover the window and a
    next one as wide."""
    page_size = draw(page_sizes())
    lengths = draw(st.lists(st.integers(1, max_len), min_size=0, max_size=max_batch))
    widths = [draw(st.integers(1, max_window)) for _ in lengths]
    pages = draw(_owned_pages([n + 2 * w - 1 for n, w in zip(lengths, widths)], page_size))
    drafts = [tuple(draw(st.lists(st.integers(0, 999), min_size=w - 1, max_size=w - 1))) for w in widths]
    num_rows = sum(widths) + draw(st.integers(0 if lengths else 1, 8))
    max_pages = -(-(max_len + 2 * max_window) // page_size) + draw(st.integers(0, 2))
    return VerifyCase(tuple(lengths), tuple(pages), tuple(drafts), num_rows, max_pages, page_size)


@st.composite
def extend_cases(draw, max_requests: int = 6, max_len: int = 48):
    page_size = draw(page_sizes())
    starts = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_requests))
    news = [draw(st.integers(1, max_len)) for _ in starts]
    pages = draw(_owned_pages([s + n for s, n in zip(starts, news)], page_size))
    chunks = tuple(ExtendChunk(tuple(draw(st.lists(st.integers(0, 999), min_size=n, max_size=n))),
                               s, p, draw(st.booleans())) for s, n, p in zip(starts, news, pages))
    num_rows = sum(news) + draw(st.integers(0, 8))
    return ExtendCase(chunks, num_rows, -(-2 * max_len // page_size), page_size)


@st.composite
def block_tables(draw, max_requests: int = 6, max_pages: int = 8, max_page: int = 64):
    """Page lists of 1..``max_requests`` requests, 1..``max_pages`` each, from pages
    1..``max_page``: distinct non-null pages, as every batch here (no two requests, nor two
    entries of one, share a page: a kernel test over shared pages fails for the wrong
    reason). Requests stop where the pages run out."""
    left, counts = max_page, []
    for _ in range(draw(st.integers(1, max_requests))):
        if left == 0:
            break
        counts.append(draw(st.integers(1, min(max_pages, left))))
        left -= counts[-1]
    pool = draw(st.permutations(range(1, max_page + 1)))
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(pool[s:s + c]) for s, c in zip(starts, counts)]

