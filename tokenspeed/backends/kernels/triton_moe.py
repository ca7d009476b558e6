"""The fused mixture-of-experts kernel (``tokenspeed::moe`` on CUDA): two grouped matrix
products over the token-expert pairs of a step, grouped by expert into blocks of
``BLOCK_M`` rows. (A step of up to ``triton_moe_pairs.MAX_TOKENS`` tokens goes by pair.)

The grouping is computed on the device in launches of fixed shapes (``triton_moe_align``;
one for a decode step of a few rows): no count of tokens per expert ever reaches the host, so eager
steps and CUDA graphs run the same code, and a captured graph holds for any routing. Its
size is an upper bound from T, k, E and BLOCK_M alone: a block past the last expert's rows
has no expert and returns at once. The first product reads each block's token rows of x and
its expert's gate and up rows and stores ``silu(gate) * up`` (one program per block and
``BLOCK_N`` intermediate columns); the second multiplies that by the expert's down
projection and the pair's routing weight and stores the pair's row; a token's k rows are
then summed in float32 in their routing order, so the combine is deterministic (the
design of vLLM's and SGLang's fused MoE), rounded to x's dtype and added to the shared
experts' output where the op has one, in one launch.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import triton_moe_pairs
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_moe_align import ExpertBlocks, expert_blocks
from tokenspeed.errors import InternalError


@attrs.frozen
class Tiles:
    """A program's tile: ``block_m`` pair rows (of one expert) by ``block_n`` output columns,
    ``block_k`` columns of the reduction a step."""
    block_m: int
    block_n: int
    block_k: int


def tiles(tokens: int, num_experts: int) -> Tiles:
    """Up to one token an expert (decode), experts hold a row or two each: short blocks, and
    narrow columns so that more programs stream the experts' weights; with more tokens,
    blocks of 64 rows reuse each weight tile (the split vLLM's default configs make)."""
    return Tiles(16, 32, 64) if tokens <= num_experts else Tiles(64, 64, 64)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, slots_ptr, experts_ptr, act_ptr, pairs, H, I, top_k, num_experts,
                    stride_xt, stride_we, stride_wn, stride_am,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """``act[row] = silu(x[t] @ gate.T) * (x[t] @ up.T)`` for the block's rows; a row
    without a pair reads zeros (its act is never read)."""
    block, tile_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    token = tl.where(slot < pairs, slot // top_k, 0)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w13_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_xt + kk[None, :],
                    mask=(slot[:, None] < pairs) & (kk[None, :] < H), other=0.0)
        wmask = (n[None, :] < I) & (kk[:, None] < H)
        wg = tl.load(w + n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
        wu = tl.load(w + (n[None, :] + I) * stride_wn + kk[:, None], mask=wmask, other=0.0)
        gate = tl.dot(x, wg, gate, input_precision=PRECISION)
        up = tl.dot(x, wu, up, input_precision=PRECISION)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_am + n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=n[None, :] < I)


@triton.jit
def _down_kernel(act_ptr, w2_ptr, slots_ptr, experts_ptr, weights_ptr, out_ptr, pairs, H, I, num_experts,
                 stride_am, stride_we, stride_wn, stride_os,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    """``out[slot] = weight[slot] * (act[row] @ down.T)``: each pair's row stored once."""
    block, tile_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(experts_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    valid = slot < pairs
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w2_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < I), other=0.0)
        wd = tl.load(w + n[None, :] * stride_wn + kk[:, None], mask=(n[None, :] < H) & (kk[:, None] < I),
                     other=0.0)
        acc = tl.dot(a, wd, acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + slot, mask=valid, other=0.0)
    safe = tl.where(valid, slot, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_os + n[None, :], acc * weight[:, None],
             mask=valid[:, None] & (n[None, :] < H))


def moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, shared: torch.Tensor | None = None,
        shared_experts: triton_moe_pairs.SharedExperts | None = None) -> torch.Tensor:
    """``tokenspeed::moe``: x ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, weights and
    ids ``[T, k]``, ``shared`` ``[T, H]`` or None; ``[T, H]`` in x's dtype. A step of a
    few tokens goes by pair (``triton_moe_pairs``), more by expert blocks.
    ``shared_experts``: their MLP in the pair launches (a step of a few tokens only)."""
    if topk_ids.shape[0] <= triton_moe_pairs.MAX_TOKENS:
        return triton_moe_pairs.moe_by_pairs(x, w13, w2, topk_weights, topk_ids, shared,
                                             shared_experts=shared_experts)
    if shared_experts is not None:
        raise InternalError(f"the shared experts run in the pair launches, of at most {triton_moe_pairs.MAX_TOKENS} "
                            f"tokens; this step has {topk_ids.shape[0]}: give their output as shared")
    return moe_grouped(x, w13, w2, topk_weights, topk_ids, shared)


def moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """``tokenspeed::moe`` by expert blocks, for any number of tokens."""
    tokens, top_k = topk_ids.shape
    tile = tiles(tokens, w13.shape[0])
    grouped = expert_blocks(topk_ids, w13.shape[0], tile.block_m)
    act = _gate_up(x.contiguous(), w13.contiguous(), grouped, top_k, tile)
    per_pair = _down(act, w2.contiguous(), grouped, topk_weights.reshape(-1).float().contiguous(), tile)
    return _combine(per_pair, tokens, top_k, x.dtype, shared)


def _gate_up(x, w13, grouped: ExpertBlocks, top_k: int, tile: Tiles) -> torch.Tensor:
    """``silu(gate) * up`` of every block row, ``[blocks * BLOCK_M, I]`` in x's dtype."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    act = torch.empty((grouped.slots.numel(), inter), dtype=x.dtype, device=x.device)
    grid = (grouped.experts.numel(), triton.cdiv(inter, tile.block_n))
    _gate_up_kernel[grid](x, w13, grouped.slots, grouped.experts, act, x.shape[0] * top_k, x.shape[1], inter,
                          top_k, num_experts, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                          **_constants(tile, x.shape[1], x.dtype))
    return act


def _down(act, w2, grouped: ExpertBlocks, weights, tile: Tiles) -> torch.Tensor:
    """Each pair's weighted expert output, ``[T * k, H]`` in float32."""
    num_experts, hidden, inter = w2.shape
    per_pair = torch.empty((weights.numel(), hidden), dtype=torch.float32, device=act.device)
    grid = (grouped.experts.numel(), triton.cdiv(hidden, tile.block_n))
    _down_kernel[grid](act, w2, grouped.slots, grouped.experts, weights, per_pair, weights.numel(), hidden, inter,
                       num_experts, act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
                       **_constants(tile, inter, act.dtype))
    return per_pair


@triton.jit
def _combine_kernel(pairs_ptr, shared_ptr, out_ptr, hidden, stride_s, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                    BLOCK: tl.constexpr):
    t, n = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        total += tl.load(pairs_ptr + (t * K + j) * hidden + n, mask=n < hidden, other=0.0)
    out = total.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:   # the sum of two values in x's dtype, rounded once: that dtype's addition
        shared = tl.load(shared_ptr + t * stride_s + n, mask=n < hidden, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + shared).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * hidden + n, out, mask=n < hidden)


def _combine(per_pair, tokens: int, top_k: int, dtype: torch.dtype, shared) -> torch.Tensor:
    """Each token's k pair rows summed in routing order, in ``dtype``, plus ``shared``."""
    hidden = per_pair.shape[1]
    out = torch.empty((tokens, hidden), dtype=dtype, device=per_pair.device)
    if tokens:
        shared = shared if shared is None or shared.stride(-1) == 1 else shared.contiguous()
        block = min(1024, next_power_of_2(hidden))
        _combine_kernel[(tokens, triton.cdiv(hidden, block))](
            per_pair, out if shared is None else shared, out, hidden, 0 if shared is None else shared.stride(0),
            K=top_k, HAS_SHARED=shared is not None, BLOCK=block, num_warps=4)
    return out


def _constants(tile: Tiles, reduced: int, dtype: torch.dtype) -> dict:
    """The tile as the kernels' constants; a reduction narrower than ``block_k`` in one step."""
    block_k = min(tile.block_k, max(16, next_power_of_2(reduced)))
    return dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                PRECISION="ieee" if dtype == torch.float32 else "tf32")
