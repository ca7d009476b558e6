"""Checkers for the padding, slot and request status invariants; each raises AssertionError naming the row."""

import torch

from tokenspeed.backends.metadata import NULL_PAGE
from tokenspeed.scheduling.request import RequestStatus


def slot_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    return slots // page_size


def check_padding_rows_null(meta, num_live: int, page_size: int) -> None:
    """Rows ``[num_live, rows)`` write into page 0 and read through all-null table rows."""
    pages = slot_pages(meta.slot_mapping[num_live:], page_size)
    bad = (pages != NULL_PAGE).nonzero().flatten().tolist()
    assert not bad, f"padding rows {[num_live + b for b in bad]} write outside the null page"
    tables = meta.block_tables[meta.row_request[num_live:]]
    assert bool((tables == NULL_PAGE).all()), "a padding row reads through a non-null table row"


def check_table_tails_null(meta, pages_per_row) -> None:
    for row, pages in enumerate(pages_per_row):
        tail = meta.block_tables[row, len(pages):]
        assert bool((tail == NULL_PAGE).all()), f"table row {row} has a non-null tail {tail.tolist()}"


def check_no_write_into_live_pages(meta, num_live: int, live_pages, page_size: int) -> None:
    live = {p for pages in live_pages for p in pages}
    written = set(slot_pages(meta.slot_mapping[num_live:], page_size).tolist())
    assert not written & live, f"padding rows write into live pages {sorted(written & live)}"


def check_live_rows_equal(a, b, num_live: int, fields) -> None:
    for name in fields:
        x, y = getattr(a, name)[:num_live], getattr(b, name)[:num_live]
        assert torch.equal(x, y), f"field {name} differs on live rows: {x.tolist()} vs {y.tolist()}"


def check_chained_rows_match_pages(engine) -> None:
    """The decode step in flight, if chained on the one before (its rows moved on a position,
    not rebuilt: ``engine/decode_chain.py``), holds each unfinished request's row as it
    stands. The step it is chained on is not read yet (``Engine.unread``), so the row sits
    at the count of the request's tokens the host has read, the last position counted as
    cached (its input is the unread token, ahead of the one the row samples), on a page it
    holds; its table row is its page lists as they are; no page wholly behind a windowed
    group's window is held."""
    flight, scheduler = engine.in_flight, engine.scheduler
    if flight is None or flight.columns is None:
        return
    assert engine.unread is not None, "a chained decode step, but the step before it was read"
    tables = flight.columns.block_tables
    tables = tables[:, None] if tables.ndim == 2 else tables
    for row, request in enumerate(flight.sampled):
        if request.finished:
            continue
        position = int(flight.columns.positions[row])
        assert position == request.num_known_tokens == request.num_cached - 1 == request.num_tokens - 2, \
            f"row {row} at position {position}, its request has {request.num_known_tokens} tokens read, " \
            f"{request.num_unread} unread, {request.num_cached} cached"
        for group, (pages, retention) in enumerate(zip(request.page_lists(), scheduler.retentions)):
            held = tables[row, group].tolist()
            assert held[:len(pages)] == pages and set(held[len(pages):]) <= {NULL_PAGE}, \
                f"row {row}, group {group}: table {held} for pages {pages}"
            assert held[position // scheduler.page_size] != NULL_PAGE, \
                f"row {row}, group {group}: position {position} writes into the null page ({pages})"
            behind = max(position - retention, 0) // scheduler.page_size if retention else 0
            assert set(pages[:behind]) <= {NULL_PAGE}, \
                f"row {row}, group {group}: pages {pages[:behind]} wholly behind its window are held"


def check_status_matches_state(scheduler, requests) -> None:
    """Each request's status agrees with where it is and what it holds: a queued request is
    waiting (never run: no output) or preempted, and holds no pages; a running one decodes
    exactly when at most one of its tokens is left to compute; a finished one has a
    finish reason and is in no queue."""
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), \
            f"request {request.id} is waiting with status {request.status}"
        assert request.status is RequestStatus.PREEMPTED or not request.output, \
            f"request {request.id} is waiting, never run, with output {request.output}"
    for request in scheduler.running:
        expected = RequestStatus.DECODING if request.num_uncached <= 1 else RequestStatus.PREFILLING
        assert request.status is expected, f"request {request.id} is running with status " \
            f"{request.status}, {request.num_uncached} tokens left to compute"
    queued = {id(r) for r in [*scheduler.waiting, *scheduler.running]}
    for request in requests:
        done = request.status is RequestStatus.FINISHED
        assert done == (request.finish_reason is not None) and done != (id(request) in queued), \
            f"request {request.id}: status {request.status}, finish reason {request.finish_reason}, " \
            f"queued: {id(request) in queued}"
