"""Split-K GEMV over an FP8 weight for decode: ``x [M, K] @ (weight * scale).T`` for
M <= 16, the weight ``float8_e4m3fn [N, K]`` read as it is stored (``fp8_weights``).

At decode a linear layer only streams its weight, so the time is its bytes: FP8 halves
bf16's. The program grid is ``triton_gemv``'s (whose launch heuristics were swept on an
H200), with K tiles of twice the elements so that a program has as many bytes in flight.
One row multiplies elementwise in fp32, each thread summing its 8 columns in registers
(a weight tile of ``[BLOCK_N, BLOCK_K / 8, 8]``, the input in the same layout, so
neither is shuffled between threads, and no more accumulators than the bf16 kernel
needs); several rows pad M to 16 and use ``tl.dot`` on the weight converted (exactly)
to x's dtype. K is split over programs where the column blocks alone leave SMs idle,
the partials summed in a fixed order by a second kernel. The scales cost little: a
per-channel scale multiplies each output once; a 128 x 128 block scale multiplies each
8-column sum (one row) or each 128-column tile's product (several rows), since a
program's rows all lie in one block row. ``gated``: x is ``[M, 2K]`` (gate, up) and the
input silu(gate) * up, computed as it is read (``triton_gemv``'s input code); ``norm_linear``
(one row): the input rms_norm(x + residual), its statistics read first. Under PDL
the first weight tile is requested before the kernel waits for its predecessor. Nothing
is read on the host: graph-capturable.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_attention, triton_gemv, triton_gguf_gemv
from tokenspeed.backends.kernels.fp8_weights import BLOCK, check_fp8_linear
from tokenspeed.backends.kernels.triton_gemv import InputNorm, split_k

MAX_M = triton_gemv.MAX_M
VEC = tl.constexpr(8)  # one row: the columns a thread multiplies and sums in registers


@attrs.frozen
class GemvConfig:
    """Output rows per program, K per tile, K splits (each a program, summed by a second
    kernel), and the launch's warps and pipeline stages."""
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


@triton.jit
def _columns(k0, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A K tile's columns: one row, ``[BLOCK_K // VEC, VEC]``, the columns one thread
    multiplies and sums in the last axis (8 bytes of weight, 16 of a bf16 input: Triton
    lays both out alike); else ``[BLOCK_K]``."""
    if BLOCK_M == 1:
        col = k0 + tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    else:
        col = k0 + tl.arange(0, BLOCK_K)
    return col


@triton.jit
def _weight_tile(w_ptr, n, nmask, k0, k_hi, stride_wn, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One row: ``[BLOCK_N, BLOCK_K // VEC, VEC]``; several: ``[BLOCK_K, BLOCK_N]`` for
    ``tl.dot``. Columns from ``k_hi`` read as zeros."""
    col = _columns(k0, BLOCK_M, BLOCK_K)
    if BLOCK_M == 1:
        w = tl.load(w_ptr + n[:, None, None].to(tl.int64) * stride_wn + col[None, :, :],
                    mask=nmask[:, None, None] & (col < k_hi)[None, :, :], other=0.0)
    else:
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + col[:, None],
                    mask=nmask[None, :] & (col < k_hi)[:, None], other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, x_ptr, res_ptr, nw_ptr, inv, s_ptr, m, mmask, k0, k_hi, K, stride_xm, scale_row,
                GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``acc`` plus a tile's products with the input (x, silu(gate) * up or, one row only,
    rms_norm(x + residual) given its ``inv`` rms, as ``triton_gemv`` computes each). One
    row: ``[BLOCK_N, BLOCK_K // VEC]`` sums of VEC
    products each, a block scale multiplying the sums of its columns. Several rows: ``tl.dot``
    with the weight converted (exactly) to x's dtype; a block-scaled tile (one 128-column
    group) has its product scaled as a whole, a per-channel one is scaled at the end."""
    col = _columns(k0, BLOCK_M, BLOCK_K)
    if BLOCK_M == 1:
        x = triton_gemv._input(x_ptr, res_ptr, nw_ptr, col[None, :, :], col,
                               (col < k_hi)[None, :, :], K, inv, GATED, NORM, HAS_RES)
        sums = tl.sum(w.to(tl.float32) * x.to(tl.float32), 2)
        if BLOCK_SCALES:
            group = k0 + tl.arange(0, BLOCK_K // VEC) * VEC
            sums *= tl.load(s_ptr + scale_row + group // 128, mask=group < k_hi,
                            other=0.0)[None, :]
        acc += sums
    else:
        x = triton_gemv._input(x_ptr, x_ptr, x_ptr, m[:, None] * stride_xm + col[None, :],
                               col, mmask[:, None] & (col < k_hi)[None, :], K, 0.0, GATED,
                               False, False)
        if BLOCK_SCALES:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * \
                tl.load(s_ptr + scale_row + k0 // 128)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, total_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_sn, stride_os, stride_om, eps, HAS_BIAS: tl.constexpr,
                 GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """BLOCK_SCALES: ``s_ptr`` is ``[ceil(N/128), ceil(K/128)]`` (BLOCK_N divides 128, so
    the program's rows share a block row); else ``[N]``, applied to the sums. NORM (one
    row): the input is rms_norm(x + residual) * norm weight, its statistics read first (the
    GGUF GEMV's way), the sum stored by the first program. The first weight tile is
    requested before waiting on the previous kernel (PDL)."""
    pdl.start(USE_PDL)
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    scale_row = (tl.program_id(0) * BLOCK_N // 128).to(tl.int64) * stride_sn
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w = _weight_tile(w_ptr, n, nmask, k_lo, k_hi, stride_wn, BLOCK_M, BLOCK_K)
    pdl.wait(USE_PDL)
    inv = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        write_rows = tl.where((tl.program_id(0) == 0) & (split == 0), M, 0)   # the sum, once
        inv = triton_gemv._inv_rms(x_ptr, res_ptr, total_ptr, m, mmask, K, stride_xm, eps, write_rows, HAS_RES,
                                   BLOCK_M, BLOCK_K)
    acc = _accumulate(acc, w, x_ptr, res_ptr, nw_ptr, inv, s_ptr, m, mmask, k_lo, k_hi, K, stride_xm, scale_row,
                      GATED, NORM, HAS_RES, BLOCK_SCALES, BLOCK_M, BLOCK_K, PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # the first tile, peeled, came early
        w = _weight_tile(w_ptr, n, nmask, k0, k_hi, stride_wn, BLOCK_M, BLOCK_K)
        acc = _accumulate(acc, w, x_ptr, res_ptr, nw_ptr, inv, s_ptr, m, mmask, k0, k_hi, K, stride_xm,
                          scale_row, GATED, NORM, HAS_RES, BLOCK_SCALES, BLOCK_M, BLOCK_K, PRECISION)
    y = tl.sum(acc, 1)[None, :] if BLOCK_M == 1 else acc
    if not BLOCK_SCALES:
        y *= tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + m[:, None] * stride_om + n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def choose_config(m: int, n: int, k: int, sm_count: int) -> GemvConfig:
    """(block_n, block_k, splits, warps, stages) by reasoning from ``triton_gemv``'s
    H200 sweeps, which found the bytes a program has in flight, not its elements, to set
    the bandwidth: grids like its own, with K tiles of twice the elements.

    One row: 4 output rows a program (each program also reads the input tile from L2:
    4 FP8 rows keep that read at half the weight's bytes, as 2 bf16 rows do) and 2048
    columns (8 KB of weight at 52 registers a thread, ptxas sm_90a: all of a 1B
    projection's programs resident at once); from K = 4096 (the down projection: bf16
    runs 256 programs of 32 KB, 2 an SM, all resident) 4096 columns with 4 warps: 512
    programs of 16 KB, gated at 128 registers so 4 an SM, again all resident (8 warps
    would fit 3 an SM, and 8 rows need 143 registers, one an SM). Several rows:
    ``tl.dot`` tiles of 32-64 columns and 128 of K (one block scale's columns),
    software-pipelined. K is split where the column blocks leave SMs idle. Every block_n
    divides 128, as block scales require. Not yet swept on a GPU
    (``benchmarks/fp8_linear.py --sweep``)."""
    if m == 1:
        block_n, block_k, warps = 4, (4096 if k >= 4096 else 2048), 4
        n_blocks = triton.cdiv(n, block_n)
        splits = 1
        if n_blocks < sm_count:
            splits, block_k = min(4, triton.cdiv(2 * sm_count, n_blocks)), 2048
        stages = 3
    else:
        block_n, block_k, warps = (64 if n >= 2048 else 32), BLOCK, 4
        n_blocks = triton.cdiv(n, block_n)
        stages = 3 if n_blocks > 8 * sm_count else 5
        splits = min(4, triton.cdiv(2 * sm_count, n_blocks), max(1, k // 512)) \
            if n_blocks < sm_count else 1
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return GemvConfig(block_n, block_k, max(1, min(splits, triton.cdiv(k, block_k))), warps,
                      stages)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None, gated: bool = False,
           config: GemvConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ dequantize(weight, scale).T (+ bias)`` as ``[M, N]`` in x's dtype, fp32
    accumulation, for M <= 16. ``gated``: x is ``[M, 2K]`` (gate, up) and the input
    silu(gate) * up, saving the MLP's activation kernel. ``config`` overrides
    ``choose_config`` (tuning, tests)."""
    k = check_fp8_linear(x, weight, scale, bias, gated)[0]
    if x.shape[0] > MAX_M:
        raise ValueError(f"the FP8 GEMV takes at most {MAX_M} rows; got {x.shape[0]} (use "
                         f"fp8_matmul.linear)")
    return _launch(x, weight, scale, bias, _config(x, weight, scale, k, config), gated)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linear(rms_norm(x + residual) * norm_weight)`` for one row, the norm computed as the
    GEMV reads its input (the norm's kernel saved), and ``x + residual`` (None without a
    residual)."""
    k = check_fp8_linear(x, weight, scale, bias)[0]
    if x.shape[0] != 1:
        raise ValueError(f"the FP8 GEMV norms one row [1, {k}]; got {tuple(x.shape)}")
    x, norm = triton_gemv.input_norm(x, residual, norm_weight, eps, ValueError)
    return _launch(x, weight, scale, bias, _config(x, weight, scale, k, config), False, norm), norm.total


def _config(x, weight, scale, k: int, config: GemvConfig | None) -> GemvConfig:
    """``config``, or ``choose_config``'s; either checked against block scales."""
    c = config or choose_config(x.shape[0], weight.shape[0], k, triton_attention.sm_count(x.device))
    if scale.dim() == 2 and (BLOCK % c.block_n or (x.shape[0] > 1 and BLOCK % c.block_k)):
        raise ValueError(f"block scales need block_n dividing {BLOCK} (and, for several rows, "
                         f"block_k dividing it); got {c}")
    return c


def _launch(x, weight, scale, bias, c: GemvConfig, gated: bool, norm: InputNorm | None = None):
    m, (n, k) = x.shape[0], weight.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        if norm is not None and norm.total is not None:
            norm.total.copy_(x + norm.residual)
        return out
    k_per_split, splits = split_k(k, c.block_k, c.splits)
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                               device=x.device)
    launch = pdl.launch_options(x.device)
    has_norm, norm = norm is not None, norm or InputNorm(None, x, None, 0.0)   # unread if off
    _gemv_kernel[(triton.cdiv(n, c.block_n), splits)](
        x, triton_gemv._or(norm.residual, x), norm.weight, triton_gemv._or(norm.total, x), weight, scale,
        bias if bias is not None and splits == 1 else x, part, m, n, k,
        k_per_split, x.stride(0), weight.stride(0), scale.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(-2), norm.eps,
        HAS_BIAS=bias is not None and splits == 1, GATED=gated, NORM=has_norm, HAS_RES=norm.residual is not None,
        BLOCK_SCALES=scale.dim() == 2, BLOCK_M=1 if m == 1 else MAX_M, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps, num_stages=c.num_stages, **launch)
    if splits > 1:
        triton_gguf_gemv.sum_splits(part, bias, out, launch)
    return out
