"""A whole Llama decoder layer's decode step in one launch (``tokenspeed::decode_layer``).

A decode step of a small model is bound by its kernel boundaries, not its bytes: the
default model's layer reads 7 MB (1.7 us at the H200's bandwidth) in five or six kernels
of 2-3 us each, every one waiting for the last to finish and flush. Here one grid of one
program per SM runs the layer's five phases, separated by grid barriers (a counter every
program adds to and waits on), and each program loads its next phase's weight tile before
it waits at the barrier, so the weights stream in while the slowest program finishes:

A. the residual add, RMSNorm and QKV product, the rotary, q to scratch, k and v to the cache;
B. attention: (row, KV head, split of keys) items, partials to scratch;
C. the splits merged (each program merges all, from L2) and the output projection;
D. the residual add, RMSNorm and gate/up product with SiLU·mul;
E. the down projection.

Every program of the grid must be resident at once (one per SM, at most), or the barrier
would wait for a program that cannot start: a GPU shared through MPS with a cap on its SMs
would hang. Under the Triton interpreter, which runs programs one after another, the grid
is one program and every barrier is passed at once.
Each phase rounds as CUDA's unfused kernels do (the rotary in float32, as
``triton_decode``'s): only summation orders differ.
"""

import functools

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_attention import LOG2E, attend_block
from tokenspeed.errors import InternalError


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until every program has arrived ``target`` times in all (``target``: this
    barrier's number times the grid's size): a CTA barrier, then one release add and
    acquire polls at GPU scope, as cooperative groups' grid sync does."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _leave(bar_ptr):
    """The last program out zeroes both counters for the next launch: every other
    program has passed its last barrier by then."""
    tl.debug_barrier()
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(bar_ptr, 0)
        tl.store(bar_ptr + 1, 0)


@triton.jit
def _normed_row(x_ptr, delta_ptr, add_ptr, r, nw_ptr, eps, H: tl.constexpr, HP: tl.constexpr,
                HAS_DELTA: tl.constexpr, HAS_ADD: tl.constexpr):
    """Row ``r`` of the residual stream, ``x + delta (+ add)`` rounded to bf16 after each
    add as torch adds, and its RMSNorm (``reference.rms_norm``'s rounding); fp32 values."""
    ty = x_ptr.dtype.element_ty
    k = tl.arange(0, HP)
    km = k < H
    h = tl.load(x_ptr + r * H + k, mask=km, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h = (h + tl.load(delta_ptr + r * H + k, mask=km, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    if HAS_ADD:
        added = tl.load(add_ptr + r * H + k, mask=km, other=0.0, cache_modifier=".cg")
        h = (h + added.to(tl.float32)).to(ty).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / H + eps)
    w = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
    return (w * (h * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32), h


@triton.jit
def _qkv_tile_cols(t, D: tl.constexpr, BN: tl.constexpr):
    """Tile ``t`` of the QKV product: the head ``t // (D // BN)``, its columns
    ``j*BN/2 + [0, BN/2)`` from each half, so the rotary's pairs meet in one program."""
    HALF: tl.constexpr = BN // 2
    head = t // (D // BN)
    j = t % (D // BN)
    return head, j * HALF + tl.arange(0, HALF)


@triton.jit
def _tile(w_ptr, rows, valid, K: tl.constexpr, KP: tl.constexpr):
    """Weight rows ``rows`` of a ``[N, K]`` matrix, ``[len(rows), KP]`` (zeros past K)."""
    k = tl.arange(0, KP)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                   mask=valid & (k[None, :] < K), other=0.0)


@triton.jit
def _phase_a(t, wa, wb, x_ptr, delta_ptr, nw_ptr, eps, rows, pos_ptr, cs_ptr, slot_ptr, q_buf,
             k_ptr, v_ptr, stride_cs, stride_sm, stride_slot, stride_kvh,
             H: tl.constexpr, HP: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
             D: tl.constexpr, BN: tl.constexpr, HAS_DELTA: tl.constexpr):
    head, idx = _qkv_tile_cols(t, D, BN)
    for r in range(rows):
        a, _ = _normed_row(x_ptr, delta_ptr, x_ptr, r, nw_ptr, eps, H, HP, HAS_DELTA, False)
        y1 = tl.sum(wa.to(tl.float32) * a[None, :], 1).to(x_ptr.dtype.element_ty).to(tl.float32)
        y2 = tl.sum(wb.to(tl.float32) * a[None, :], 1).to(x_ptr.dtype.element_ty).to(tl.float32)
        if head < NQ + NKV:   # q and k rotate: x1 cos - x2 sin, x2 cos + x1 sin
            cs = cs_ptr + tl.load(pos_ptr + r).to(tl.int64) * stride_cs
            cos = tl.load(cs + idx).to(tl.float32)
            sin = tl.load(cs + D // 2 + idx).to(tl.float32)
            y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
        if head < NQ:
            dst = q_buf + (r * NQ + head) * D + idx
        else:
            slot = tl.load(slot_ptr + r * stride_sm).to(tl.int64) * stride_slot
            cache = k_ptr if head < NQ + NKV else v_ptr
            dst = cache + slot + ((head - NQ) % NKV) * stride_kvh + idx
        tl.store(dst, y1.to(dst.dtype.element_ty))
        tl.store(dst + D // 2, y2.to(dst.dtype.element_ty))


@triton.jit
def _phase_b(item, q_buf, k_ptr, v_ptr, bt_ptr, req_ptr, pos_ptr, mid_o, mid_lse, qk_scale,
             stride_bt, stride_slot, stride_kvh, NQ: tl.constexpr, NKV: tl.constexpr,
             D: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_G: tl.constexpr, PRECISION: tl.constexpr):
    """One split of one row's KV head: its keys' partial softmax for the head's queries."""
    GROUP: tl.constexpr = NQ // NKV
    row = item // (NKV * SPLITS)
    kv_head = (item // SPLITS) % NKV
    split = item % SPLITS
    pos = tl.load(pos_ptr + row)
    per_split = tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, pos + 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    part = (row * NQ + heads) * SPLITS + split
    if lo < hi:
        q = tl.load(q_buf + (row * NQ + heads[:, None]) * D + d[None, :], mask=g[:, None] < GROUP,
                    other=0.0, cache_modifier=".cg")
        bt_row = bt_ptr + tl.load(req_ptr + row).to(tl.int64) * stride_bt
        m = tl.full([BLOCK_G], -1e30, tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            m, l, acc = attend_block(q, m, l, acc, k_ptr, v_ptr, bt_row, kv_head * stride_kvh, kpos,
                                     kpos < hi, g, g, stride_slot, qk_scale, False, D, PAGE_SIZE, D, PRECISION)
        tl.store(mid_o + part[:, None] * D + d[None, :], acc / l[:, None], mask=g[:, None] < GROUP)
        tl.store(mid_lse + part, m + tl.log2(l), mask=g < GROUP)
    else:
        tl.store(mid_lse + part, float("-inf"), mask=g < GROUP)


@triton.jit
def _attention_row(r, mid_o, mid_lse, o_buf, NQ: tl.constexpr, NQP: tl.constexpr, D: tl.constexpr,
                   SPLITS: tl.constexpr):
    """Row ``r``'s attention output ``[NQP, D]``, its splits merged by log-sum-exp and
    rounded to the activations' type as the unfused attention returns it."""
    h = tl.arange(0, NQP)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    part = (r * NQ + h[:, None]) * SPLITS + s[None, :]
    lse = tl.load(mid_lse + part, mask=h[:, None] < NQ, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    w = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0)[:, None])
    o = tl.load(mid_o + part[:, :, None] * D + d[None, None, :], mask=(w > 0)[:, :, None], other=0.0,
                cache_modifier=".cg")
    total = tl.sum(w, 1)
    out = tl.sum(w[:, :, None] * o, 1) / tl.where(total > 0, total, 1.0)[:, None]
    return out.to(o_buf.dtype.element_ty).to(tl.float32)


@triton.jit
def _qkv_tiles(w_qkv, t, nt, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
    """Both halves' rows of QKV tile ``t`` (zeros past ``nt``)."""
    head, idx = _qkv_tile_cols(t, D, BN)
    valid = (idx[:, None] * 0 + t) < nt   # one block: a scalar's & a block's fails in the interpreter
    return _tile(w_qkv, head * D + idx, valid, H, HP), _tile(w_qkv, head * D + D // 2 + idx, valid, H, HP)


@triton.jit
def _o_tile(w_o, t, H: tl.constexpr, NQ: tl.constexpr, NQP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
    """Output-projection rows of tile ``t`` as ``[BN, NQP, D]`` (per head, zeros past H)."""
    cols = t * BN + tl.arange(0, BN)
    h = tl.arange(0, NQP)
    d = tl.arange(0, D)
    return tl.load(w_o + cols[:, None, None].to(tl.int64) * (NQ * D) + h[None, :, None] * D + d[None, None, :],
                   mask=(cols[:, None, None] < H) & (h[None, :, None] < NQ), other=0.0)


@triton.jit
def _gu_tiles(w_gu, t, H: tl.constexpr, HP: tl.constexpr, INTER: tl.constexpr, BN: tl.constexpr):
    cols = t * BN + tl.arange(0, BN)
    return _tile(w_gu, cols, cols[:, None] < INTER, H, HP), _tile(w_gu, INTER + cols, cols[:, None] < INTER, H, HP)


@triton.jit
def _down_tile(w_down, t, H: tl.constexpr, INTER: tl.constexpr, IP: tl.constexpr, BN: tl.constexpr):
    cols = t * BN + tl.arange(0, BN)
    return _tile(w_down, cols, cols[:, None] < H, INTER, IP)


@triton.jit
def _decode_layer_kernel(
        x_ptr, delta_ptr, res_out, down_out, in_norm, w_qkv, w_o, post_norm, w_gu, w_down,
        cs_ptr, pos_ptr, slot_ptr, bt_ptr, req_ptr, k_ptr, v_ptr,
        q_buf, mid_o, mid_lse, o_buf, act_buf, bar_ptr,
        rows, eps, qk_scale, stride_cs, stride_sm, stride_bt, stride_slot, stride_kvh,
        H: tl.constexpr, HP: tl.constexpr, INTER: tl.constexpr, IP: tl.constexpr,
        NQ: tl.constexpr, NQP: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
        PAGE_SIZE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
        HAS_DELTA: tl.constexpr, PRECISION: tl.constexpr, LAUNCH_NEXT: tl.constexpr, USE_PDL: tl.constexpr):
    """Each GEMV phase walks its tiles ``pid, pid + P, ...`` loading tile ``t + P`` while it
    computes tile ``t``; its first tile is loaded before the barrier it waits at. Past the
    last barrier every program is resident, so the next kernel (PDL) may start loading its
    weights while the down projection runs (``LAUNCH_NEXT``)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    # A: norm, QKV, rotary, cache write
    nt = (NQ + 2 * NKV) * (D // BN_QKV)
    wa, wb = _qkv_tiles(w_qkv, pid, nt, H, HP, D, BN_QKV)
    pdl.wait(USE_PDL)
    for t in range(pid, nt, P):
        na, nb = _qkv_tiles(w_qkv, t + P, nt, H, HP, D, BN_QKV)
        _phase_a(t, wa, wb, x_ptr, delta_ptr, in_norm, eps, rows, pos_ptr, cs_ptr, slot_ptr, q_buf,
                 k_ptr, v_ptr, stride_cs, stride_sm, stride_slot, stride_kvh, H, HP, NQ, NKV, D, BN_QKV, HAS_DELTA)
        wa, wb = na, nb
    _grid_sync(bar_ptr, P)
    # B: attention partials
    for item in range(pid, rows * NKV * SPLITS, P):
        _phase_b(item, q_buf, k_ptr, v_ptr, bt_ptr, req_ptr, pos_ptr, mid_o, mid_lse, qk_scale,
                 stride_bt, stride_slot, stride_kvh, NQ, NKV, D, PAGE_SIZE, SPLITS, BLOCK_N, BLOCK_G, PRECISION)
    wo = _o_tile(w_o, pid, H, NQ, NQP, D, BN_O)
    _grid_sync(bar_ptr, 2 * P)
    # C: merge, output projection
    for t in range(pid, tl.cdiv(H, BN_O), P):
        nwo = _o_tile(w_o, t + P, H, NQ, NQP, D, BN_O)
        cols = t * BN_O + tl.arange(0, BN_O)
        for r in range(rows):
            att = _attention_row(r, mid_o, mid_lse, o_buf, NQ, NQP, D, SPLITS)
            y = tl.sum(tl.sum(wo.to(tl.float32) * att[None, :, :], 2), 1)
            tl.store(o_buf + r * H + cols, y.to(o_buf.dtype.element_ty), mask=cols < H)
        wo = nwo
    wg, wu = _gu_tiles(w_gu, pid, H, HP, INTER, BN_GU)
    _grid_sync(bar_ptr, 3 * P)
    # D: residual add, norm, gate/up, SiLU·mul
    for t in range(pid, tl.cdiv(INTER, BN_GU), P):
        ng, nu = _gu_tiles(w_gu, t + P, H, HP, INTER, BN_GU)
        cols = t * BN_GU + tl.arange(0, BN_GU)
        for r in range(rows):
            b, h1 = _normed_row(x_ptr, delta_ptr, o_buf, r, post_norm, eps, H, HP, HAS_DELTA, True)
            if t == 0:
                k = tl.arange(0, HP)
                tl.store(res_out + r * H + k, h1.to(res_out.dtype.element_ty), mask=k < H)
            g = tl.sum(wg.to(tl.float32) * b[None, :], 1).to(act_buf.dtype.element_ty).to(tl.float32)
            u = tl.sum(wu.to(tl.float32) * b[None, :], 1).to(act_buf.dtype.element_ty).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(act_buf.dtype.element_ty).to(tl.float32)
            tl.store(act_buf + r * INTER + cols, (silu * u).to(act_buf.dtype.element_ty), mask=cols < INTER)
        wg, wu = ng, nu
    wd = _down_tile(w_down, pid, H, INTER, IP, BN_DOWN)
    _grid_sync(bar_ptr, 4 * P)
    if LAUNCH_NEXT:
        pdl.start(USE_PDL)
    # E: down projection
    for t in range(pid, tl.cdiv(H, BN_DOWN), P):
        nwd = _down_tile(w_down, t + P, H, INTER, IP, BN_DOWN)
        cols = t * BN_DOWN + tl.arange(0, BN_DOWN)
        for r in range(rows):
            k = tl.arange(0, IP)
            a = tl.load(act_buf + r * INTER + k, mask=k < INTER, other=0.0, cache_modifier=".cg")
            y = tl.sum(wd.to(tl.float32) * a.to(tl.float32)[None, :], 1)
            tl.store(down_out + r * H + cols, y.to(down_out.dtype.element_ty), mask=cols < H)
        wd = nwd
    _leave(bar_ptr)


def grid_size(device: torch.device) -> int:
    """One program per SM on a GPU (all resident at once); one under the interpreter."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_rows(n: int, k: int, programs: int, budget: int, most: int = 64, padded: int = 0) -> int:
    """Weight rows a GEMV tile holds, by a cost in microseconds: a round of tiles costs a
    memory latency (~1 us), a program's bytes their share of the bandwidth (~25 KB/us an
    SM); a tile holds at most ``budget`` elements of its ``padded`` width (default ``k``)."""
    padded = padded or k
    sizes = [1 << i for i in range(most.bit_length()) if (1 << i) * padded <= budget] or [1]

    def cost(bn):
        rounds = triton.cdiv(triton.cdiv(n, bn), programs)
        return rounds + rounds * bn * k * 2 / 25e3, -bn
    return min(sizes, key=cost)


def decode_layer(x, residual, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, eps,
                 cos_sin, positions, kv_cache, layer, slot_mapping, block_tables, row_request, scale, num_heads,
                 num_kv_heads, split_counters, *, splits=None, programs=None, num_warps=None, launch_next=True):
    """``tokenspeed::decode_layer`` in one launch; ``split_counters``' first two serve the
    barriers (zeroed, and left so). ``splits`` (KV splits a row and head), ``programs`` and
    ``num_warps`` override the choices (for measuring)."""
    if split_counters is None or split_counters.numel() < 2:
        raise InternalError("decode_layer needs split_counters: two zeroed int32 for its barriers")
    weights = (input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight)
    if not all(w.is_contiguous() for w in weights):
        raise InternalError("decode_layer reads its weights as contiguous rows")
    x, cos_sin = x.contiguous(), cos_sin.contiguous()
    residual = residual if residual is None else residual.contiguous()
    rows, hidden = x.shape
    head_dim = qkv_weight.shape[0] // (num_heads + 2 * num_kv_heads)
    inter = down_weight.shape[1]
    k_cache, v_cache = kv_cache.flatten(2, 3)[layer].unbind(0)
    programs = programs or grid_size(x.device)
    hp, ip, nqp = next_power_of_2(hidden), next_power_of_2(inter), next_power_of_2(num_heads)
    splits = splits or choose_splits(rows, num_kv_heads, block_tables.shape[1] * kv_cache.shape[3], programs,
                                     nqp * head_dim)
    widest = max(2 * hp, ip, 4 * nqp * head_dim, 2 * nqp * splits * head_dim)   # the merge's tile: float32
    num_warps = num_warps or (4 if widest <= 8192 else 8)
    budget = 64 * 32 * num_warps
    scratch = functools.partial(torch.empty, device=x.device)
    mid_o = scratch((rows, num_heads, splits, head_dim), dtype=torch.float32)
    mid_lse = scratch((rows, num_heads, splits), dtype=torch.float32)
    q_buf, o_buf = scratch((rows, num_heads, head_dim), dtype=x.dtype), torch.empty_like(x)
    act_buf = scratch((rows, inter), dtype=x.dtype)
    res_out, down_out = torch.empty_like(x), torch.empty_like(x)
    _decode_layer_kernel[(programs,)](
        x, x if residual is None else residual, res_out, down_out, input_norm, qkv_weight, o_weight, post_norm,
        gate_up_weight, down_weight, cos_sin, positions, slot_mapping, block_tables, row_request, k_cache, v_cache,
        q_buf, mid_o, mid_lse, o_buf, act_buf, split_counters,
        rows, eps, scale * LOG2E, cos_sin.stride(0), slot_mapping.stride(0), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        H=hidden, HP=hp, INTER=inter, IP=ip, NQ=num_heads, NQP=nqp, NKV=num_kv_heads, D=head_dim,
        PAGE_SIZE=kv_cache.shape[3], SPLITS=splits, BLOCK_N=64,
        BLOCK_G=max(16, next_power_of_2(num_heads // num_kv_heads)),
        BN_QKV=max(2, tile_rows(qkv_weight.shape[0], hidden, programs, budget, head_dim, hp)),
        BN_O=tile_rows(hidden, hidden, programs, budget, padded=nqp * head_dim),
        BN_GU=tile_rows(inter, 2 * hidden, programs, budget, padded=2 * hp),
        BN_DOWN=tile_rows(hidden, inter, programs, budget, padded=ip),
        HAS_DELTA=residual is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        LAUNCH_NEXT=launch_next, num_warps=num_warps, **pdl.launch_options(x.device))
    return [res_out, down_out]


def choose_splits(rows: int, kv_heads: int, max_context: int, programs: int, head_values: int) -> int:
    """KV splits a row and KV head: a power of two (the merge's tile), at most 8, at most
    what fills the grid once, at least 256 keys each at the longest context, and a merge
    tile (``head_values``, padded heads x head_dim, a split) of at most 16K values."""
    by_length = next_power_of_2(max(1, -(-max_context // 256)))
    by_grid = max(1, programs // max(1, rows * kv_heads))
    by_tile = max(1, 16384 // head_values)
    return max(1, min(8, by_length, 1 << (by_grid.bit_length() - 1), 1 << (by_tile.bit_length() - 1)))
