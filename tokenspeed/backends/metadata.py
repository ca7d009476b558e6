"""Pure functions that build metadata descriptors: the only way decode or extend metadata
comes to exist.

Padding is explicit: a batch is padded to ``num_rows`` and every padding row reads and
writes through the null page (page 0), so nothing a padding row does can touch a live
request's pages.
"""

import struct
from collections.abc import Iterable, Sequence
from itertools import chain

import attrs
import torch

from tokenspeed.ir.descriptors import DecodeMetadata, ExtendMetadata

NULL_PAGE = 0


@attrs.frozen
class DecodeRow:
    token: int
    position: int
    pages: tuple[int, ...]


@attrs.frozen
class ExtendChunk:
    """``tokens`` at positions ``start ..``; ``completes`` when the chunk ends the prompt,
    so its last row is sampled."""
    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    completes: bool


def write_locations(block_tables: torch.Tensor, row_request: torch.Tensor,
                    positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """``slot = table[req, pos // P] * P + pos % P``: the one owner of the slot formula."""
    pages = block_tables[row_request, positions // page_size]
    return (positions % page_size).add_(pages, alpha=page_size)


def block_table(pages: Sequence[Sequence[int]], num_rows: int, max_pages: int,
                device) -> torch.Tensor:
    """Rows of page ids; table tails and rows past ``len(pages)`` are the null page.

    It runs on every decode step, so every row's pages go over in one conversion and one
    masked write (row-major, as the mask enumerates them), not a tensor per row.
    """
    lengths = [len(p) for p in pages]
    width = max(lengths, default=0)
    if width > max_pages:
        raise ValueError(f"request holds {width} pages, table width is {max_pages}")
    if len(lengths) > num_rows:
        raise ValueError(f"{len(lengths)} rows do not fit in a table of {num_rows}")
    table = torch.full((num_rows, max_pages), NULL_PAGE, dtype=torch.int32)
    if width:
        live = torch.arange(width) < _int32(lengths, len(lengths))[:, None]
        table[:len(lengths), :width].masked_scatter_(live, _int32(chain.from_iterable(pages), sum(lengths)))
    return table.to(device)


def _int32(values: Iterable[int], count: int) -> torch.Tensor:
    """``struct`` packs Python ints several times faster than ``torch.tensor`` converts them."""
    buffer = bytearray(4 * count)
    struct.pack_into(f"{count}i", buffer, 0, *values)
    return torch.frombuffer(buffer, dtype=torch.int32)


def _padded_columns(columns: Sequence[Sequence[int]], length: int, device) -> tuple[torch.Tensor, ...]:
    """Int64 columns, each zero-padded to ``length``, from one conversion (views of one
    tensor): a decode step's per-row vectors cost one build, not one each."""
    flat = []
    for values in columns:
        if len(values) > length:
            raise ValueError(f"{len(values)} rows do not fit in a batch of {length}")
        flat.extend(values)
        flat.extend([0] * (length - len(values)))
    if not flat:  # frombuffer refuses an empty buffer
        return torch.zeros((len(columns), 0), dtype=torch.int64, device=device).unbind()
    buffer = bytearray(8 * len(flat))
    struct.pack_into(f"{len(flat)}q", buffer, 0, *flat)
    return torch.frombuffer(buffer, dtype=torch.int64).view(len(columns), length).to(device).unbind()


def _padded(values: Sequence[int], length: int, fill: int, device) -> torch.Tensor:
    if len(values) > length:
        raise ValueError(f"{len(values)} rows do not fit in a batch of {length}")
    return torch.tensor(list(values) + [fill] * (length - len(values)), dtype=torch.int64,
                        device=device)


def refresh_decode(rows: Sequence[DecodeRow], num_rows: int, max_pages: int, page_size: int,
                   device="cpu") -> DecodeMetadata:
    """Decode metadata for ``rows`` padded to ``num_rows``; no rows is the idle refresh
    used for capture (placeholder tables of null pages)."""
    tables = block_table([r.pages for r in rows], num_rows, max_pages, device)
    every_row = range(num_rows)
    input_ids, positions, row_request, sample_rows = _padded_columns(
        ([r.token for r in rows], [r.position for r in rows], every_row, every_row), num_rows, device)
    return DecodeMetadata(
        input_ids=input_ids, positions=positions,
        slot_mapping=write_locations(tables, row_request, positions, page_size),
        block_tables=tables, row_request=row_request, sample_rows=sample_rows,
        num_live_rows=len(rows))


def plan_extend(chunks: Sequence[ExtendChunk], num_rows: int, num_table_rows: int,
                max_pages: int, page_size: int, view_width: int = 1,
                num_view_rows: int | None = None, device="cpu") -> ExtendMetadata:
    """Extend metadata for ``chunks`` padded to ``num_rows`` token rows.

    The decoder view keeps the last ``view_width`` rows of each completing chunk and the
    last row of each open chunk; padding token rows read through the null table row
    ``num_table_rows - 1``.
    """
    if num_table_rows <= len(chunks):
        raise ValueError(f"{len(chunks)} chunks need {len(chunks) + 1} table rows "
                         f"(one is the null row), got {num_table_rows}")
    _check_pages(chunks, page_size)
    lengths = [len(c.tokens) for c in chunks]
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()
    view, view_samples = _decoder_view(chunks, ends, view_width)
    tables = block_table([c.pages for c in chunks], num_table_rows, max_pages, device)
    positions = _padded([c.start + i for c in chunks for i in range(len(c.tokens))], num_rows, 0, device)
    row_request = _padded([r for r, n in enumerate(lengths) for _ in range(n)], num_rows,
                          num_table_rows - 1, device)
    num_view_rows = len(view) if num_view_rows is None else num_view_rows
    return ExtendMetadata(
        input_ids=_padded([t for c in chunks for t in c.tokens], num_rows, 0, device),
        positions=positions, slot_mapping=write_locations(tables, row_request, positions, page_size),
        block_tables=tables, row_request=row_request,
        sample_rows=torch.tensor([e - 1 for c, e in zip(chunks, ends) if c.completes],
                                 dtype=torch.int64, device=device),
        num_live_rows=sum(lengths), view_rows=_padded(view, num_view_rows, num_rows - 1, device),
        view_sample_rows=torch.tensor(view_samples, dtype=torch.int64, device=device),
        num_live_view_rows=len(view))


def _check_pages(chunks: Sequence[ExtendChunk], page_size: int) -> None:
    """A position past a chunk's pages would resolve to the null page, shared with padding."""
    for i, chunk in enumerate(chunks):
        end = chunk.start + len(chunk.tokens)
        if end > len(chunk.pages) * page_size:
            raise ValueError(f"chunk {i}: positions up to {end - 1} need {-(-end // page_size)} "
                             f"pages of {page_size} tokens, it holds {len(chunk.pages)}")


def kept_rows(chunk: ExtendChunk, width: int) -> int:
    """Rows of ``chunk`` in the decoder view: the last ``width`` if it completes, else one."""
    return min(width if chunk.completes else 1, len(chunk.tokens))


def _decoder_view(chunks, ends, width):
    view, samples = [], []
    for chunk, end in zip(chunks, ends):
        view.extend(range(end - kept_rows(chunk, width), end))
        if chunk.completes:
            samples.append(len(view) - 1)
    return view, samples
