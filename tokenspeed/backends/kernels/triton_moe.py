"""The fused mixture-of-experts kernel (``tokenspeed::moe`` on CUDA): two grouped matrix
products over the token-expert pairs of a step, grouped by expert into blocks of
``BLOCK_M`` rows.

The grouping is computed on the device in one launch of fixed shapes
(``triton_moe_align``): no count of tokens per expert ever reaches the host, so eager
steps and CUDA graphs run the same code, and a captured graph holds for any routing. Its
size is an upper bound from T, k, E and BLOCK_M alone: a block past the last expert's rows
has no expert and returns at once. The first product reads each block's token rows of x and
its expert's gate and up rows and stores ``silu(gate) * up`` (one program per block and
``BLOCK_N`` intermediate columns); the second multiplies that by the expert's down
projection and the pair's routing weight and stores the pair's row; a token's k rows are
then summed in float32 in their routing order, so the combine is deterministic (the
design of vLLM's and SGLang's fused MoE).
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels.triton_moe_align import ExpertBlocks, expert_blocks


def block_rows(pairs: int) -> int:
    """Rows a block: 16 for decode's few pairs, 64 once experts have many rows each."""
    return 16 if pairs <= 512 else 64


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
        topk_ids: torch.Tensor) -> torch.Tensor:
    """``tokenspeed::moe``: x ``[T, H]``, w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, weights and
    ids ``[T, k]``; ``[T, H]`` in x's dtype."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs = tokens * top_k
    grouped = expert_blocks(topk_ids, num_experts, block_rows(pairs))
    act = torch.empty((grouped.slots.numel(), inter), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    launch = _Launch(grouped, pairs, "ieee" if x.dtype == torch.float32 else "tf32")
    _gate_up_kernel[launch.grid(inter)](
        x, w13, grouped.slots, grouped.experts, act, pairs, hidden, inter, top_k, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), **launch.constants(hidden))
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[launch.grid(hidden)](
        act, w2, grouped.slots, grouped.experts, weights, per_pair, pairs, hidden, inter, num_experts,
        act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0), **launch.constants(inter))
    return per_pair.view(tokens, top_k, hidden).sum(1).to(x.dtype)


@attrs.frozen
class _Launch:
    """The grid and tile sizes of both products: blocks by output column tiles."""
    grouped: ExpertBlocks
    pairs: int
    precision: str
    block_n: int = 64
    block_k: int = 64

    def grid(self, columns: int) -> tuple[int, int]:
        return (self.grouped.experts.numel(), triton.cdiv(columns, self.block_n))

    def constants(self, reduced: int) -> dict:
        block_k = min(self.block_k, max(16, triton.next_power_of_2(reduced)))
        return dict(BLOCK_M=self.grouped.block_m, BLOCK_N=self.block_n, BLOCK_K=block_k,
                    PRECISION=self.precision)
