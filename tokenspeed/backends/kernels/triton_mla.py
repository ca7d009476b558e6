"""Triton latent attention in the absorbed form, for decode's rows and prefill's (see
``mla_attention``): each query row on its own, the key's up-projection already folded into
the query (``q_latent = q_nope @ W_UK``, per head), attending the cached rows
``latent | rope key`` as one key head shared by every query head, the latents doubling as
values. The value's up-projection is applied after (``mla_decode_attention``), so per key
nothing is up-projected.

One program takes one row, a block of its query heads and one split of its keys
(flash-decoding, so that a few long rows still occupy every SM): each page is read once per
block of heads (all of them, up to ``BLOCK_H``), and the heads fill the M side of
``tl.dot``. A second kernel merges the splits by their log-sum-exp (a row of one split
needs no merge). The splits' bounds come from the row's position, read on the device:
nothing is read on the host, and the grid depends only on shapes, so both launches can be
captured.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_latent
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_attention import sm_count
from tokenspeed.backends.kernels.triton_decode import _split_size, choose_num_splits
from tokenspeed.backends.kernels.mla_reference import UpProjection
from tokenspeed.backends.kernels.triton_latent import LatentWrite, write_latent_row
from tokenspeed.errors import InternalError

LOG2E = 1.4426950408889634
BLOCK_N = 32   # keys a step: at one row of 576 to 1,024 keys the attention and its merge took 11.4-11.9 us
# on an H100 against 13.8-14.1 with 16 (DeepSeek-V2-Lite's 16 heads; docs/PERFORMANCE.md)
ABSORB_MAX_ROWS = 2   # rows up to which the query's absorption is ``_absorb_kernel`` (cuBLAS's product
# above): at one row of DeepSeek-V2-Lite the product took 3.4 us (H100), a launch for 2 MB of weights
ABSORB_COLUMNS, ABSORB_WARPS = 64, 4   # latent columns of one head a program: a [128, 64] float32 tile
COMBINE_UP_MAX_ROWS = 2   # each (row, head) program reads its head's value up-projection: at 32 rows of
# DeepSeek-V2-Lite's 16 heads the merged launch took 90 us a layer on the H200, the merge and a
# batched product about 10; at one row it saves the product's and the reshape's launches


class QueryRope(NamedTuple):
    """A decode row's query rope parts come unrotated: the kernel rotates them by
    ``cos_sin`` (``[positions, rope]``, cos then sin) at the row's position, as
    ``tokenspeed::rope`` would (``interleaved``: DeepSeek's pairing)."""
    cos_sin: torch.Tensor
    interleaved: bool


@triton.jit
def _absorbed_decode_kernel(ql_ptr, qr_ptr, cache_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                            qk_scale, stride_qlr, stride_qlh, stride_qrr, stride_qrh, stride_bt, stride_slot,
                            stride_or, stride_oh, cs_ptr, stride_cs,
                            HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
                            ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, USE_PDL: tl.constexpr):
    """One split of one row's keys for a block of heads: its unnormalised output and
    log-sum-exp (base 2), merged by ``_combine_kernel``. A split past the row's end writes
    nothing and is not merged. One split is the row's output, stored as it is: no float32
    partials for a prefill's thousands of rows. ROTATE: q_rope is unrotated, and each
    program rotates its heads' as it loads them (``_query_rope``). Everything is read after
    the wait (``pdl``): a prefill's rows and positions may be a kernel's output."""
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    r, p = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_P)
    hmask, rmask, pmask = heads < HEADS, r < LATENT, p < ROPE
    req = tl.load(req_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    size = _split_size(pos + 1, NUM_SPLITS, BLOCK_N)
    lo, hi = split * size, tl.minimum((split + 1) * size, pos + 1)
    if lo < hi:
        q_lat = tl.load(ql_ptr + row * stride_qlr + heads[:, None] * stride_qlh + r[None, :],
                        mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        q_rope = _query_rope(qr_ptr + row * stride_qrr + heads[:, None] * stride_qrh, p,
                             hmask[:, None] & pmask[None, :], cs_ptr + pos.to(tl.int64) * stride_cs, ROPE,
                             ROTATE, INTERLEAVED)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            kmask = kpos < hi
            page = tl.load(bt_ptr + req * stride_bt + kpos // PAGE_SIZE, mask=kmask, other=0).to(tl.int64)
            slot = (page * PAGE_SIZE + kpos % PAGE_SIZE) * stride_slot
            lat = tl.load(cache_ptr + slot[:, None] + r[None, :], mask=kmask[:, None] & rmask[None, :],
                          other=0.0).to(tl.float32)                                          # [N, R]
            rope = tl.load(cache_ptr + slot[:, None] + LATENT + p[None, :], mask=kmask[:, None] & pmask[None, :],
                           other=0.0).to(tl.float32)                                         # [N, P]
            s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
            s = (s + tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)) * qk_scale
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            weights = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(weights, 1)
            acc = acc * alpha[:, None] + tl.dot(weights, lat, input_precision=PRECISION)
            m = m_new
        if NUM_SPLITS == 1:
            tl.store(out_ptr + row * stride_or + heads[:, None] * stride_oh + r[None, :], acc / l[:, None],
                     mask=hmask[:, None] & rmask[None, :])
        else:
            part = (row * HEADS + heads) * NUM_SPLITS + split
            tl.store(mid_o_ptr + part[:, None] * LATENT + r[None, :], acc / l[:, None],
                     mask=hmask[:, None] & rmask[None, :])
            tl.store(mid_lse_ptr + part, m + tl.log2(l), mask=hmask)


@triton.jit
def _query_rope(rows, p, mask, cs_row, ROPE: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The heads' rope parts ``[BLOCK_H, BLOCK_P]`` as ``tokenspeed::rope`` leaves them
    (``triton_rope``'s arithmetic, rounded to q's dtype): the pairs (adjacent elements if
    INTERLEAVED, else the halves) rotated by the row's ``cos | sin`` table entry, out as
    halves. Without ROTATE, as stored."""
    if ROTATE:
        upper = p >= ROPE // 2
        j = tl.where(upper, p - ROPE // 2, p)
        if INTERLEAVED:
            first, second = 2 * j, 2 * j + 1
        else:
            first, second = j, j + ROPE // 2
        x1 = tl.load(rows + first[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + second[None, :], mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cs_row + j, mask=p < ROPE, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(cs_row + ROPE // 2 + j, mask=p < ROPE, other=0.0).to(tl.float32)[None, :]
        rotated = tl.where(upper[None, :], x2 * cos + x1 * sin, x1 * cos - x2 * sin)
        return rotated.to(rows.dtype.element_ty).to(tl.float32)
    return tl.load(rows + p[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _merged(mid_o_ptr, mid_lse_ptr, pos_ptr, row, head, HEADS: tl.constexpr, LATENT: tl.constexpr,
            NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """A row's splits that hold keys, for one head, merged by their log-sum-exp: ``[BLOCK_R]``."""
    pos = tl.load(pos_ptr + row).to(tl.int32)
    active = tl.cdiv(pos + 1, _split_size(pos + 1, NUM_SPLITS, BLOCK_N))
    s, r = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_R)
    part = (row * HEADS + head) * NUM_SPLITS + s
    lse = tl.load(mid_lse_ptr + part, mask=s < active, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(mid_o_ptr + part[:, None] * LATENT + r[None, :], mask=(s[:, None] < active) & (r[None, :] < LATENT),
                other=0.0)
    return tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)


@triton.jit
def _combine_kernel(mid_o_ptr, mid_lse_ptr, pos_ptr, out_ptr, stride_or, stride_oh, HEADS: tl.constexpr,
                    LATENT: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_R: tl.constexpr):
    """Merges a row's splits for one head."""
    row, head, r = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.arange(0, BLOCK_R)
    merged = _merged(mid_o_ptr, mid_lse_ptr, pos_ptr, row, head, HEADS, LATENT, NUM_SPLITS, BLOCK_N, BLOCK_S,
                     BLOCK_R)
    tl.store(out_ptr + row * stride_or + head * stride_oh + r, merged, mask=r < LATENT)


@triton.jit
def _combine_up_kernel(mid_o_ptr, mid_lse_ptr, pos_ptr, wv_ptr, out_ptr, V_DIM, stride_wh, stride_wv, stride_or,
                       stride_oh, HEADS: tl.constexpr, LATENT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """Merges a row's splits for one head, rounds the latent output to the weight's dtype (as
    ``_combine_kernel`` stores it), and multiplies it by ``BLOCK_V`` of the head's value
    up-projection rows: the merged latents never reach memory, and the output is the
    ``[rows, heads, v]`` the output projection reads, with no product or copy after. The
    weight rows are loaded before the wait for the partials (``pdl``)."""
    pdl.start(USE_PDL)
    row, head, r = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.arange(0, BLOCK_R)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    w = tl.load(wv_ptr + head * stride_wh + v[:, None] * stride_wv + r[None, :],
                mask=(v[:, None] < V_DIM) & (r[None, :] < LATENT), other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    merged = _merged(mid_o_ptr, mid_lse_ptr, pos_ptr, row, head, HEADS, LATENT, NUM_SPLITS, BLOCK_N, BLOCK_S,
                     BLOCK_R)
    merged = merged.to(wv_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_or + head * stride_oh + v, tl.sum(w * merged[None, :], 1), mask=v < V_DIM)


@triton.jit
def _absorb_kernel(qn_ptr, wk_ptr, out_ptr, rows, stride_qnr, stride_qnh, stride_wkh, stride_wkn, stride_or,
                   stride_oh, NOPE: tl.constexpr, LATENT: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """``q_latent[row, head, c] = q_nope[row, head] @ W_UK[head][:, c]`` for ``BLOCK_C`` latent
    columns of one head, every row, rounded to the weight's dtype as the batched product
    rounds it (``_absorb_columns``)."""
    pdl.start(USE_PDL)
    _absorb_columns(qn_ptr, wk_ptr, out_ptr, rows, tl.program_id(0), tl.program_id(1), stride_qnr, stride_qnh,
                    stride_wkh, stride_wkn, stride_or, stride_oh, NOPE, LATENT, BLOCK_D, BLOCK_C, USE_PDL)


@triton.jit
def _absorb_write_kernel(qn_ptr, wk_ptr, out_ptr, rows, stride_qnr, stride_qnh, stride_wkh, stride_wkn, stride_or,
                         stride_oh, latent_ptr, nw_ptr, rope_ptr, table_ptr, pos_ptr, slot_ptr, cache_ptr, eps,
                         stride_l, stride_r, stride_table, stride_pos, stride_sm, stride_slot,
                         NOPE: tl.constexpr, LATENT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                         HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_L: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr):
    """``_absorb_kernel`` and, by a last column of programs, the layer's cache write
    (``triton_latent.write_latent_row``: head h's program the rows h, h + heads, ...): the
    write costs no launch of its own, and the attention after reads it."""
    pdl.start(USE_PDL)
    head, block = tl.program_id(0), tl.program_id(1)
    if block == tl.num_programs(1) - 1:
        pdl.wait(USE_PDL)
        for t in range(head, rows, tl.num_programs(0)):
            write_latent_row(t, latent_ptr, nw_ptr, rope_ptr, table_ptr, pos_ptr, slot_ptr, cache_ptr,
                             eps, stride_l, stride_r, stride_table, stride_pos, stride_sm, stride_slot, LATENT,
                             HALF, INTERLEAVED, BLOCK_L, BLOCK_HALF)
    else:
        _absorb_columns(qn_ptr, wk_ptr, out_ptr, rows, head, block, stride_qnr, stride_qnh, stride_wkh, stride_wkn,
                        stride_or, stride_oh, NOPE, LATENT, BLOCK_D, BLOCK_C, USE_PDL)


@triton.jit
def _absorb_columns(qn_ptr, wk_ptr, out_ptr, rows, head, block, stride_qnr, stride_qnh, stride_wkh, stride_wkn,
                    stride_or, stride_oh, NOPE: tl.constexpr, LATENT: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """One head's ``BLOCK_C`` columns of ``block``, every row. The weights are loaded before
    the wait (``pdl``): the launch's bytes are in flight while the kernel before it ends."""
    c, d = block * BLOCK_C + tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_D)
    w = tl.load(wk_ptr + head.to(tl.int64) * stride_wkh + d[:, None] * stride_wkn + c[None, :],
                mask=(d[:, None] < NOPE) & (c[None, :] < LATENT), other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    for row in range(rows):
        q = tl.load(qn_ptr + row * stride_qnr + head * stride_qnh + d, mask=d < NOPE, other=0.0)
        q = q.to(wk_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_or + head * stride_oh + c, tl.sum(w * q[:, None], 0), mask=c < LATENT)


def mla_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions, kv_b_weight, scale):
    """The op's CUDA kernel for prefill and extends, in the absorbed form as decode's: every
    row on its own, so ragged runs, cached prefixes, the decoder's narrowed view and padding
    rows need no plan, nothing is read on the host, and the step is captured.

    The expanded form (the reference's for runs) was weighed twice. Up-projected into a
    scratch buffer before a Triton attention, its keys have no static size: which positions
    a step reads is known on the device only, and the tables' reach (rows x table width x
    page size keys, of heads x (nope + v) values each) is gigabytes at long contexts.
    Up-projected inside the attention, tile by tile, each key costs 2 x latent x (nope + v)
    per head once per tile of rows (262k at DeepSeek's 512 and 128 + 128), against the
    absorbed 2 x (2 x latent + rope) per row (2176): a tile would need over a hundred rows
    of one head to win, more than its accumulators keep in registers. The absorbed form's
    price is its scores over latent + rope (576) values per key, not nope + rope (192).
    Equal to the reference within float32 rounding (tests/test_mla_triton.py)."""
    return mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions,
                                kv_b_weight, scale)


def mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions,
                         kv_b_weight, scale, num_splits: int | None = None, rope: QueryRope | None = None,
                         write: LatentWrite | None = None):
    """The op's CUDA kernel: ``kv_cache`` the IR's ``[L, 1, pages, P, 1, latent + rope]``;
    ``rope``: q_rope is unrotated, the kernel rotates it; ``write``: the rows' latents are
    written first, by the query's absorption (``tokenspeed::mla_write_decode_attention``)."""
    up = UpProjection.of(kv_b_weight, q_nope.shape[1], q_nope.shape[2], as_stored=True)
    return absorbed_decode(absorbed_query(q_nope, up.w_k, write), q_rope, kv_cache, layer, block_tables, row_request,
                           positions, scale, num_splits, w_v=up.w_v, rope=rope).to(q_nope.dtype)


def absorbed_query(q_nope: torch.Tensor, w_k: torch.Tensor, write: LatentWrite | None = None) -> torch.Tensor:
    """``q_nope @ W_UK`` per head, ``[rows, H, latent]`` in the weight's dtype, as transformers'
    kv_b_proj rounds it (a float32 copy of the weight would be read and written every step):
    up to ``ABSORB_MAX_ROWS`` rows by ``_absorb_kernel``, more by the batched product.
    ``write``: the layer's latent write, done by the same launch (``_absorb_write_kernel``;
    by its own launch before the batched product)."""
    rows, heads, nope = q_nope.shape
    if write is not None and (write.rows, write.constants["LATENT"]) != (rows, w_k.shape[2]):
        raise InternalError(f"the latent write has {write.rows} rows of {write.constants['LATENT']} and the "
                            f"query {rows} of {w_k.shape[2]}")
    if not 0 < rows <= ABSORB_MAX_ROWS:
        if write is not None:
            triton_latent.write_latents(write)
        return torch.einsum("qhn,hnr->qhr", q_nope.to(w_k.dtype), w_k)
    latent = w_k.shape[2]
    w_k = w_k if w_k.stride(-1) == 1 else w_k.contiguous()
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    out = torch.empty((rows, heads, latent), dtype=w_k.dtype, device=q_nope.device)
    args = (q_nope, w_k, out, rows, q_nope.stride(0), q_nope.stride(1), w_k.stride(0), w_k.stride(1), out.stride(0),
            out.stride(1))
    shape = dict(NOPE=nope, LATENT=latent, BLOCK_D=max(16, next_power_of_2(nope)), BLOCK_C=ABSORB_COLUMNS,
                 num_warps=ABSORB_WARPS, **pdl.launch_options(q_nope.device))
    blocks = triton.cdiv(latent, ABSORB_COLUMNS)
    if write is None:
        _absorb_kernel[(heads, blocks)](*args, **shape)
    else:
        constants = {k: v for k, v in write.constants.items() if k != "LATENT"}   # the query's, checked above
        _absorb_write_kernel[(heads, blocks + 1)](*args, *write.args, **shape, **constants)
    return out


def absorbed_decode(q_latent, q_rope, kv_cache, layer, block_tables, row_request, positions, scale,
                    num_splits: int | None = None, w_v: torch.Tensor | None = None, rope: QueryRope | None = None):
    """``[rows, H, latent]`` in ``q_latent``'s dtype: softmax(q_latent . latent + q_rope . rope key) over the
    row's positions, times the latents; with ``w_v`` (``[H, v, latent]``), that up-projected
    per head, ``[rows, H, v]`` (by the launch that merges the splits, where keys are split and
    the rows are at most ``COMBINE_UP_MAX_ROWS``).
    ``num_splits``: the key splits per row (default: from the rows, rounded up to a power of
    two as a ladder's rungs are, and the longest context the table allows, as
    ``triton_decode`` chooses them). ``rope``: q_rope unrotated, rotated by the kernel."""
    rows, heads, latent = q_latent.shape
    _check(q_latent, q_rope, kv_cache, block_tables, row_request, positions, rope)
    cos_sin = q_rope   # unread without a rotation
    if rope is not None:
        cos_sin = rope.cos_sin if rope.cos_sin.stride(-1) == 1 else rope.cos_sin.contiguous()
    cache = kv_cache[layer, 0].flatten(0, 1)[:, 0]                          # [slots, latent + rope]
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    if rows == 0:
        return q_latent.new_empty(rows, heads, latent if w_v is None else w_v.shape[1])
    block_h = head_block(heads)
    head_blocks = triton.cdiv(heads, block_h)
    splits = num_splits or choose_num_splits(next_power_of_2(rows), head_blocks,
                                             block_tables.shape[1] * kv_cache.shape[3], sm_count(q_latent.device))
    partials = splits > 1
    fused_up = partials and w_v is not None and rows <= COMBINE_UP_MAX_ROWS
    out = q_latent.new_empty((0, 0, 0) if fused_up else q_latent.shape)
    shape = (rows, heads, splits) if partials else (0, 0, 0)
    mid_o = torch.empty((*shape, latent), dtype=torch.float32, device=q_latent.device)
    mid_lse = torch.empty(shape, dtype=torch.float32, device=q_latent.device)
    precision = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    _absorbed_decode_kernel[(rows, head_blocks, splits)](
        q_latent, q_rope, cache, block_tables, row_request, positions, out, mid_o, mid_lse, scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), block_tables.stride(0),
        cache.stride(0), out.stride(0), out.stride(1), cos_sin, cos_sin.stride(0),
        HEADS=heads, LATENT=latent, ROPE=q_rope.shape[2],
        PAGE_SIZE=kv_cache.shape[3], NUM_SPLITS=splits, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
        BLOCK_R=max(16, next_power_of_2(latent)), BLOCK_P=max(16, next_power_of_2(q_rope.shape[2])),
        PRECISION=precision, ROTATE=rope is not None, INTERLEAVED=rope is not None and rope.interleaved,
        num_warps=8 if latent >= 256 else 4,   # a [heads, latent] float32 accumulator: 32 KiB at 16 x 512
        **pdl.launch_options(q_latent.device))
    merge = dict(HEADS=heads, LATENT=latent, NUM_SPLITS=splits, BLOCK_N=BLOCK_N, BLOCK_S=next_power_of_2(splits),
                 BLOCK_R=max(16, next_power_of_2(latent)))
    if fused_up:
        return _combine_up(mid_o, mid_lse, positions, w_v, merge)
    if partials:
        _combine_kernel[(rows, heads)](mid_o, mid_lse, positions, out, out.stride(0), out.stride(1), **merge)
    return out if w_v is None else torch.einsum("qhr,hvr->qhv", out, w_v)


def head_block(heads: int) -> int:
    """Query heads a program takes (the M side of its ``tl.dot``, at least 16): at most 32.
    64 heads of a bfloat16 cache need 236 KB of shared memory with 16 keys a step and 324
    KB with 32, past the 227 KB an H100 or H200 gives a program; 32 heads take 115 KB
    (tests/test_mla_kernel_compile.py)."""
    return max(16, min(next_power_of_2(heads), 32))


def _combine_up(mid_o, mid_lse, positions, w_v, merge: dict) -> torch.Tensor:
    """``[rows, H, v]``: the splits merged and up-projected in one launch (``_combine_up_kernel``)."""
    rows, heads, v_dim = mid_o.shape[0], mid_o.shape[1], w_v.shape[1]
    if w_v.stride(-1) != 1:
        w_v = w_v.contiguous()
    out = torch.empty((rows, heads, v_dim), dtype=w_v.dtype, device=mid_o.device)
    block_v = min(16, next_power_of_2(v_dim))   # 128 programs a row at DeepSeek's 16 heads of 128 values
    _combine_up_kernel[(rows, heads, triton.cdiv(v_dim, block_v))](
        mid_o, mid_lse, positions, w_v, out, v_dim, w_v.stride(0), w_v.stride(1), out.stride(0), out.stride(1),
        BLOCK_V=block_v, **merge, num_warps=8,   # splits x latent float32 partials and v x latent weights
        **pdl.launch_options(mid_o.device))
    return out


def _check(q_latent, q_rope, kv_cache, block_tables, row_request, positions, rope=None) -> None:
    rows, heads, latent = q_latent.shape
    if rope is not None and (q_rope.shape[2] % 2 or rope.cos_sin.dim() != 2
                             or rope.cos_sin.shape[1] != q_rope.shape[2]):
        raise InternalError(f"a rotated q_rope's width must be even and its table [positions, "
                            f"{q_rope.shape[2]}]; got {tuple(rope.cos_sin.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 1 or kv_cache.shape[4] != 1 or \
            kv_cache.shape[5] != latent + q_rope.shape[2]:
        raise InternalError(f"an MLA cache is [L, 1, pages, P, 1, {latent} + {q_rope.shape[2]}]; "
                            f"got {tuple(kv_cache.shape)}")
    if q_rope.shape[:2] != (rows, heads) or row_request.shape != (rows,) or positions.shape != (rows,):
        raise InternalError(f"q_rope [{rows}, {heads}, rope], row_request and positions [{rows}]; got "
                            f"{tuple(q_rope.shape)}, {tuple(row_request.shape)}, {tuple(positions.shape)}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise InternalError("block_tables must be a [R, M] table with contiguous rows")
