"""Plain-torch reference kernels: the CPU implementation and the oracle for Triton tests.

KV cache layout (one tensor for the whole pool):
    kv_cache[layer, 0 | 1, slot, kv_head, head_dim]      (0 = K, 1 = V)
with slot = page * page_size + offset. Page 0 is the null page.

Attention is described per query row, so one formulation serves decode, extend and the
narrowed decoder view: row r belongs to request ``row_request[r]`` and sits at position
``positions[r]``; it attends causally to positions 0..positions[r] of that request,
found through ``block_tables[row_request[r]]``.
"""

import torch

ROWS_PER_CHUNK = 64


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    kv_cache[layer, 0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[layer, 1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def key_slots(block_tables: torch.Tensor, rows: torch.Tensor, length: int,
              page_size: int) -> torch.Tensor:
    """Slots of positions 0..length-1 for each request in ``rows``: [len(rows), length]."""
    pos = torch.arange(length, device=block_tables.device)
    pages = block_tables[rows][:, pos // page_size].long()
    return pages * page_size + pos % page_size


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    block_tables: torch.Tensor, row_request: torch.Tensor,
                    positions: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        out[rows] = _attend_rows(q[rows], kv_cache[layer], block_tables, row_request[rows].long(),
                                 positions[rows].long(), scale, page_size)
    return out


def _attend_rows(q, kv, block_tables, requests, positions, scale, page_size):
    if q.shape[0] == 0:
        return q
    length = int(positions.max()) + 1
    slots = key_slots(block_tables, requests, length, page_size)          # [Q, L]
    k, v = kv[0][slots].float(), kv[1][slots].float()                      # [Q, L, Hkv, D]
    group = q.shape[1] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("qhd,qlhd->qhl", q.float(), k) * scale
    visible = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("qhl,qlhd->qhd", scores.softmax(-1), v).to(q.dtype)


def expand_block_table(block_tables: torch.Tensor, factor: int) -> torch.Tensor:
    """Rewrite a table of pages of size P as one of pages of size P // factor.

    Page p becomes pages p*factor .. p*factor + factor - 1; page 0 stays the null range.
    """
    sub = torch.arange(factor, device=block_tables.device, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * factor + sub).flatten(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face Llama: fp32 statistics, the weight applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[rows, heads, D]`` from a ``cat(cos, sin)`` table ``[pos, D]``,
    in the rotate-half convention, with the table cast to x's dtype as HF does."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
