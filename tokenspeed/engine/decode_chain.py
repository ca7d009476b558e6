"""A chained decode step's rows, from the rows of the step in flight.

While the same requests decode step after step, each row moves on one position and keeps
its block table row, except at a page boundary, where its request takes a page (and, in a
windowed cache group, returns one behind its window). Deriving the next step's columns
from the last step's leaves Python only those rows; rebuilding every row from its
request's page lists (a ``DecodeRow`` each, then their tables) was about a third of the
host time of a 64-row chained step (CPU).
"""

import numpy as np

from tokenspeed.backends.metadata import DecodeColumns


def next_columns(columns: DecodeColumns, kept: list[int] | None, requests, scheduler) -> DecodeColumns | None:
    """The columns of the step chained on ``columns``' for ``requests`` (its rows ``kept``,
    all if None), their input tokens fed on the device (no tokens on the host); None, with
    nothing taken from the rows not yet grown, when a request at a page boundary finds no
    page."""
    positions = columns.positions + 1 if kept is None else columns.positions[kept] + 1
    tables = columns.block_tables.copy() if kept is None else columns.block_tables[kept]
    for row in np.flatnonzero(scheduler.pages_may_change(positions)).tolist():
        request = requests[row]
        if not scheduler.grow(request, int(positions[row]) + 1):
            return None
        write_table_row(tables[row], request.page_lists())
    return DecodeColumns(None, positions, tables, columns.seats if kept is None else columns.seats[kept])


def write_table_row(row: np.ndarray, page_lists: list[list[int]]) -> None:
    """A request's block table row from its page lists (a group's on each of ``row``'s
    rows when there are several); entries past a list stay as they were (pages are only
    added at the end)."""
    rows = row[None] if row.ndim == 1 else row
    for group, pages in enumerate(page_lists):
        rows[group, :len(pages)] = pages
