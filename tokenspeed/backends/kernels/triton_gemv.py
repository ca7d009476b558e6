"""Split-K skinny GEMM (GEMV) for decode: ``linear(x [M, K], weight [N, K]) -> [M, N]``.

At batch 1..16 a linear layer only streams its weight, so speed is bandwidth: this kernel
keeps every SM busy by splitting K when N alone gives too few column blocks, accumulates in
fp32, and reduces the split partials in a fixed order in a second pass (deterministic, no
atomics). For M == 1 it accumulates products elementwise (no tensor-core padding); for
M > 1 it pads M to 16 and uses ``tl.dot``. Nothing is read on the host and buffers are
allocated per call, so it can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

MAX_M = 16
DEFAULT_SMS = 132


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                 stride_os, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    out_base = out_ptr + split.to(tl.int64) * stride_os
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + kk
            kmask = k < k_hi
            x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        res = tl.sum(acc, 1)
        if HAS_BIAS:
            res += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_base + n, res.to(out_ptr.dtype.element_ty), mask=nmask)
    else:
        m = tl.arange(0, BLOCK_M)
        mmask = m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + kk
            kmask = k < k_hi
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                        mask=nmask[None, :] & kmask[:, None], other=0.0)
            acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_base + m[:, None] * stride_om + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, N, splits, stride_ps, stride_pm, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_config(m: int, n: int, k: int, sm_count: int):
    """(block_n, block_k, splits, num_warps, num_stages), tuned on an H200 (bf16).

    Split K only when K is long and the column blocks alone fill under three waves, since
    the reduction is a second launch (~1-2 us)."""
    if m == 1:
        block_n, block_k, warps, stages = 8, 1024, 4, 3
        if triton.cdiv(n, 8) > 16 * sm_count:
            block_n, block_k, warps = 16, 128, 8
        elif triton.cdiv(n, 8) > 3 * sm_count:
            block_k, warps = 128, 8
    else:
        block_n, block_k, warps, stages = 32, 128, 4, 5
        if triton.cdiv(n, block_n) > 16 * sm_count:
            block_n, stages = 64, 4
    n_blocks = triton.cdiv(n, block_n)
    splits = 1
    if k >= 4096 and n_blocks < 3 * sm_count:
        splits = min(8 if m == 1 else 4, triton.cdiv(3 * sm_count, n_blocks),
                     triton.cdiv(k, block_k))
    return block_n, block_k, splits, warps, stages


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor = None,
           config=None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for M <= 16, fp32 accumulation, output x.dtype.

    ``config`` overrides ``choose_config`` (for tuning); leave it None otherwise.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(f"M {m} must be <= {MAX_M}; use torch.nn.functional.linear")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, splits, warps, stages = config or choose_config(
        m, n, k, _sm_count(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split) if k else 1
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                               device=x.device)
    has_bias = bias is not None and splits == 1
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, weight, bias if has_bias else x, part, m, n, k, k_per_split, x.stride(0),
        weight.stride(0), part.stride(0) if splits > 1 else 0, part.stride(-2),
        HAS_BIAS=has_bias, BLOCK_M=1 if m == 1 else MAX_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, block))](
            part, bias if bias is not None else x, out, n, splits, part.stride(0),
            part.stride(1), out.stride(0), HAS_BIAS=bias is not None, BLOCK=block,
            num_warps=4)
    return out
