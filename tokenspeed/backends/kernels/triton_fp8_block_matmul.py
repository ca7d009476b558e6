"""FP8 x FP8 matrix product for block-scaled weights (128 x 128 tiles, DeepSeek-style):
``x [M, K] @ (weight * scale).T`` on the FP8 tensor cores, for prefill and batches.

The activations are quantized first (``triton_fp8_quantize``: a scale per row and 128
columns), so every 128-column step multiplies two FP8 tiles that each have one scale per
row: ``acc += tl.dot(w_fp8, x_fp8.T) * w_scale * x_scale`` (the well-known w8a8 block
FP8 design). Adding each step's product into the fp32 accumulator also bounds the
tensor cores' reduced-precision FP8 accumulation to 128 products, as DeepSeek-V3
promotes it.

As ``triton_gguf_matmul`` does, the product is computed transposed, ``W_tile @
x_tile.T``: the weight's rows fill the instruction's 64-row side even when a batch has
few rows. Up to 64 rows are one row tile, so the weight is read once, with K split over
programs (whole 128-column groups each; ``triton_gguf_gemv.sum_splits`` adds them) to
keep every SM streaming; prefill tiles are 128 rows by 64 weight rows, visited in bands
of ``BAND_M`` row tiles so that a band's weight tiles stay in L2.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_attention, triton_gguf_gemv, triton_gguf_matmul
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.fp8_weights import BLOCK, check_fp8_linear
from tokenspeed.backends.kernels.triton_fp8_quantize import quantize_activations
from tokenspeed.backends.kernels.triton_gemv import split_k

SKINNY_M = triton_gguf_matmul.SKINNY_M
BAND_M = 8


@attrs.frozen
class MatmulConfig:
    """Tile rows (of x) and columns (weight rows), K splits (each a program, summed by a
    second kernel), and the launch's warps and pipeline stages. K tiles are one block
    scale's 128 columns."""
    block_m: int
    block_n: int
    splits: int
    num_warps: int
    num_stages: int


@triton.jit
def _matmul_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                   stride_xm, stride_xsm, stride_wn, stride_wsn, stride_os, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BAND_M: tl.constexpr, USE_PDL: tl.constexpr):
    """``xs`` is ``[M, ceil(K/128)]``, ``ws`` ``[ceil(N/128), ceil(K/128)]``; each split
    starts on a 128-column boundary, and BLOCK_N divides 128, so a tile's weight rows
    share one scale a step (the product's scales are a vector, not a tile of them)."""
    pdl.start(USE_PDL)
    tile_m, tile_n = triton_gguf_matmul._banded_tile(M, N, BLOCK_M, BLOCK_N, BAND_M)
    split = tl.program_id(1)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    kk = tl.arange(0, 128)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_tile = xq_ptr + m.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    w_tile = w_ptr + n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    x_scales = xs_ptr + m.to(tl.int64) * stride_xsm
    w_scales = ws_ptr + (tile_n * BLOCK_N // 128).to(tl.int64) * stride_wsn  # one block row
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # the product transposed: see above
    pdl.wait(USE_PDL)
    for k0 in range(k_lo, k_hi, 128):
        kmask = (k0 + kk < k_hi)[None, :]
        x = tl.load(x_tile + k0, mask=mmask[:, None] & kmask, other=0.0)
        w = tl.load(w_tile + k0, mask=nmask[:, None] & kmask, other=0.0)
        scales = tl.load(x_scales + k0 // 128, mask=mmask, other=0.0) * \
            tl.load(w_scales + k0 // 128)
        acc += tl.dot(w, tl.trans(x)) * scales[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + split.to(tl.int64) * stride_os + m.to(tl.int64)[None, :] * stride_om + \
        n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


def choose_config(m: int, n: int, k: int, sm_count: int) -> MatmulConfig:
    """Up to ``SKINNY_M`` rows, one row tile (the weight read once) of 64 weight rows,
    K split towards two programs an SM. More rows: tiles of 128 rows by 64 weight rows
    for one warpgroup (``wgmma m64n128``), 3 stages of 24 KB: the step's product and the
    running sum take 240 registers a thread (ptxas sm_90a), two programs an SM, where
    128 x 128 tiles over two warpgroups spill; 64 x 64 tiles (K split if need be) where
    those would leave SMs idle. By reasoning; not yet swept on a GPU
    (``benchmarks/fp8_linear.py --sweep`` times the alternatives)."""
    if m <= SKINNY_M:
        return _filled(MatmulConfig(max(16, next_power_of_2(m)), 64, 1, 4, 4), m, n, k,
                       sm_count, max_splits=8)
    large = MatmulConfig(128, 64, 1, 4, 3)
    if _tiles(large, m, n) >= sm_count:
        return large
    return _filled(MatmulConfig(64, 64, 1, 4, 4), m, n, k, sm_count, max_splits=4)


def _tiles(config: MatmulConfig, m: int, n: int) -> int:
    return triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)


def _filled(config: MatmulConfig, m, n, k, sm_count, max_splits) -> MatmulConfig:
    """``config`` with K split towards two programs an SM, each split at least 512 long
    (four 128-column steps)."""
    tiles = _tiles(config, m, n)
    if tiles >= sm_count:
        return config
    splits = min(max_splits, triton.cdiv(2 * sm_count, tiles), max(1, k // 512))
    return attrs.evolve(config, splits=splits)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None, config: MatmulConfig | None = None,
           gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequantize(weight, scale).T (+ bias)`` as ``[M, N]`` in x's dtype, for a
    block scale ``[ceil(N/128), ceil(K/128)]``; x is quantized per row and 128 columns.
    ``gated``: x is ``[M, 2K]`` (gate, up) and the input silu(gate) * up, computed as x
    is quantized."""
    k, n = check_fp8_linear(x, weight, scale, bias, gated)
    if scale.dim() != 2:
        raise ValueError(f"the block FP8 matmul needs a 128 x 128 block scale "
                         f"[{triton.cdiv(n, BLOCK)}, {triton.cdiv(k, BLOCK)}]; got "
                         f"{list(scale.shape)}")
    c = config or choose_config(x.shape[0], n, k, triton_attention.sm_count(x.device))
    if BLOCK % c.block_n:
        raise ValueError(f"block_n must divide {BLOCK} (a tile's rows share their scales); "
                         f"got {c}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    xq, xs = quantize_activations(x, BLOCK, gated)
    k_per_split, splits = split_k(k, BLOCK, c.splits)
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                               device=x.device)
    launch = pdl.launch_options(x.device)
    _matmul_kernel[(triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), splits)](
        xq, xs, weight, scale, bias if bias is not None and splits == 1 else x, part, m, n, k,
        k_per_split, xq.stride(0), xs.stride(0), weight.stride(0), scale.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(-2),
        HAS_BIAS=bias is not None and splits == 1, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        BAND_M=BAND_M, num_warps=c.num_warps, num_stages=c.num_stages, **launch)
    if splits > 1:
        triton_gguf_gemv.sum_splits(part, bias, out, launch)
    return out
