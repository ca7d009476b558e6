"""Paged attention in torch: what the CPU runs for every attention op, and the reference
the Triton kernels are tested against (the semantics are ``reference.py``'s).

Rows of one request at consecutive positions (a run: a prompt chunk, a verify window, the
rows a decoder view keeps of one request) read the same keys. A run of two rows or more
gathers its request's keys and values once and makes one
``scaled_dot_product_attention`` call over them, every KV head's query heads together,
causal through a mask that starts at the run's first position: a chunk costs what SDPA
costs. Gathered per row instead, every row copies all the keys before it, and a prompt's
attention grows with the cube of its length in copies (600 tokens took two minutes on
the CPU). A row alone in its run (a decode row: one per request) reads its request's
keys once either way; such rows go together, ``ROWS_PER_CHUNK`` at a time, in one
batched product. Scores and softmax are float32 whatever the cache's dtype; an FP8
cache's elements are read through its layer's scales (``kv_scales``: key, value; see
``kv_fp8``).
"""

import torch
import torch.nn.functional as F

from tokenspeed.backends.kernels import kv_fp8

ROWS_PER_CHUNK = 64  # lone rows attended at once: bounds their gathered keys' memory
UNSCALED = (1.0, 1.0)


def paged_attention(q, kv, block_tables, row_request, positions, scale, page_size: int, window: int,
                    num_rows: int, kv_scales: tuple[float, float] = UNSCALED) -> torch.Tensor:
    """Attention of the first ``num_rows`` rows of ``q`` (``[rows, H, D]``) over one layer's
    cache ``kv`` (``[2, slots, Hkv, D]``); the rows after them are zero."""
    out = torch.zeros_like(q) if num_rows < q.shape[0] else torch.empty_like(q)
    starts, lengths = row_runs(row_request[:num_rows], positions[:num_rows])
    for start, length in zip(starts, lengths):
        if length > 1:
            rows = slice(start, start + length)
            table = block_tables[int(row_request[start])]
            out[rows] = _attend_run(q[rows], kv, table, int(positions[start]), scale, page_size, window,
                                    kv_scales)
    lone = torch.tensor([start for start, length in zip(starts, lengths) if length == 1],
                        dtype=torch.long, device=q.device)
    if len(lone):
        out[lone] = lone_rows_attention(q[lone], kv, block_tables, row_request[lone], positions[lone], scale,
                                        page_size, window, kv_scales)
    return out


def lone_rows_attention(q, kv, block_tables, row_request, positions, scale, page_size: int,
                        window: int, kv_scales: tuple[float, float] = UNSCALED) -> torch.Tensor:
    """Every row over its own request's keys, ``ROWS_PER_CHUNK`` rows at a time: for rows
    of distinct requests (decode rows), which need no search for runs."""
    if 0 < q.shape[0] <= ROWS_PER_CHUNK:   # a decode batch: one chunk, no copy into an output
        return _attend_rows(q, kv, block_tables, row_request.long(), positions.long(), scale, page_size,
                            window, kv_scales)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        out[rows] = _attend_rows(q[rows], kv, block_tables, row_request[rows].long(), positions[rows].long(),
                                 scale, page_size, window, kv_scales)
    return out


def row_runs(row_request: torch.Tensor, positions: torch.Tensor) -> tuple[list[int], list[int]]:
    """The longest runs of rows of one request at consecutive positions: (first rows, lengths)."""
    count = row_request.shape[0]
    if count == 0:
        return [], []
    breaks = (row_request[1:] != row_request[:-1]) | (positions[1:] != positions[:-1] + 1)
    starts = torch.cat([breaks.new_ones(1), breaks]).nonzero().flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([count])])
    return starts.tolist(), (ends - starts).tolist()


def _attend_run(q, kv, table, first: int, scale, page_size: int, window: int, kv_scales) -> torch.Tensor:
    """Rows at positions ``first ..`` of the request whose block-table row is ``table``:
    its keys from the first any row sees (all, or the first row's window) to the last row."""
    last = first + q.shape[0] - 1
    keys = torch.arange(max(first - window + 1, 0) if window else 0, last + 1, device=q.device)
    slots = table[keys // page_size].long() * page_size + keys % page_size
    k, v = (kv_fp8.read(kv[i][slots], kv_scales[i]).transpose(0, 1) for i in (0, 1))   # [Hkv, Lk, D]
    visible = _visible(keys, torch.arange(first, last + 1, device=q.device), window)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=visible,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


def _visible(keys: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """``[rows, keys]``: the keys at or before each row's position, within its window."""
    visible = keys[None, :] <= positions[:, None]
    if window:
        visible &= keys[None, :] > positions[:, None] - window
    return visible


def _attend_rows(q, kv, block_tables, requests, positions, scale, page_size: int, window: int, kv_scales):
    """Each row over its own request's keys: one ``scaled_dot_product_attention`` call with
    the rows as its batch, each KV head's query heads as that head's query rows (``[Q,
    Hkv, group, D]``: half the time of SDPA's ``enable_gqa``, which repeats the keys), and
    no mask for a lone row without a window (it sees every key gathered). Keys and values
    are gathered by whole pages, an ``index_select`` each (a slot index per key cost eight
    more ops a layer; the advanced index, two and a half times as long). A decode step on
    the CPU is bound by how many small ops it runs and how long they take
    (docs/PERFORMANCE.md)."""
    rows, heads, dim = q.shape
    length, kv_heads = int(positions.max()) + 1, kv.shape[2]
    pages = block_tables[requests, :-(-length // page_size)].flatten().long()     # [Q x pages]
    k, v = (kv_fp8.read(torch.index_select(kv[i].view(-1, page_size * kv_heads * dim), 0, pages), kv_scales[i])
            .view(rows, -1, kv_heads, dim)[:, :length].transpose(1, 2) for i in (0, 1))   # [Q, Hkv, L, D]
    lone = rows == 1 and not window   # it sees every key gathered: no mask
    visible = None if lone else _visible(torch.arange(length, device=q.device), positions, window)[:, None, None, :]
    out = F.scaled_dot_product_attention(q.float().reshape(rows, kv_heads, heads // kv_heads, dim), k, v,
                                         attn_mask=visible, scale=scale)   # [Q, Hkv, group, D]
    return out.reshape(rows, heads, dim).to(q.dtype)
