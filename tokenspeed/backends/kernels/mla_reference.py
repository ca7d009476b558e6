"""Latent attention (MLA) in torch: what the CPU runs for the MLA ops, what CUDA runs for
``write_latent``, and the reference the Triton kernels are tested against.

The cache holds per token one row, ``latent | rope key``, with no heads
(``kv_cache[layer, 0, page, offset, 0, :]``). Two forms compute the same attention:

- expanded (runs of two rows or more: a prompt chunk): the run's request's latents are
  up-projected once into per-head keys and values, and the rows attend them as ordinary
  multi-head attention. A chunk's rows outnumber the projections it saves;
- absorbed (a row alone: a decode row): the key's up-projection is folded into the query
  (``q_nope @ W_UK``, a latent-wide query per head) and the value's applied after
  attending the latents, so nothing per key is up-projected. It gathers every position the
  row's table can address and masks those past the row's, so it reads no lengths on the
  host and can be captured in a graph.

Scores and softmax are float32 whatever the cache's dtype.
"""

import torch
import torch.nn.functional as F

from tokenspeed.backends.kernels.torch_attention import ROWS_PER_CHUNK, row_runs


def write_latent(latent, k_rope, kv_cache, layer, slot_mapping) -> None:
    rows = torch.cat((latent, k_rope), dim=-1).to(kv_cache.dtype)[:, None, :]
    _layer_slots(kv_cache, layer)[0].index_copy_(0, slot_mapping, rows)


def mla_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions, kv_b_weight, scale):
    """Runs expanded, lone rows absorbed (rows of one request at consecutive positions form a run)."""
    cache, page_size = _layer_slots(kv_cache, layer)
    up = UpProjection.of(kv_b_weight, q_nope.shape[1], q_nope.shape[2])
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], up.v_dim)
    starts, lengths = row_runs(row_request, positions)
    for start, length in zip(starts, lengths):
        if length > 1:
            rows = slice(start, start + length)
            table = block_tables[int(row_request[start])]
            out[rows] = _expanded_run(q_nope[rows], q_rope[rows], cache[:, 0], table, int(positions[start]),
                                      up, scale, page_size)
    lone = torch.tensor([s for s, n in zip(starts, lengths) if n == 1], dtype=torch.long, device=q_nope.device)
    if len(lone):
        out[lone] = mla_decode_attention(q_nope[lone], q_rope[lone], kv_cache, layer, block_tables,
                                         row_request[lone], positions[lone], kv_b_weight, scale)
    return out


def mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions,
                         kv_b_weight, scale):
    cache, page_size = _layer_slots(kv_cache, layer)
    up = UpProjection.of(kv_b_weight, q_nope.shape[1], q_nope.shape[2])
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], up.v_dim)
    for start in range(0, q_nope.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        out[rows] = _absorbed_rows(q_nope[rows], q_rope[rows], cache[:, 0], block_tables, row_request[rows].long(),
                                   positions[rows].long(), up, scale, page_size)
    return out


class UpProjection:
    """``kv_b_weight [H * (nope + v), latent]`` as per-head key (``w_k [H, nope, latent]``)
    and value (``w_v [H, v, latent]``) up-projections, float32 (``as_stored``: views of
    the weight in its own dtype, no copy)."""

    def __init__(self, w_k: torch.Tensor, w_v: torch.Tensor):
        self.w_k, self.w_v = w_k, w_v
        self.v_dim, self.latent = w_v.shape[1], w_v.shape[2]

    @classmethod
    def of(cls, kv_b_weight: torch.Tensor, heads: int, nope: int, as_stored: bool = False) -> "UpProjection":
        weight = kv_b_weight if as_stored else kv_b_weight.float()
        per_head = weight.view(heads, -1, kv_b_weight.shape[1])
        return cls(per_head[:, :nope], per_head[:, nope:])


def _layer_slots(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, int]:
    """``[L, 1, pages, P, 1, C]`` -> (layer's ``[slots, 1, C]`` view, P)."""
    return kv_cache[layer, 0].flatten(0, 1), kv_cache.shape[3]


def _expanded_run(q_nope, q_rope, cache, table, first: int, up: UpProjection, scale, page_size: int):
    """Rows at positions ``first ..`` of one request over its keys ``0 .. last``."""
    last = first + q_nope.shape[0] - 1
    keys = torch.arange(last + 1, device=q_nope.device)
    rows = cache[table[keys // page_size].long() * page_size + keys % page_size].float()   # [Lk, C]
    latent, k_rope = rows[:, :up.latent], rows[:, up.latent:]
    k_nope = torch.einsum("lr,hnr->hln", latent, up.w_k)
    v = torch.einsum("lr,hvr->hlv", latent, up.w_v)
    k = torch.cat((k_nope, k_rope[None].expand(k_nope.shape[0], -1, -1)), dim=-1)        # [H, Lk, nope + rope]
    q = torch.cat((q_nope, q_rope), dim=-1).float().transpose(0, 1)                     # [H, rows, nope + rope]
    visible = keys[None, :] <= torch.arange(first, last + 1, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return out.transpose(0, 1).to(q_nope.dtype)


def _absorbed_rows(q_nope, q_rope, cache, block_tables, requests, positions, up: UpProjection, scale,
                   page_size: int):
    """Each row over every position its table addresses, those past its own masked."""
    keys = torch.arange(block_tables.shape[-1] * page_size, device=q_nope.device)
    slots = block_tables[requests][:, keys // page_size].long() * page_size + keys % page_size   # [Q, L]
    rows = cache[slots].float()                                                                # [Q, L, C]
    latent, k_rope = rows[..., :up.latent], rows[..., up.latent:]
    q_latent = torch.einsum("qhn,hnr->qhr", q_nope.float(), up.w_k)       # W_UK folded into the query
    scores = (torch.einsum("qhr,qlr->qhl", q_latent, latent) +
              torch.einsum("qhd,qld->qhl", q_rope.float(), k_rope)) * scale
    scores = scores.masked_fill((keys[None, :] > positions[:, None])[:, None, :], float("-inf"))
    attended = torch.einsum("qhl,qlr->qhr", scores.softmax(-1), latent)
    return torch.einsum("qhr,hvr->qhv", attended, up.w_v).to(q_nope.dtype)
