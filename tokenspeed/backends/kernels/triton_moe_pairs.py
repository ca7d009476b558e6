"""``tokenspeed::moe`` for a decode step of a few rows: one GEMV program per (token-expert
pair, column block), no grouping by expert.

At one to a few tokens every pair has its own expert (or nearly), so grouping pairs into
``tl.dot`` blocks of 16 rows buys no weight reuse and costs the grouping's launch, tiles
15/16 empty, and short weight tiles. Here each program streams thin, long weight tiles as
the dense GEMV does (``triton_gemv``): the first kernel stores each pair's
``silu(gate) * up`` row; the second gives each token's output columns: its k experts' down
products, read together as one tile (each expert's weights in flight at once: DeepSeek-V2-
Lite's layer 54 -> 49 us for both kernels on an H100, against one expert after another),
scaled by their routing weights and summed in float32, rounded to x's dtype, plus the
shared experts' output. Two launches a layer where the grouped path takes four to seven.
Both run under programmatic dependent launch: the expert ids come from the router, so each
program waits before it reads anything.

Given the shared experts' weights (``SharedExperts``: DeepSeek's, which every token passes),
their MLP runs in the same two launches, as more pairs: each token's shared intermediate
columns in chunks of the routed experts' width, after the routed pairs; the down kernel sums
a token's chunks in float32, rounds that to x's dtype and adds it as it adds ``shared``.
Two launches a layer fewer than the shared experts' own projections.
"""

from typing import NamedTuple

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError

MAX_TOKENS = 2  # H200, both shapes: faster than the grouped path at 1 and 2 tokens, slower at 4


class SharedExperts(NamedTuple):
    """The shared experts' MLP: ``w13 [2 * I_s, H]`` (gate rows, then up), ``w2 [H, I_s]``."""
    w13: torch.Tensor
    w2: torch.Tensor

    def chunks(self, inter: int) -> int:
        """Pairs a token's shared MLP makes, in columns of the routed experts' width ``inter``."""
        return triton.cdiv(self.w2.shape[1], inter)


@attrs.frozen
class PairTiles:
    """Output columns a program, reduction columns a step and warps, for each of the two
    kernels; the gate/up defaults were the fastest of 14 on the H200 at Qwen3-30B-A3B's and
    DeepSeek-V2-Lite's expert shapes, the down kernel's of 27 on an H100
    (``docs/PERFORMANCE.md``): thin, long rows."""
    gate_up_n: int = 1
    gate_up_k: int = 2048
    gate_up_warps: int = 2
    down_n: int = 1
    down_k: int = 128
    down_warps: int = 4


@triton.jit
def _pair_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, ws13_ptr, H, I, I_S, top_k, routed_pairs, stride_xt,
                         stride_we, stride_wn, stride_wsn, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``act[pair, n] = silu(x[t] @ gate[n]) * (x[t] @ up[n])`` for the block's columns. A
    pair past ``routed_pairs`` is chunk c of a token's shared MLP (CHUNKS a token): its
    columns are the shared ones from ``c * I``."""
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    pair, n = tl.program_id(0), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    shared = pair >= routed_pairs
    expert = tl.load(ids_ptr + pair, mask=pair < routed_pairs, other=0).to(tl.int64)
    chunk = tl.maximum(pair - routed_pairs, 0)
    x_row = x_ptr + tl.where(shared, chunk // CHUNKS, pair // top_k).to(tl.int64) * stride_xt
    col = tl.where(shared, (chunk % CHUNKS) * I, 0) + n      # the shared MLP's columns for a shared pair
    w = tl.where(shared, ws13_ptr + col[:, None].to(tl.int64) * stride_wsn,
                 w13_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn)
    up_rows = tl.where(shared, I_S * stride_wsn, I * stride_wn)
    nmask = (n < I) & (col < tl.where(shared, I_S, I))
    kk = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        mask = nmask[:, None] & (k[None, :] < H)
        x = tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)[None, :]
        gate += tl.load(w + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
        up += tl.load(w + up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * x
    g, u = tl.sum(gate, 1), tl.sum(up, 1)
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + pair.to(tl.int64) * I + n, act.to(act_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _pair_down_kernel(act_ptr, w2_ptr, ids_ptr, weights_ptr, shared_ptr, out_ptr, ws2_ptr, H, I, I_S, routed_pairs,
                      stride_we, stride_wn, stride_s, stride_wsn, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                      CHUNKS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """``out[t, n] = sum_j weight[t, j] * (act[t, j] @ down_j[n])`` (+ shared[t, n]); CHUNKS
    (the shared MLP's pairs a token, 0: none) add the shared MLP's output, its chunks' down
    products summed in float32 and rounded to x's dtype as its own projection would round.
    A token's K + CHUNKS products are slots j of one [BLOCK_J, BLOCK_N, BLOCK_K] tile (j < K
    routed expert j, then the shared chunks), so every expert's weights are in flight at once."""
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t, n = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j, kk = tl.arange(0, BLOCK_J), tl.arange(0, BLOCK_K)
    routed, chunk = j < K, tl.maximum(j - K, 0)
    shared_slot = (j >= K) & (chunk < CHUNKS)
    expert = tl.load(ids_ptr + t * K + j, mask=routed, other=0).to(tl.int64)
    rows = tl.where(routed[:, None], w2_ptr + expert[:, None] * stride_we + n[None, :].to(tl.int64) * stride_wn,
                    ws2_ptr + n[None, :].to(tl.int64) * stride_wsn + (chunk * I)[:, None])       # [J, N]
    acts = act_ptr + tl.where(routed, t * K + j, routed_pairs + t * CHUNKS + chunk).to(tl.int64) * I
    width = tl.where(routed, I, tl.where(shared_slot, I_S - chunk * I, 0))   # a slot's columns (none: unused)
    acc = tl.zeros([BLOCK_J, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        kmask = (k[None, :] < I) & (k[None, :] < width[:, None])                               # [J, K]
        a = tl.load(acts[:, None] + k[None, :], mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(rows[:, :, None] + k[None, None, :], mask=kmask[:, None, :] & (n[None, :, None] < H),
                    other=0.0).to(tl.float32)
        acc += w * a[:, None, :]
    parts = tl.sum(acc, 2)                                                                          # [J, N]
    weights = tl.load(weights_ptr + t * K + j, mask=routed, other=0.0)
    out = tl.sum(parts * weights[:, None], 0).to(out_ptr.dtype.element_ty)
    if CHUNKS > 0:
        mlp = tl.sum(tl.where(shared_slot[:, None], parts, 0.0), 0).to(out_ptr.dtype.element_ty)
        out = (out.to(tl.float32) + mlp.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if HAS_SHARED:   # the sum of two values in x's dtype, rounded once: that dtype's addition
        shared = tl.load(shared_ptr + t * stride_s + n, mask=n < H, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + shared).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + n, out, mask=n < H)


def moe_by_pairs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, shared: torch.Tensor | None = None,
                 tiles: PairTiles = PairTiles(), shared_experts: SharedExperts | None = None) -> torch.Tensor:
    """``tokenspeed::moe`` (shapes as ``triton_moe.moe``) by pair: for up to a few tokens.
    ``shared_experts``: their MLP of x added too (not with ``shared``)."""
    tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w2.shape[2]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.float().contiguous()
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    mlp, chunks = _shared_mlp(shared_experts, shared, x, inter)
    act = torch.empty((tokens * (top_k + chunks), inter), dtype=x.dtype, device=x.device)
    launch = pdl.launch_options(x.device)
    _pair_gate_up_kernel[(tokens * (top_k + chunks), triton.cdiv(inter, tiles.gate_up_n))](
        x, w13, ids, act, mlp.w13, hidden, inter, mlp.w2.shape[1], top_k, tokens * top_k, x.stride(0),
        w13.stride(0), w13.stride(1), mlp.w13.stride(0), CHUNKS=max(chunks, 1),
        BLOCK_N=tiles.gate_up_n, BLOCK_K=min(tiles.gate_up_k, next_power_of_2(hidden)), num_warps=tiles.gate_up_warps,
        **launch)
    shared = shared if shared is None or shared.stride(-1) == 1 else shared.contiguous()
    _pair_down_kernel[(tokens, triton.cdiv(hidden, tiles.down_n))](
        act, w2, ids, weights, out if shared is None else shared, out, mlp.w2, hidden, inter, mlp.w2.shape[1],
        tokens * top_k, w2.stride(0), w2.stride(1), 0 if shared is None else shared.stride(0), mlp.w2.stride(0),
        K=top_k, HAS_SHARED=shared is not None, CHUNKS=chunks, BLOCK_J=next_power_of_2(top_k + chunks),
        BLOCK_N=tiles.down_n, BLOCK_K=min(tiles.down_k, next_power_of_2(inter)), num_warps=tiles.down_warps,
        **launch)
    return out


def _shared_mlp(shared_experts: SharedExperts | None, shared, x, inter: int) -> tuple[SharedExperts, int]:
    """The shared experts' weights, contiguous, and their pairs a token (none: x in their
    place, unread, and no pairs)."""
    if shared_experts is None:
        return SharedExperts(x, x), 0
    if shared is not None:
        raise InternalError("moe takes the shared experts' output or their weights, not both")
    mlp = SharedExperts(*(w.contiguous() for w in shared_experts))
    if mlp.w13.shape != (2 * mlp.w2.shape[1], x.shape[1]) or mlp.w2.shape[0] != x.shape[1] or \
            mlp.w13.dtype != x.dtype:
        raise InternalError(f"shared experts' w13 must be [2 * I_s, {x.shape[1]}] and w2 [{x.shape[1]}, I_s] in "
                            f"{x.dtype}; got {tuple(mlp.w13.shape)} {mlp.w13.dtype} and {tuple(mlp.w2.shape)}")
    return mlp, mlp.chunks(inter)
