"""Tensor-core matrix product over a GGUF weight: ``x [M, K] @ W[N, K].T`` for prefill and
batches of 2 rows or more, each weight tile decoded in registers to x's dtype and fed to
``tl.dot`` (fp32 accumulation).

Up to 16 rows fit one row tile, so a decode batch reads each weight block once, as the
matrix-vector kernel does; prefill tiles are 64-128 rows, visited in bands of
``BAND_M`` row tiles so that the weight tiles a band shares stay in L2. ``linear`` picks
this kernel or ``triton_gguf_gemv`` by the number of rows: it is the GGUF matmul op.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_gguf_gemv
from tokenspeed.backends.kernels.gguf_blocks import BlockFormat, check_linear
from tokenspeed.backends.kernels.triton_gguf_dequant import weight_tile

SKINNY_M = 16


@attrs.frozen
class MatmulConfig:
    """Tile rows and columns, scale groups per K tile, and the launch's warps and stages."""
    block_m: int
    block_n: int
    groups: int
    num_warps: int
    num_stages: int


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                   GROUP: tl.constexpr, BAND_M: tl.constexpr, PRECISION: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    band = pid // (BAND_M * tiles_n)
    band_rows = tl.minimum(tiles_m - band * BAND_M, BAND_M)
    tile_m = band * BAND_M + (pid % (BAND_M * tiles_n)) % band_rows
    tile_n = (pid % (BAND_M * tiles_n)) // band_rows
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    BLOCK_K: tl.constexpr = GROUPS * GROUP
    kk = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + m.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pdl.wait(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_tile + k0, mask=mmask[:, None] & (k0 + kk < K)[None, :], other=0.0)
        w = weight_tile(w_ptr, n, nmask, k0 // GROUP, K // GROUP, stride_wn, FORMAT,
                        TYPE_SIZE, BLOCK_N, GROUPS, GROUP)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def choose_config(m: int, n: int, fmt: BlockFormat) -> MatmulConfig:
    """One 16-row tile for a decode batch (the weight read once); 64 x 128 tiles with K
    tiles of 64 for prefill. Not yet swept on a GPU."""
    groups = max(1, 64 // fmt.group_size)
    if m <= SKINNY_M:
        return MatmulConfig(SKINNY_M, 64 if n >= 4096 else 32, groups, 4, 3)
    return MatmulConfig(64 if m <= 1024 else 128, 128, groups, 8, 3)


def matmul(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
           config: MatmulConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ dequantize(weight).T (+ bias)`` as ``[M, N]`` in x's dtype (bf16, fp16
    or fp32), fp32 accumulation; ``weight`` is ``uint8 [N, row_bytes]`` in ``fmt``."""
    k, n = check_linear(x, weight, fmt, bias)
    m = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    c = config or choose_config(m, n, fmt)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), FORMAT=fmt.code, TYPE_SIZE=fmt.type_size,
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, GROUPS=c.groups,
        GROUP=fmt.group_size, BAND_M=8,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c.num_warps,
        num_stages=c.num_stages, **pdl.launch_options(x.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat,
           bias: torch.Tensor = None) -> torch.Tensor:
    """The GGUF matmul op: one row by the matrix-vector kernel, more by tensor cores."""
    if x.dim() == 2 and x.shape[0] == 1:
        return triton_gguf_gemv.gemv(x, weight, fmt, bias)
    return matmul(x, weight, fmt, bias)

