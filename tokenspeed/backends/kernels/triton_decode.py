"""Triton paged decode attention: one query row per request, optionally with its rotary
embedding and cache write fused in.

One program serves all query heads of a KV-head group (each page is read once per group,
and the group fills the M side of ``tl.dot``), and the KV length is split across programs
(flash-decoding) so a few long requests still occupy every SM; a second small kernel
merges the splits by their log-sum-exp. The split count is fixed when a graph is captured,
so the splits past a row's actual length end at once and are not merged. Nothing reads a
tensor value on the host and the grid depends only on shapes and Python ints, so both
launches can be captured.

``rope_decode_attention`` takes q, k and v as the projection wrote them. Each program
rotates its q heads; the program whose split holds the row's own position rotates that
key, attends to it from registers and writes it and its value to the cache: the kernel
that did only this (``triton_fused.rope_and_write_kv``) cost a launch per layer. With a
float8 cache that key is attended as the cache stores it (quantized), as a later step reads
it; the scales are folded in as ``triton_attention`` folds them.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import kv_fp8, pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_cache import as_query, to_cache
from tokenspeed.backends.kernels.triton_attention import LOG2E, attend_block, \
    attend_loaded, cache_views, check_paged_inputs, load_block, sm_count
from tokenspeed.errors import InternalError

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 128


class NewKey(NamedTuple):
    """The row's own key and value, unrotated, and where the cache keeps them."""
    k: torch.Tensor
    v: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor


class HeadNorms(NamedTuple):
    """The per-head RMSNorm weights of q and k (Qwen3's ``q_norm``, ``k_norm``; None: no
    norm), applied before the rotation as ``tokenspeed::rms_norm`` computes them."""
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    eps: float = 0.0


@triton.jit
def _head_normed(x, nw_ptr, idx, inv, ty, HEAD_DIM: tl.constexpr):
    """``rms_norm``'s rounding: ``(x * inv)`` in the row's dtype ``ty``, times the weight at
    ``idx``, in ``ty`` again (fp32 values out)."""
    w = tl.load(nw_ptr + idx, mask=idx < HEAD_DIM, other=0.0).to(tl.float32)
    return (w * (x * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)


@triton.jit
def _rotated(row_ptr, d, mask, cos_sin_row, nw_ptr, eps, HALF: tl.constexpr, NORM: tl.constexpr,
             AXIS: tl.constexpr):
    """Rotate-half rotary of the rows at ``row_ptr`` (one per head), fp32, as
    ``triton_fused._rotate`` computes it: x1 cos - x2 sin, x2 cos + x1 sin. NORM: each head
    first RMS-normalised over its ``2 * HALF`` values (along ``AXIS``) with weight ``nw_ptr``."""
    first = d < HALF
    j = tl.where(first, d, d - HALF)
    other = tl.where(first, d + HALF, d - HALF)
    x = tl.load(row_ptr + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(row_ptr + other, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=AXIS, keep_dims=True) / (2 * HALF) + eps)
        x = _head_normed(x, nw_ptr, d, inv, row_ptr.dtype.element_ty, 2 * HALF)
        partner = _head_normed(partner, nw_ptr, other, inv, row_ptr.dtype.element_ty, 2 * HALF)
    cos = tl.load(cos_sin_row + j, mask=d < 2 * HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + j, mask=d < 2 * HALF, other=0.0).to(tl.float32)
    return tl.where(first, x * cos - partner * sin, x * cos + partner * sin)


@triton.jit
def _attend_new_key(q, m, l, acc, k, v, qk_scale):
    """One online-softmax step (base 2) over the row's own key, as ``attend_block`` (``k``
    and ``v`` as the cache holds them)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * qk_scale
    m_new = tl.maximum(m, s)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new)
    l = l * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * \
        v.to(tl.float32)[None, :]
    return m_new, l, acc


@triton.jit
def _split_size(length, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a row of ``length`` keys, whole blocks; splits from
    ``cdiv(length, size)`` on hold none."""
    return tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _first_key(pos, window):
    """The first position a row at ``pos`` attends to: its window's start, else 0."""
    return tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr, mid_o_ptr,
                   mid_lse_ptr, kn_ptr, vn_ptr, cs_ptr, slot_ptr, qn_ptr, kw_ptr, norm_eps, stride_sm, qk_scale,
                   k_scale, v_scale, window,
                   stride_qr, stride_qh, stride_or, stride_oh, stride_bt, stride_slot, stride_kvh,
                   stride_knr, stride_knh, stride_vnr, stride_vnh, stride_cs,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                   ROPE: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """ROPE: q, k_new, v_new are unrotated; the cache does not hold the row's key yet.
    Q_NORM, K_NORM (with ROPE): each head of q, of the new key, RMS-normalised first.

    Before waiting on the previous kernel (PDL) a program reads what no kernel of this step
    writes: the step's metadata (copied in before its first kernel) and, with ROPE, its
    first block of cached keys (written by earlier steps). That holds because a decode step
    has one row per request and only this kernel writes the layer's cache; several rows of
    one request (a verify window) would each need the others' keys, after the wait.

    A split that starts past its row's end (the split count comes from the longest context
    the table allows, so at short contexts most do) ends there: it writes nothing, the merge
    skips it, and it need not wait, since the row's first split always waits."""
    pdl.start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(req_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    first_key = _first_key(pos, window)
    per_split = _split_size(pos + 1 - first_key, NUM_SPLITS, BLOCK_N)
    lo = first_key + split * per_split
    hi = tl.minimum(lo + per_split, pos + 1)
    cached_hi = hi
    bt_row = bt_ptr + req * stride_bt
    kpos = lo + tl.arange(0, BLOCK_N)
    if ROPE:  # the row's own key is not in the cache yet
        cached_hi = tl.minimum(hi, pos)
        k0, v0 = load_block(k_ptr, v_ptr, bt_row, kv_head * stride_kvh, kpos, kpos < cached_hi,
                            stride_slot, HEAD_DIM, PAGE_SIZE, BLOCK_D)
    if lo <= pos:  # a split past the row's end has nothing to read, write or merge
        pdl.wait(USE_PDL)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        hmask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        q_rows = q_ptr + row * stride_qr + heads[:, None] * stride_qh
        cs_row = cs_ptr + pos.to(tl.int64) * stride_cs
        if ROPE:
            q = _rotated(q_rows, d[None, :], hmask, cs_row, qn_ptr, norm_eps, HEAD_DIM // 2, Q_NORM, 1)
            q = q.to(q_ptr.dtype.element_ty)
        else:
            q = tl.load(q_rows + d[None, :], mask=hmask, other=0.0)
        q = as_query(q, k_ptr.dtype.element_ty)
        m = tl.full([BLOCK_G], -1e30, tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        first = lo
        if ROPE:
            m, l, acc = attend_loaded(q, m, l, acc, k0, v0, kpos, kpos < cached_hi, g, g,
                                      qk_scale, False, PRECISION)
            first = lo + BLOCK_N
        for start in range(first, cached_hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            m, l, acc = attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_head * stride_kvh,
                                     kpos, kpos < cached_hi, g, g, stride_slot, qk_scale, False,
                                     HEAD_DIM, PAGE_SIZE, BLOCK_D, PRECISION)
        if ROPE:
            if (lo <= pos) & (pos < hi):  # this split holds the row's own key
                dmask = d < HEAD_DIM
                k = _rotated(kn_ptr + row * stride_knr + kv_head * stride_knh, d, dmask, cs_row, kw_ptr,
                             norm_eps, HEAD_DIM // 2, K_NORM, 0).to(kn_ptr.dtype.element_ty)
                k = to_cache(k, k_scale, k_ptr.dtype.element_ty)
                v = tl.load(vn_ptr + row * stride_vnr + kv_head * stride_vnh + d, mask=dmask, other=0.0)
                v = to_cache(v, v_scale, v_ptr.dtype.element_ty)
                m, l, acc = _attend_new_key(q, m, l, acc, k, v, qk_scale)
                slot = tl.load(slot_ptr + row * stride_sm).to(tl.int64) * stride_slot \
                    + kv_head * stride_kvh
                tl.store(k_ptr + slot + d, k, mask=dmask)
                tl.store(v_ptr + slot + d, v, mask=dmask)
        safe_l = tl.where(l > 0, l, 1.0)
        o = acc / safe_l[:, None] * v_scale
        if NUM_SPLITS == 1:
            tl.store(out_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=hmask)
        else:
            part = (row * NUM_HEADS + heads) * NUM_SPLITS + split
            tl.store(mid_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=hmask)
            lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
            tl.store(mid_lse_ptr + part, lse, mask=g < GROUP)


@triton.jit
def _combine_kernel(mid_o_ptr, mid_lse_ptr, pos_ptr, out_ptr, window, stride_or, stride_oh,
                    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """Merges the splits that hold keys (the others wrote nothing) by their log-sum-exp."""
    pdl.start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    length = pos + 1 - _first_key(pos, window)
    active = tl.cdiv(length, _split_size(length, NUM_SPLITS, BLOCK_N))
    pdl.wait(USE_PDL)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (row * NUM_HEADS + head) * NUM_SPLITS + s
    lse = tl.load(mid_lse_ptr + part, mask=s < active, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    omask = (s[:, None] < active) & (d[None, :] < HEAD_DIM)
    o = tl.load(mid_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=omask, other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def choose_num_splits(rows: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """Splits per row so rows*kv_heads*splits covers ~2 waves, each split >= 128 keys."""
    by_occupancy = triton.cdiv(2 * sm_count, max(1, rows * kv_heads))
    by_length = triton.cdiv(max(1, max_context), MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def decode_attention(q, kv_cache, layer, block_tables, row_request, positions, scale,
                     page_size, num_splits=None, max_context=None, window: int = 0, k_scale: float = 1.0,
                     v_scale: float = 1.0):
    """One query row per request; CUDA-graph safe. ``window``: each row sees only its last
    ``window`` positions (0: all); the splits share the window. ``k_scale``, ``v_scale``:
    a float8 cache's.

    ``num_splits`` (if given) fixes the KV split count; otherwise it is chosen from
    ``max_context`` (a Python int upper bound on positions+1), defaulting to the block-table
    width * page_size, and from the row count rounded up to a power of two: a batch and the
    ladder rung it pads to then split alike whenever powers of two are rungs (the default
    ladder), so replay and eager reduce every row in the same order. Nothing reads tensor
    values, so the launch is capturable.
    """
    check_paged_inputs(q, kv_cache, block_tables, row_request, positions)
    return _decode(q, kv_cache, layer, block_tables, row_request, positions, scale, page_size,
                   num_splits, max_context, window, (k_scale, v_scale))


def rope_decode_attention(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping,
                          block_tables, row_request, scale, page_size, num_splits=None,
                          max_context=None, window: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
                          head_norms: HeadNorms = HeadNorms()):
    """``rope_and_write_kv`` then ``decode_attention`` in one kernel: q [R, H, D], k and v
    [R, Hkv, D] unrotated, ``cos_sin`` the ``[pos, D]`` table; k and v reach the cache.
    ``head_norms``: q's and k's per-head RMSNorms, applied first (``[D]`` weights)."""
    for name, weight in (("q", head_norms.q), ("k", head_norms.k)):
        if weight is not None and weight.shape != (q.shape[2],):
            raise InternalError(f"the {name} norm's weight must be [{q.shape[2]}]; got {tuple(weight.shape)}")
    check_paged_inputs(q, kv_cache, block_tables, row_request, positions)
    if k.shape != v.shape or k.shape != (q.shape[0], *kv_cache.shape[3:]):
        raise InternalError(f"k and v must be [{q.shape[0]}, {kv_cache.shape[3]}, "
                            f"{kv_cache.shape[4]}]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] % 2 or cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2]:
        raise InternalError(f"head_dim {q.shape[2]} must be even and the cos_sin table "
                            f"[positions, {q.shape[2]}]; got {tuple(cos_sin.shape)}")
    if slot_mapping.shape != (q.shape[0],):
        raise InternalError(f"slot_mapping must be [{q.shape[0]}]; got {tuple(slot_mapping.shape)}")
    new = NewKey(*(t if t.stride(-1) == 1 else t.contiguous() for t in (k, v, cos_sin)),
                 slot_mapping)   # may be a cache group's column of several groups' slots
    return _decode(q, kv_cache, layer, block_tables, row_request, positions, scale, page_size,
                   num_splits, max_context, window, (k_scale, v_scale), new=new, head_norms=head_norms)


def _decode(q, kv_cache, layer, block_tables, row_request, positions, scale, page_size,
            num_splits, max_context, window, kv_scales, *, new: NewKey | None = None,
            head_norms: HeadNorms = HeadNorms()):
    """The launches; ``new``: the row's own key, unrotated (``rope_decode_attention``), with
    ``head_norms`` to apply first; ``kv_scales``: (key, value) scales of a float8 cache."""
    rows, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    q, k_cache, v_cache, block_d, precision = cache_views(q, kv_cache, layer)
    if num_splits is None:
        context = max_context if max_context is not None else block_tables.shape[1] * page_size
        pow2_rows = 1 << max(rows - 1, 0).bit_length()
        num_splits = choose_num_splits(pow2_rows, kv_heads, context, sm_count(q.device))
    if not 1 <= num_splits <= 1024:
        raise InternalError(f"num_splits {num_splits} must be in 1..1024")
    mid_o = torch.empty((rows, heads, num_splits, head_dim), dtype=torch.float32,
                        device=q.device) if num_splits > 1 else out
    mid_lse = torch.empty((rows, heads, num_splits), dtype=torch.float32,
                          device=q.device) if num_splits > 1 else out
    launch = pdl.launch_options(q.device)
    block_n = 64 if head_dim <= 128 else 32
    kn, vn, cos_sin, slots = new if new is not None else (q, q, q, positions)  # unread
    k_scale, v_scale = kv_fp8.applied(kv_cache.dtype, *kv_scales)
    _decode_kernel[(rows, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, row_request, positions, out, mid_o, mid_lse,
        kn, vn, cos_sin, slots, *(q if w is None else w for w in head_norms[:2]), head_norms.eps, slots.stride(0),
        scale * LOG2E * k_scale, k_scale, v_scale, window,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cos_sin.stride(0),
        NUM_HEADS=heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, BLOCK_G=max(16, next_power_of_2(heads // kv_heads)),
        BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision,
        ROPE=new is not None, Q_NORM=head_norms.q is not None, K_NORM=head_norms.k is not None, num_warps=4,
        num_stages=2, **launch)
    if num_splits > 1:
        _combine_kernel[(rows, heads)](
            mid_o, mid_lse, positions, out, window, out.stride(0), out.stride(1),
            NUM_HEADS=heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_N=block_n,
            BLOCK_S=next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=2,
            **launch)
    return out
