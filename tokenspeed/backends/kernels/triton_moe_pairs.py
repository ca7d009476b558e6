"""``tokenspeed::moe`` for a decode step of a few rows: one GEMV program per (token-expert
pair, column block), no grouping by expert.

At one to a few tokens every pair has its own expert (or nearly), so grouping pairs into
``tl.dot`` blocks of 16 rows buys no weight reuse and costs the grouping's launch, tiles
15/16 empty, and short weight tiles. Here each program streams thin, long weight tiles as
the dense GEMV does (``triton_gemv``): the first kernel stores each pair's
``silu(gate) * up`` row; the second gives each token's output columns: its k experts' down
products, scaled by their routing weights and summed in float32 in routing order (the
order the grouped path's combine sums in), rounded to x's dtype, plus the shared experts'
output. Two launches a layer where the grouped path takes four to seven. Both run under
programmatic dependent launch: the expert ids come from the router, so each program waits
before it reads anything.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2

MAX_TOKENS = 2  # H200, both shapes: faster than the grouped path at 1 and 2 tokens, slower at 4


@attrs.frozen
class PairTiles:
    """Output columns a program and reduction columns a step, for each of the two kernels;
    the defaults were the fastest of 14 on the H200 at Qwen3-30B-A3B's and DeepSeek-V2-Lite's
    expert shapes (``docs/PERFORMANCE.md``): thin, long rows."""
    gate_up_n: int = 1
    down_n: int = 2
    block_k: int = 2048
    num_warps: int = 2


@triton.jit
def _pair_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, H, I, top_k, stride_xt, stride_we, stride_wn,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``act[pair, n] = silu(x[t] @ gate[n]) * (x[t] @ up[n])`` for the block's columns."""
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    pair, n = tl.program_id(0), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    w = w13_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
    kk = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        mask = (n[:, None] < I) & (k[None, :] < H)
        x = tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)[None, :]
        gate += tl.load(w + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
        up += tl.load(w + I * stride_wn + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
    g, u = tl.sum(gate, 1), tl.sum(up, 1)
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + pair.to(tl.int64) * I + n, act.to(act_ptr.dtype.element_ty), mask=n < I)


@triton.jit
def _pair_down_kernel(act_ptr, w2_ptr, ids_ptr, weights_ptr, shared_ptr, out_ptr, H, I, stride_we, stride_wn,
                      stride_s, K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[t, n] = sum_j weight[t, j] * (act[t, j] @ down_j[n])`` (+ shared[t, n])."""
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t, n = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(K):
        expert = tl.load(ids_ptr + t * K + j).to(tl.int64)
        w = w2_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + kk
            a = tl.load(act_ptr + (t * K + j) * I + k, mask=k < I, other=0.0).to(tl.float32)
            acc += tl.load(w + k[None, :], mask=(n[:, None] < H) & (k[None, :] < I), other=0.0).to(tl.float32) \
                * a[None, :]
        total += tl.sum(acc, 1) * tl.load(weights_ptr + t * K + j)
    out = total.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:   # the sum of two values in x's dtype, rounded once: that dtype's addition
        shared = tl.load(shared_ptr + t * stride_s + n, mask=n < H, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + shared).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + n, out, mask=n < H)


def moe_by_pairs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, shared: torch.Tensor | None = None,
                 tiles: PairTiles = PairTiles()) -> torch.Tensor:
    """``tokenspeed::moe`` (shapes as ``triton_moe.moe``) by pair: for up to a few tokens."""
    tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w2.shape[2]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.float().contiguous()
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    launch = dict(num_warps=tiles.num_warps, **pdl.launch_options(x.device))
    _pair_gate_up_kernel[(tokens * top_k, triton.cdiv(inter, tiles.gate_up_n))](
        x, w13, ids, act, hidden, inter, top_k, x.stride(0), w13.stride(0), w13.stride(1),
        BLOCK_N=tiles.gate_up_n, BLOCK_K=min(tiles.block_k, next_power_of_2(hidden)), **launch)
    shared = shared if shared is None or shared.stride(-1) == 1 else shared.contiguous()
    _pair_down_kernel[(tokens, triton.cdiv(hidden, tiles.down_n))](
        act, w2, ids, weights, out if shared is None else shared, out, hidden, inter, w2.stride(0), w2.stride(1),
        0 if shared is None else shared.stride(0), K=top_k, HAS_SHARED=shared is not None,
        BLOCK_N=tiles.down_n, BLOCK_K=min(tiles.block_k, next_power_of_2(inter)), **launch)
    return out
