"""Pure functions that build metadata descriptors: the only way decode or extend metadata
comes to exist.

Padding is explicit: a batch is padded to ``num_rows`` and every padding row reads and
writes through the null page (page 0), so nothing a padding row does can touch a live
request's pages.
"""

from collections.abc import Iterable, Sequence
from itertools import chain

import attrs
import numpy as np
import torch

from tokenspeed.errors import InternalError
from tokenspeed.ir.descriptors import DecodeMetadata, ExtendMetadata

NULL_PAGE = 0
NULL_SLOT = 0   # of the recurrent state pools (``ir.ops``), the null seat's: what padding rows read as zeros and write
EXTEND_TILE_ROWS = 64   # rows per tile of the extend attention kernel (its BLOCK_M)
FED_INPUT = 0   # a fed row's input id in host metadata: the device's copy replaces it before any kernel reads it


@attrs.frozen
class DecodeRow:
    """``token``: the row's input, None when it is fed on the device (an unread token:
    ``execution/token_column.py``); ``pages``: the request's pages of cache group 0;
    ``group_pages``: those of groups 1.. (as many entries each: a windowed group's dropped
    ones are the null page); ``seat``: its request's seat, the slot of its recurrent state
    (``NULL_SLOT`` where no request's)."""
    token: int | None
    position: int
    pages: tuple[int, ...]
    group_pages: tuple[tuple[int, ...], ...] = ()
    seat: int = NULL_SLOT


@attrs.frozen
class ExtendChunk:
    """``tokens`` at positions ``start ..``, then, when ``fed``, one row whose input is
    fed on the device (the request's unread token); ``completes`` when the chunk ends the
    request's tokens, so its last row is sampled; pages as ``DecodeRow``'s."""
    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    completes: bool
    group_pages: tuple[tuple[int, ...], ...] = ()
    fed: bool = False
    seat: int = NULL_SLOT

    @property
    def num_rows(self) -> int:
        return len(self.tokens) + self.fed

    @property
    def input_ids(self) -> tuple[int, ...]:
        """Its rows' input ids in host metadata (a fed row's is ``FED_INPUT``)."""
        return (*self.tokens, FED_INPUT) if self.fed else self.tokens


def write_locations(block_tables, row_request, positions, page_size: int):
    """``slot = table[req, pos // P] * P + pos % P``: the one owner of the slot formula (over
    torch tensors or, as the refresh functions build them on the host, numpy arrays)."""
    pages = block_tables[row_request, positions // page_size]   # int32; slots may pass 2**31
    pages = pages.astype(np.int64) if isinstance(pages, np.ndarray) else pages.long()
    return pages * page_size + positions % page_size


def block_table(pages: Sequence[Sequence[int]], num_rows: int, max_pages: int) -> np.ndarray:
    """Rows of page ids; table tails and rows past ``len(pages)`` are the null page.

    It runs on every decode step, so every row's pages go over in one conversion and one
    masked write (row-major, as the mask enumerates them), not an array per row.
    """
    lengths = np.fromiter(map(len, pages), np.int64, len(pages))
    width = _table_width(lengths, num_rows, max_pages)
    table = np.full((num_rows, max_pages), NULL_PAGE, dtype=np.int32)
    if width:
        live = np.arange(width) < lengths[:, None]
        table[:len(lengths), :width][live] = np.fromiter(chain.from_iterable(pages), np.int32, int(lengths.sum()))
    return table


def stacked_block_table(lists: Sequence[Sequence[Sequence[int]]], num_groups: int, num_rows: int,
                        max_pages: int) -> np.ndarray:
    """``block_table`` of several cache groups in one ``[num_rows, num_groups, max_pages]``
    array: ``lists`` holds each row's page lists of every group, of one length."""
    lengths = np.fromiter((len(row[0]) for row in lists), np.int64, len(lists))
    width = _table_width(lengths, num_rows, max_pages)
    table = np.full((num_rows, num_groups, max_pages), NULL_PAGE, dtype=np.int32)
    if width:
        live = np.broadcast_to((np.arange(width) < lengths[:, None])[:, None], (len(lengths), num_groups, width))
        pages = chain.from_iterable(chain.from_iterable(lists))
        table[:len(lengths), :, :width][live] = np.fromiter(pages, np.int32, int(lengths.sum()) * num_groups)
    return table


def _table_width(lengths: np.ndarray, num_rows: int, max_pages: int) -> int:
    width = int(lengths.max(initial=0))
    if width > max_pages:
        raise InternalError(f"request holds {width} pages, table width is {max_pages}")
    if len(lengths) > num_rows:
        raise InternalError(f"{len(lengths)} rows do not fit in a table of {num_rows}")
    return width


def _padded(values: Iterable[int] | np.ndarray, count: int, length: int, fill: int = 0) -> np.ndarray:
    """``count`` int64 values, then ``fill`` up to ``length``."""
    if count > length:
        raise InternalError(f"{count} rows do not fit in a batch of {length}")
    column = np.full(length, fill, dtype=np.int64)
    column[:count] = values if isinstance(values, np.ndarray) else np.fromiter(values, np.int64, count)
    return column


def _on(device, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
    """The host-built arrays as tensors on ``device``. Host metadata is built in numpy, whose
    small operations cost about a microsecond where torch's cost five to ten: a decode
    step's refresh of 64 rows of 19 pages took 280 us in torch, 130 us so (CPU)."""
    return {name: torch.from_numpy(a).to(device) for name, a in arrays.items()}


def group_tables(items, num_groups: int, num_rows: int, max_pages: int, page_size: int, row_request,
                 positions):
    """Block tables and write locations of ``items`` (rows or chunks) in each of
    ``num_groups`` cache groups: one group's as they are, several stacked on dim 1
    (``[rows, groups, pages]`` and ``[rows, groups]``), where each layer reads its group's
    column. Every item brings a page list per group, each as long as its ``pages``."""
    tables = item_tables(items, num_groups, num_rows, max_pages)
    return tables, table_slots(tables, row_request, positions, page_size)


def item_tables(items, num_groups: int, num_rows: int, max_pages: int) -> np.ndarray:
    """``group_tables``' block tables alone."""
    if num_groups == 1:   # every decode step's host time: nothing more than before groups
        return block_table([r.pages for r in items], num_rows, max_pages)
    for i, item in enumerate(items):
        if len(item.group_pages) != num_groups - 1 or any(len(p) != len(item.pages) for p in item.group_pages):
            raise InternalError(f"row {i}: pages of {1 + len(item.group_pages)} cache groups, of "
                                f"{[len(item.pages), *map(len, item.group_pages)]} pages; the model has "
                                f"{num_groups} groups, and every list has one entry per page")
    return stacked_block_table([(r.pages, *r.group_pages) for r in items], num_groups, num_rows, max_pages)


def table_slots(tables: np.ndarray, row_request, positions, page_size: int) -> np.ndarray:
    """``group_tables``' write locations of ``tables`` (one group's, or stacked)."""
    if tables.ndim == 2:
        return write_locations(tables, row_request, positions, page_size)
    slots = [write_locations(tables[:, g], row_request, positions, page_size) for g in range(tables.shape[1])]
    return np.stack(slots, axis=1)


@attrs.frozen(eq=False)
class DecodeColumns:
    """Decode rows as the columns ``refresh_decode`` pads: the form a decode chain keeps
    from step to step (``engine/decode_chain.py``), moving each row on a position rather
    than rebuilding every row's table from its page lists. ``tokens``: None when every
    row's input is fed on the device; ``block_tables``: ``max_pages`` page ids per row, per
    cache group on dim 1 when there are several (``group_tables``); ``seats``: each row's
    request's seat (``DecodeRow.seat``)."""
    tokens: np.ndarray | None  # int64
    positions: np.ndarray     # int64
    block_tables: np.ndarray  # int32
    seats: np.ndarray         # int64

    def __len__(self) -> int:
        return len(self.positions)


def decode_columns(rows: Sequence[DecodeRow], max_pages: int, num_groups: int = 1) -> DecodeColumns:
    """Rows are fed whole or not at all (a decode step's inputs are all unread or all known)."""
    n = len(rows)
    fed = sum(r.token is None for r in rows)
    if fed not in (0, n):
        raise InternalError(f"{fed} of {n} decode rows fed on the device: a step is fed whole or not at all")
    return DecodeColumns(np.fromiter((r.token for r in rows), np.int64, n) if not fed else None,
                         np.fromiter((r.position for r in rows), np.int64, n),
                         item_tables(rows, num_groups, n, max_pages), np.fromiter((r.seat for r in rows), np.int64, n))


def refresh_decode(rows: Sequence[DecodeRow] | DecodeColumns, num_rows: int, max_pages: int, page_size: int,
                   device="cpu", num_groups: int = 1) -> DecodeMetadata:
    """Decode metadata for ``rows`` padded to ``num_rows``; no rows is the idle refresh
    used for capture (placeholder tables of null pages). ``num_groups``: the model's cache
    groups (``group_tables``)."""
    columns = rows if isinstance(rows, DecodeColumns) else decode_columns(rows, max_pages, num_groups)
    count, live_tables = len(columns), columns.block_tables
    if live_tables.shape[1:] != ((max_pages,) if num_groups == 1 else (num_groups, max_pages)):
        raise InternalError(f"block tables of shape {tuple(live_tables.shape[1:])} per row; the model's "
                            f"are {max_pages} pages in each of {num_groups} cache groups")
    every_row = np.arange(num_rows, dtype=np.int64)
    positions = _padded(columns.positions, count, num_rows)
    tables = np.full((num_rows, *live_tables.shape[1:]), NULL_PAGE, dtype=np.int32)
    tables[:count] = live_tables
    return DecodeMetadata(num_live_rows=count, **_on(
        device, input_ids=_padded(columns.tokens, count, num_rows) if columns.tokens is not None else
        np.full(num_rows, FED_INPUT, np.int64), positions=positions,
        slot_mapping=table_slots(tables, every_row, positions, page_size), block_tables=tables,
        row_request=every_row, state_slots=_padded(columns.seats, count, num_rows, NULL_SLOT),
        sample_rows=every_row.copy()))


def plan_extend(chunks: Sequence[ExtendChunk], num_rows: int, num_table_rows: int,
                max_pages: int, page_size: int, view_width: int = 1,
                num_view_rows: int | None = None, device="cpu",
                tile_rows: int = EXTEND_TILE_ROWS, max_chunks: int | None = None,
                num_groups: int = 1) -> ExtendMetadata:
    """Extend metadata for ``chunks`` padded to ``num_rows`` token rows.

    The decoder view keeps the last ``view_width`` rows of each completing chunk and the
    last row of each open chunk; padding token rows read through the null table row
    ``num_table_rows - 1``. The attention tiles (``attention_tiles``) hold up to
    ``tile_rows`` rows of one chunk each, over the token rows and over the view; padding
    rows are in no tile, except in the plan of no chunks (captures and the startup's dry
    run), whose tiles cover them: those walks launch the kernel real steps will. Both
    plans end in empty tiles up to ``tile_capacity`` of their rows and of ``max_chunks``
    (the most chunks a step holds; default: the table's chunk rows), so the kernel's grid
    is fixed by the shapes: a captured graph launches it over every plan of its bucket.
    """
    if num_table_rows <= len(chunks):
        raise InternalError(f"{len(chunks)} chunks need {len(chunks) + 1} table rows "
                            f"(one is the null row), got {num_table_rows}")
    max_chunks = num_table_rows - 1 if max_chunks is None else max_chunks
    if len(chunks) > max_chunks:
        raise InternalError(f"{len(chunks)} chunks in one step; a step holds at most {max_chunks}")
    lengths = np.fromiter((c.num_rows for c in chunks), np.int64, len(chunks))
    starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
    completes = np.fromiter((c.completes for c in chunks), bool, len(chunks))
    _check_pages(chunks, starts + lengths, page_size)
    ends, rows = np.cumsum(lengths), int(lengths.sum())
    view, view_samples, kept = _decoder_view(lengths, ends, completes, view_width)
    positions = _padded(np.arange(rows) - np.repeat(ends - lengths - starts, lengths), rows, num_rows)
    row_request = _padded(np.repeat(np.arange(len(chunks)), lengths), rows, num_rows, num_table_rows - 1)
    tables, slots = group_tables(chunks, num_groups, num_table_rows, max_pages, page_size, row_request, positions)
    num_view_rows = len(view) if num_view_rows is None else num_view_rows
    return ExtendMetadata(num_live_rows=rows, num_live_view_rows=len(view), **_on(
        device, input_ids=_padded(chain.from_iterable(c.input_ids for c in chunks), rows, num_rows),
        positions=positions, slot_mapping=slots,
        block_tables=tables, row_request=row_request,
        state_slots=_padded(np.repeat(np.fromiter((c.seat for c in chunks), np.int64, len(chunks)), lengths),
                            rows, num_rows, NULL_SLOT),
        sample_rows=ends[completes] - 1,
        view_rows=_padded(view, len(view), num_view_rows, num_rows - 1),
        view_sample_rows=view_samples,
        attention_tiles=attention_tiles(lengths if chunks else np.array([num_rows]), tile_rows,
                                        tile_capacity(num_rows, max_chunks, tile_rows)),
        view_attention_tiles=attention_tiles(kept if chunks else np.array([num_view_rows]), tile_rows,
                                             tile_capacity(num_view_rows, max_chunks, tile_rows))))


def tile_capacity(num_rows: int, max_runs: int, tile_rows: int = EXTEND_TILE_ROWS) -> int:
    """The most tiles ``num_rows`` rows in at most ``max_runs`` runs are cut into: each
    run's last tile may be partial."""
    return -(-num_rows // tile_rows) + min(num_rows, max_runs)


def tile_plan_length(num_rows: int, max_chunks: int) -> int:
    """Entries of ``plan_extend``'s tile plan over ``num_rows`` rows: the first row of each
    of ``tile_capacity`` tiles, then the rows covered."""
    return tile_capacity(num_rows, max_chunks) + 1


def attention_tiles(run_lengths: np.ndarray, tile_rows: int, capacity: int | None = None) -> np.ndarray:
    """Consecutive runs of rows, ``run_lengths[i]`` rows each, cut into tiles of at most
    ``tile_rows`` rows of one run: the first row of every tile, then empty tiles up to
    ``capacity`` (each starting where the rows end), then the rows covered."""
    starts = np.cumsum(run_lengths) - run_lengths
    tiles_per_run = -(-run_lengths // tile_rows)
    first_tile = np.cumsum(tiles_per_run) - tiles_per_run
    tiles = int(tiles_per_run.sum())
    if capacity is not None and tiles > capacity:
        raise InternalError(f"{tiles} attention tiles do not fit a plan of {capacity}")
    run = np.repeat(np.arange(len(run_lengths)), tiles_per_run)
    firsts = starts[run] + (np.arange(tiles) - first_tile[run]) * tile_rows
    return _padded(firsts, tiles, (tiles if capacity is None else capacity) + 1,
                   int(run_lengths.sum())).astype(np.int32)


def _check_pages(chunks: Sequence[ExtendChunk], ends: np.ndarray, page_size: int) -> None:
    """A position past a chunk's pages would resolve to the null page, shared with padding
    (``ends``: where each chunk's positions end)."""
    held = np.fromiter((len(c.pages) for c in chunks), np.int64, len(chunks))
    short = np.flatnonzero(ends > held * page_size)
    if len(short):
        i, end = int(short[0]), int(ends[short[0]])
        raise InternalError(f"chunk {i}: positions up to {end - 1} need {-(-end // page_size)} "
                            f"pages of {page_size} tokens, it holds {held[i]}")


def kept_rows(chunk: ExtendChunk, width: int) -> int:
    """Rows of ``chunk`` in the decoder view: the last ``width`` if it completes, else one."""
    return min(width if chunk.completes else 1, chunk.num_rows)


def _decoder_view(lengths: np.ndarray, ends: np.ndarray, completes: np.ndarray, width: int):
    """The view's token rows, its sampled rows (indices into the view), and how many rows
    each chunk keeps: ``kept_rows`` over the chunks' arrays (a loop over the chunks took
    about a third of a 64-chunk step's plan)."""
    kept = np.minimum(np.where(completes, width, 1), lengths)
    last = np.cumsum(kept)
    view = np.repeat(ends - last, kept) + np.arange(int(last[-1]) if len(last) else 0)
    return view, (last - 1)[completes], kept
