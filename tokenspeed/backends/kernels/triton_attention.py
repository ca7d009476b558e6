"""Triton paged attention over the KV cache of ``reference.py``: extend, and the pieces
decode shares (``triton_decode.py``).

Semantics match ``reference.paged_attention``: query row r attends causally to positions
0..positions[r] of request row_request[r], found through block_tables[row_request[r]];
query head h reads KV head h // (H // Hkv); scores, softmax and sums run in fp32. A
float8 cache's keys and values are widened to the queries' type as they are loaded; its
key scale is folded into the softmax scale and its value scale into the output.

``extend_attention`` has many rows per request. Tiles of BLOCK_M consecutive rows of one
request share every key block through ``tl.dot``, and so do the query heads of one KV
head: a program takes BLOCK_M queries, a share of a tile's rows in each head of the group.
Prefill steps bring their tile plan with their metadata (``plan_extend``, built on the
host from the chunks, once per step); without one, it is built on the device by one small
kernel before the attention (a plan built here on the host would read ``row_request``
back: a sync in every layer).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import kv_fp8, pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_cache import as_query
from tokenspeed.backends.metadata import EXTEND_TILE_ROWS, tile_capacity
from tokenspeed.errors import InternalError

MAX_HEAD_DIM = 256
DEFAULT_SMS = 132
LOG2E = 1.4426950408889634
EXTEND_BLOCK_M = EXTEND_TILE_ROWS   # the tiles plan_extend builds on the host are of this size
EXTEND_WARPS = 4
EXTEND_STAGES = 3
TILE_PLAN_BLOCK = 1024


@triton.jit
def _slots(bt_row_ptr, kpos, valid, PAGE_SIZE: tl.constexpr):
    """Cache slot of each key position through one request's block-table row."""
    page = tl.load(bt_row_ptr + kpos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    return page * PAGE_SIZE + kpos % PAGE_SIZE


@triton.jit
def load_block(k_ptr, v_ptr, bt_row, kv_base, kpos, valid, stride_slot,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """K^T ``[BLOCK_D, BLOCK_N]`` and V ``[BLOCK_N, BLOCK_D]`` of the key block ``kpos``
    (zeros where not ``valid``)."""
    d = tl.arange(0, BLOCK_D)
    slot = _slots(bt_row, kpos, valid, PAGE_SIZE)
    kmask = valid[None, :] & (d[:, None] < HEAD_DIM)
    k = tl.load(k_ptr + kv_base + slot[None, :] * stride_slot + d[:, None], mask=kmask,
                other=0.0)
    vmask = valid[:, None] & (d[None, :] < HEAD_DIM)
    v = tl.load(v_ptr + kv_base + slot[:, None] * stride_slot + d[None, :], mask=vmask,
                other=0.0)
    return k, v


@triton.jit
def attend_loaded(q, m, l, acc, k, v, kpos, valid, pos, lo, qk_scale, CAUSAL: tl.constexpr,
                  PRECISION: tl.constexpr):
    """One online-softmax step (base 2) over a loaded key block.

    CAUSAL masks key j for query row i unless lo[i] <= j <= pos[i] (``lo``: where the row's
    sliding window starts, else 0); otherwise only ``valid`` keys. ``k`` and ``v`` as the
    cache holds them: widened to q's type here."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if CAUSAL:
        seen = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= lo[:, None])
        s = tl.where(seen, s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_base, kpos, valid, pos, lo, stride_slot,
                 qk_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """``load_block`` then ``attend_loaded``."""
    k, v = load_block(k_ptr, v_ptr, bt_row, kv_base, kpos, valid, stride_slot, HEAD_DIM,
                      PAGE_SIZE, BLOCK_D)
    return attend_loaded(q, m, l, acc, k, v, kpos, valid, pos, lo, qk_scale, CAUSAL, PRECISION)


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr, tile_first_ptr,
                   qk_scale, v_scale, window, stride_qr, stride_qh, stride_or, stride_oh,
                   stride_bt, stride_slot, stride_kvh,
                   GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    kv_head = tl.program_id(0) // GROUP_P   # KV heads vary fastest: see extend_attention
    part = tl.program_id(0) % GROUP_P       # which BLOCK_M // GROUP_P of the tile's rows
    tile = tl.program_id(1)
    first = tl.load(tile_first_ptr + tile)
    count = tl.minimum(tl.load(tile_first_ptr + tile + 1) - first, BLOCK_M)   # 0: an unused tile
    first = first.to(tl.int64)
    i = tl.arange(0, BLOCK_M)   # query i: row r of the tile, in the query head of its group g
    r = part * (BLOCK_M // GROUP_P) + i // GROUP_P
    g = i % GROUP_P
    live = (r < count) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    rows = first + r
    head = kv_head * GROUP + g
    req = tl.load(req_ptr + first, mask=count > 0, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=live, other=-1).to(tl.int32)
    qmask = live[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qr + head[:, None] * stride_qh + d[None, :], mask=qmask,
                other=0.0)
    q = as_query(q, k_ptr.dtype.element_ty)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_bt
    kv_base = kv_head * stride_kvh
    hi = tl.max(pos, 0) + 1
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)   # each row's first key
    # Keys before the tile's first window start are not even loaded (behind a window their
    # pages may be gone: the null page). Without a window, key blocks below the tile's
    # smallest position are visible to every row: no mask; with one, every block is masked.
    tile_lo = tl.min(tl.where(live, lo, hi), 0)
    first_key = tile_lo // BLOCK_N * BLOCK_N
    full = (tl.min(tl.where(live, pos, hi), 0) + 1) // BLOCK_N * BLOCK_N
    full = tl.where(window > 0, first_key, full)
    for start in range(first_key, full, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        m, l, acc = attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_base, kpos,
                                 (kpos < hi) & (kpos >= tile_lo), pos, lo, stride_slot, qk_scale,
                                 False, HEAD_DIM, PAGE_SIZE, BLOCK_D, PRECISION)
    for start in range(full, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        m, l, acc = attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_base, kpos,
                                 (kpos < hi) & (kpos >= tile_lo), pos, lo, stride_slot, qk_scale,
                                 True, HEAD_DIM, PAGE_SIZE, BLOCK_D, PRECISION)
    o = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale
    tl.store(out_ptr + rows[:, None] * stride_or + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def check_paged_inputs(q, kv_cache, block_tables, row_request, positions):
    if q.dim() != 3:
        raise InternalError(f"q must be [Q, H, D]; got {tuple(q.shape)}")
    rows, heads, head_dim = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[4] != head_dim:
        raise InternalError(f"kv_cache must be [L, 2, slots, Hkv, {head_dim}]; "
                            f"got {tuple(kv_cache.shape)}")
    kv_heads = kv_cache.shape[3]
    if heads % kv_heads:
        raise InternalError(f"num heads {heads} must be a multiple of kv heads {kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} must be <= {MAX_HEAD_DIM}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise InternalError("block_tables must be a [R, M] table with contiguous rows")
    if row_request.shape != (rows,) or positions.shape != (rows,):
        raise InternalError(f"row_request and positions must be [{rows}]; got "
                            f"{tuple(row_request.shape)} and {tuple(positions.shape)}")
    if kv_cache.stride(4) != 1:
        raise InternalError("kv_cache must have a contiguous head_dim")


def cache_views(q, kv_cache, layer):
    """Kernel arguments shared by decode and extend: K/V views, blocks, dot precision (of
    the type products run in: see ``as_query``)."""
    k_cache, v_cache = kv_cache[layer].unbind(0)   # one indexing op, not two: every eager attention
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_d = max(16, next_power_of_2(q.shape[2]))
    products = q.dtype if kv_fp8.is_fp8(kv_cache.dtype) else kv_cache.dtype
    precision = "ieee" if products == torch.float32 else "tf32"
    return q, k_cache, v_cache, block_d, precision


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


class ExtendPlan(NamedTuple):
    """Tiles of one extend batch: tile t holds the rows ``[first[t], first[t + 1])`` of
    one request, at most ``block_m`` of them; ``first`` ends with the number of rows."""
    first: torch.Tensor
    block_m: int


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _tile_plan_kernel(req_ptr, first_ptr, rows, max_tiles, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """One program: a tile starts at every run start of ``row_request`` and every BLOCK_M
    rows into a run; their rows, in order, go to ``first`` (the rest of it holds ``rows``,
    written after, to entries the tiles did not take)."""
    run_start = tl.program_id(0) * 0
    tiles = tl.program_id(0) * 0
    for base in range(0, rows, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        live = offs < rows
        req = tl.load(req_ptr + offs, mask=live, other=-1)
        prev = tl.load(req_ptr + offs - 1, mask=live & (offs > 0), other=-1)
        starts = tl.associative_scan(tl.where(live & (req != prev), offs, run_start), 0, _maximum)
        is_tile = live & ((offs - starts) % BLOCK_M == 0)
        ids = tiles + tl.cumsum(is_tile.to(tl.int32), 0) - 1
        tl.store(first_ptr + ids, offs, mask=is_tile & (ids < max_tiles))
        tiles += tl.sum(is_tile.to(tl.int32), 0)
        run_start = tl.max(starts, 0)
    for base in range(0, max_tiles + 1, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        tl.store(first_ptr + offs, rows, mask=(offs >= tl.minimum(tiles, max_tiles)) & (offs <= max_tiles))


def extend_tile_plan(row_request: torch.Tensor, max_runs: int, block_m: int = EXTEND_BLOCK_M) -> ExtendPlan:
    """The tiles of a batch whose ``row_request`` has at most ``max_runs`` runs of equal
    values, built on the device without a sync (the grid is sized for the most tiles).
    Extend batches keep each request's rows together (``plan_extend``, the decoder view),
    so their runs are at most the table's rows; tiles past the bound are never written."""
    rows = row_request.shape[0]
    max_tiles = tile_capacity(rows, max_runs, block_m)
    first = torch.empty(max_tiles + 1, dtype=torch.int32, device=row_request.device)
    _tile_plan_kernel[(1,)](row_request, first, rows, max_tiles, BLOCK_M=block_m, BLOCK=TILE_PLAN_BLOCK)
    return ExtendPlan(first, block_m)


def extend_block_n(head_dim: int) -> int:
    """Keys per block: a sweep on the H200 (bf16, 32 heads over 8 KV heads of 64, 512 rows
    after 8192 cached and 2048 fresh) took 130 and 94 us with 128 keys and 3 stages against
    222 and 160 us with 64 and 2 (docs/PERFORMANCE.md); wider heads keep the tiles' shared
    memory as it was."""
    return 128 if head_dim <= 64 else 64 if head_dim <= 128 else 32


def extend_attention(q, kv_cache, layer, block_tables, row_request, positions, scale,
                     page_size, plan: ExtendPlan = None, window: int = 0, k_scale: float = 1.0,
                     v_scale: float = 1.0):
    """Ragged causal attention of many rows per request (prefix hits included), each
    request's rows together; ``plan`` (``extend_tile_plan``'s, or the step's from
    ``plan_extend`` with tiles of ``EXTEND_BLOCK_M`` rows) is built here unless given: rows
    outside its tiles are left undefined; ``window``: each row sees only its last
    ``window`` positions (0: all); ``k_scale``, ``v_scale``: a float8 cache's."""
    check_paged_inputs(q, kv_cache, block_tables, row_request, positions)
    rows, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if rows == 0 or (plan is not None and len(plan.first) < 2):   # no rows, or none planned
        return out
    q, k_cache, v_cache, block_d, precision = cache_views(q, kv_cache, layer)
    plan = plan if plan is not None else extend_tile_plan(row_request, block_tables.shape[0])
    block_n = extend_block_n(head_dim)
    group = heads // kv_cache.shape[3]
    group_p = next_power_of_2(group)
    k_scale, v_scale = kv_fp8.applied(kv_cache.dtype, k_scale, v_scale)
    if group_p > plan.block_m:
        raise ValueError(f"{heads} query heads over {kv_cache.shape[3]} KV heads: at most "
                         f"{plan.block_m} query heads per KV head")
    # A program takes one KV head and 1 / group_p of a tile's rows in each query head that
    # reads it, so a key block it loads serves the group's heads at once: a one-row tile (a
    # decode row in a mixed step) reads its keys once per KV head, not once per query head.
    # Programs start in grid order, the first axis fastest. A padded plan's real tiles come
    # first, so with the heads on the first axis every real program starts before any empty
    # one (a 1B step of 512 rows after 8192 cached, 8 real tiles of 136: 235 us a layer
    # with the tiles first, 176 with the heads first).
    _extend_kernel[(kv_cache.shape[3] * group_p, len(plan.first) - 1)](
        q, k_cache, v_cache, block_tables, row_request, positions, out, plan.first,
        scale * LOG2E * k_scale, v_scale, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision,
        num_warps=EXTEND_WARPS, num_stages=EXTEND_STAGES,
        **pdl.launch_options(q.device))
    return out
