"""Triton paged attention over the KV cache of ``reference.py``: extend, and the pieces
decode shares (``triton_decode.py``).

Semantics match ``reference.paged_attention``: query row r attends causally to positions
0..positions[r] of request row_request[r], found through block_tables[row_request[r]];
query head h reads KV head h // (H // Hkv); scores, softmax and sums run in fp32.

``extend_attention`` has many rows per request. Tiles of BLOCK_M consecutive rows of one
request share every key block through ``tl.dot``; the tile plan is built on the host (one
sync), once per batch if the caller passes it to every layer.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl

MAX_HEAD_DIM = 256
DEFAULT_SMS = 132
LOG2E = 1.4426950408889634
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64
EXTEND_WARPS = 4
EXTEND_STAGES = 2


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
def attend_loaded(q, m, l, acc, k, v, kpos, valid, pos, qk_scale, CAUSAL: tl.constexpr,
                  PRECISION: tl.constexpr):
    """One online-softmax step (base 2) over a loaded key block.

    CAUSAL masks key j for query row i unless j <= pos[i]; otherwise only ``valid`` keys."""
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_base, kpos, valid, pos, stride_slot,
                 qk_scale, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """``load_block`` then ``attend_loaded``."""
    k, v = load_block(k_ptr, v_ptr, bt_row, kv_base, kpos, valid, stride_slot, HEAD_DIM,
                      PAGE_SIZE, BLOCK_D)
    return attend_loaded(q, m, l, acc, k, v, kpos, valid, pos, qk_scale, CAUSAL, PRECISION)


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr, tile_first_ptr,
                   tile_count_ptr, qk_scale, stride_qr, stride_qh, stride_or, stride_oh,
                   stride_bt, stride_slot, stride_kvh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(tile_first_ptr + tile).to(tl.int64)
    count = tl.load(tile_count_ptr + tile)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    rows = first + r
    req = tl.load(req_ptr + first).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=r < count, other=-1).to(tl.int32)
    qmask = (r[:, None] < count) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qr + head * stride_qh + d[None, :], mask=qmask,
                other=0.0).to(k_ptr.dtype.element_ty)
    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req * stride_bt
    kv_base = (head // GROUP) * stride_kvh
    hi = tl.max(pos, 0) + 1
    # Key blocks below the tile's smallest position are visible to every row: no causal mask.
    full = (tl.min(tl.where(r < count, pos, hi), 0) + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        m, l, acc = attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_base, kpos,
                                 kpos < hi, pos, stride_slot, qk_scale, False, HEAD_DIM,
                                 PAGE_SIZE, BLOCK_D, PRECISION)
    for start in range(full, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        m, l, acc = attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_base, kpos,
                                 kpos < hi, pos, stride_slot, qk_scale, True, HEAD_DIM,
                                 PAGE_SIZE, BLOCK_D, PRECISION)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_or + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def check_paged_inputs(q, kv_cache, block_tables, row_request, positions):
    if q.dim() != 3:
        raise ValueError(f"q must be [Q, H, D]; got {tuple(q.shape)}")
    rows, heads, head_dim = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [L, 2, slots, Hkv, {head_dim}]; "
                         f"got {tuple(kv_cache.shape)}")
    kv_heads = kv_cache.shape[3]
    if heads % kv_heads:
        raise ValueError(f"num heads {heads} must be a multiple of kv heads {kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} must be <= {MAX_HEAD_DIM}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a [R, M] table with contiguous rows")
    if row_request.shape != (rows,) or positions.shape != (rows,):
        raise ValueError(f"row_request and positions must be [{rows}]; got "
                         f"{tuple(row_request.shape)} and {tuple(positions.shape)}")
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must have a contiguous head_dim")


def cache_views(q, kv_cache, layer):
    """Kernel arguments shared by decode and extend: K/V views, blocks, dot precision."""
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_d = max(16, triton.next_power_of_2(q.shape[2]))
    precision = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    return q, k_cache, v_cache, block_d, precision


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


class ExtendPlan(NamedTuple):
    """Tiles of one extend batch: ``first[t]``/``count[t]`` rows of one request each."""
    first: torch.Tensor
    count: torch.Tensor
    block_m: int


def extend_tile_plan(row_request: torch.Tensor, block_m: int = None) -> ExtendPlan:
    """Cut each run of equal row_request into tiles of at most block_m rows (host side).

    The plan depends only on row_request, so compute it once per batch and pass it to
    every layer's ``extend_attention``. block_m defaults to 16..64 by the longest run."""
    runs = row_request.cpu()
    _, counts = torch.unique_consecutive(runs, return_counts=True)
    if block_m is None:
        longest = int(counts.max()) if len(counts) else 1
        block_m = min(EXTEND_BLOCK_M, max(16, triton.next_power_of_2(longest)))
    run_first = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    run = torch.repeat_interleave(torch.arange(len(counts)), tiles)
    index = torch.arange(len(run)) - (torch.cumsum(tiles, 0) - tiles)[run]
    first = run_first[run] + index * block_m
    count = torch.clamp(counts[run] - index * block_m, max=block_m)
    device = row_request.device
    return ExtendPlan(first.to(device, torch.int32), count.to(device, torch.int32), block_m)


def extend_attention(q, kv_cache, layer, block_tables, row_request, positions, scale,
                     page_size, plan: ExtendPlan = None):
    """Ragged causal attention of many rows per request (prefix hits included); eager only
    unless ``plan`` (from ``extend_tile_plan``) is given, which removes every host sync."""
    check_paged_inputs(q, kv_cache, block_tables, row_request, positions)
    rows, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    q, k_cache, v_cache, block_d, precision = cache_views(q, kv_cache, layer)
    plan = plan if plan is not None else extend_tile_plan(row_request)
    block_n = EXTEND_BLOCK_N if head_dim <= 128 else 32
    _extend_kernel[(len(plan.first), heads)](
        q, k_cache, v_cache, block_tables, row_request, positions, out, plan.first, plan.count,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        GROUP=heads // kv_cache.shape[3], HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision,
        num_warps=EXTEND_WARPS, num_stages=EXTEND_STAGES,
        **pdl.launch_options(q.device))
    return out
