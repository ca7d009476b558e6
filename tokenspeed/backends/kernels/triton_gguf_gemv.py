"""Matrix-vector product over a GGUF weight: ``x [1, K] @ W[N, K].T`` for a decode step
of one row, W read as its blocks (``gguf_blocks.py``) and decoded in registers.

One row only streams the weight, so speed is the bytes read: a quantized weight is 2-4x
fewer than bf16. Each program owns ``BLOCK_N`` output rows and walks K in tiles of
``BLOCK_K`` elements, read in units (``triton_gguf_units.py``: each byte read once, for
both of its nibbles), summing each half-unit's quants times the input in fp32 (no
tensor-core padding for one row) before it applies the half's scale and offset, and the
halves once at the end; K is split over programs (their partial sums added by a second
kernel) where the row blocks alone leave SMs idle. Under PDL the first weight tile is
decoded before the program waits for the kernel that writes x. As ``triton_gemv`` does
for bf16 weights (and with its input code), the input may be rms_norm(x + residual) *
weight, computed as it is read; every program computes the whole input, so the engine
fuses it only for weights of few rows (``cuda.norm_linear``), and runs silu(gate) * up
as its own kernel (a fused activation cost more than it saved: ``cuda.gated_linear``).
Several rows go to ``triton_gguf_matmul`` (tensor cores, the weight still read once for
up to 64 rows); one row of a wide Q4_K or Q8_0_G8 weight to ``triton_gguf_wide``.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_attention, triton_gemv, triton_gguf_wide
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.gguf_blocks import Q, BlockFormat, check_linear, check_weight
from tokenspeed.backends.kernels.triton_gemv import InputNorm, split_k
from tokenspeed.backends.kernels.triton_gguf_dequant import Q4_1, Q4_K, Q5_1, Q5_K
from tokenspeed.backends.kernels.triton_gguf_units import (unit_elements, unit_gap, unit_halves,
                                                           unit_width)


@attrs.frozen
class GemvConfig:
    """Output rows per program, K elements per tile (a power of two, at least 64: whole
    units of every format), K splits (each a program, summed by a second kernel), and the
    launch's warps."""
    block_n: int
    block_k: int
    splits: int
    num_warps: int


@triton.jit
def _inputs(x_ptr, res_ptr, nw_ptr, k, mask, inv, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """fp32 input values at ``k`` (zeros off ``mask``), computed and rounded as the bf16
    GEMV computes them."""
    if NORM:
        h = triton_gemv._hidden(x_ptr, res_ptr, k, mask, HAS_RES)
        x = triton_gemv.normed(h, tl.load(nw_ptr + k, mask=mask, other=0.0), inv[:, None, None],
                               x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + k, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _half_dots(half, x, FORMAT: tl.constexpr):
    """``[R, U, 1]``: each half's products summed, then scaled (``unit_halves``)."""
    q, scale, offset = half
    dots = tl.sum(q * x, 2, keep_dims=True) * scale
    if FORMAT == Q4_1 or FORMAT == Q5_1 or FORMAT == Q4_K or FORMAT == Q5_K:
        dots += tl.sum(x, 2, keep_dims=True) * offset
    return dots


@triton.jit
def _tile_dots(halves, u, lanes, umask, x_ptr, res_ptr, nw_ptr, inv, FORMAT: tl.constexpr,
               GAP: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """A tile's units, both halves, against their inputs."""
    k = unit_elements(u, lanes, FORMAT)
    lo, hi = halves
    x_lo = _inputs(x_ptr, res_ptr, nw_ptr, k, umask, inv, NORM, HAS_RES)
    x_hi = _inputs(x_ptr, res_ptr, nw_ptr, k + GAP, umask, inv, NORM, HAS_RES)
    return _half_dots(lo, x_lo, FORMAT) + _half_dots(hi, x_hi, FORMAT)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, total_ptr, w_ptr, bias_ptr, out_ptr, N, K,
                 k_per_split, stride_wn, stride_os, eps, FORMAT: tl.constexpr,
                 TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                 HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WIDTH: tl.constexpr, GAP: tl.constexpr, USE_PDL: tl.constexpr):
    """NORM: the input is rms_norm(x + residual) * norm weight, its statistics read first,
    the sum written by the first program. Tiles stay ``[rows, units, lanes]`` and each
    half's products are summed as they come: a reshape to 2-D cost a layout change a tile
    and a whole-tile accumulator its registers (2.0-3.2x slower on the H200)."""
    pdl.start(USE_PDL)
    first = tl.program_id(0) * BLOCK_N
    rows_ptr = w_ptr + first.to(tl.int64) * stride_wn
    local = tl.arange(0, BLOCK_N)
    nmask, split = (first + local) < N, tl.program_id(1)
    row = local[:, None, None] * stride_wn
    UNITS: tl.constexpr = BLOCK_K // (2 * WIDTH)
    units, lanes = tl.arange(0, UNITS)[None, :, None], tl.arange(0, WIDTH)[None, None, :]
    u_lo = split * (k_per_split // (2 * WIDTH))
    u_hi = tl.minimum(u_lo + k_per_split // (2 * WIDTH), K // (2 * WIDTH))
    u = u_lo + units
    halves = unit_halves(rows_ptr, row, u, lanes, nmask[:, None, None] & (u < u_hi), FORMAT,
                         TYPE_SIZE)
    pdl.wait(USE_PDL)
    inv = tl.zeros([1], tl.float32)
    if NORM:
        one = tl.arange(0, 1)
        write_rows = tl.where((tl.program_id(0) == 0) & (split == 0), 1, 0)
        inv = triton_gemv._inv_rms(x_ptr, res_ptr, total_ptr, one, one < 1, K, 0, eps,
                                   write_rows, HAS_RES, 1, BLOCK_K)
    acc = _tile_dots(halves, u, lanes, u < u_hi, x_ptr, res_ptr, nw_ptr, inv, FORMAT, GAP, NORM,
                     HAS_RES)
    for u0 in range(u_lo + UNITS, u_hi, UNITS):  # the first tile came before the wait
        u = u0 + units
        umask = u < u_hi
        halves = unit_halves(rows_ptr, row, u, lanes, nmask[:, None, None] & umask, FORMAT,
                             TYPE_SIZE)
        acc += _tile_dots(halves, u, lanes, umask, x_ptr, res_ptr, nw_ptr, inv, FORMAT, GAP, NORM,
                          HAS_RES)
    y = tl.sum(tl.sum(acc, 2), 1)
    n = first + local
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + n, y.to(out_ptr.dtype.element_ty),
             mask=nmask)


def choose_config(n: int, k: int, fmt: BlockFormat, sm_count: int) -> GemvConfig:
    """Four output rows a program where a format's quants are 16-byte aligned (Q4_K, Q5_K,
    Q8_0_G8: read 16 bytes a load), one elsewhere (narrower loads: the other formats' blocks are 2,
    4 or 8-byte aligned); K tiles of 1024 elements at one warp, or, where the programs
    are fewer than 32 an SM (the most an SM holds), tiles of 2048 at two warps, each
    program keeping more bytes in flight; no tile longer than a split's K. This is the
    best of a sweep on the H200 at every projection of the 1B shape for Q6_K, and within
    3 % of it summed over a token for Q4_K (block rows 1-4, tiles 1024-2048, 1-2 warps;
    PERFORMANCE.md, 2026-12-04). A program whose K is 8192 or longer waits on memory at
    every tile, so it takes four warps, and four rows take tiles of 4096 (each thread's
    share as at 2048 and two warps): the best or within 3 % of it in a sweep on an H100 at
    the 1B shape's down projection (block rows 1-8, tiles 512-4096, 1-4 warps, 1-8 splits;
    Q4_K 12.69 to 8.38 us, Q8_0 12.20 to 8.65; 2026-12-05). K is split where the rows
    alone leave SMs idle."""
    block_n = 4 if fmt.qtype in (Q.Q4_K, Q.Q5_K) or fmt.gathered else 1
    blocks = triton.cdiv(n, block_n)
    few = blocks < 32 * sm_count
    splits = 1 if blocks >= 2 * sm_count else min(4, triton.cdiv(2 * sm_count, blocks),
                                                   max(1, k // 1024))
    per_split = triton.cdiv(k, splits)
    long = few and per_split >= 8192
    longest = 1024 if not few else 4096 if long and block_n == 4 else 2048
    tile = min(longest, max(64, next_power_of_2(per_split)))
    return GemvConfig(block_n, tile, splits, 4 if long else 2 if few else 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x [1, K] @ dequantize(weight).T (+ bias)`` as ``[1, N]`` in x's dtype, fp32
    accumulation; ``weight`` is ``uint8 [N, row_bytes]`` in ``fmt``."""
    k = check_weight(weight, fmt)
    if list(x.shape) != [1, k]:
        raise ValueError(f"x must be [1, {k}] for a {fmt.name} weight of {k} columns; got "
                         f"{tuple(x.shape)}")
    check_linear(x, weight, fmt, bias)  # its dtype and the bias
    if config is None and triton_gguf_wide.serves(weight, fmt):
        return triton_gguf_wide.launch(x, weight, fmt, bias)
    return _launch(x, weight, fmt, bias, config, InputNorm(None, x, None, 0.0))


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
              config: GemvConfig | None = None):
    """``gemv(rms_norm(x + residual) * norm_weight)`` and ``x + residual`` (None without
    a residual), the norm computed as the GEMV reads its input, saving the norm's kernel."""
    k = check_linear(x, weight, fmt, bias)[0]
    if x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, {k}]; got {tuple(x.shape)}")
    x, norm = triton_gemv.input_norm(x, residual, norm_weight, eps, ValueError)
    return _launch(x, weight, fmt, bias, config, norm, normed=True), norm.total


def _launch(x, weight, fmt, bias, config, norm: InputNorm, normed=False):
    x, n, k = x.contiguous(), weight.shape[0], fmt.features(weight.shape[1])
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        if norm.total is not None:
            norm.total.copy_(x + norm.residual)
        return out
    c = config or choose_config(n, k, fmt, triton_attention.sm_count(x.device))
    if c.block_k < 64 or c.block_k & (c.block_k - 1):
        raise ValueError(f"block_k must be a power of two of at least 64; got {c.block_k}")
    k_per_split, splits = split_k(k, c.block_k, c.splits)
    part = out if splits == 1 else torch.empty((splits, 1, n), dtype=torch.float32,
                                               device=x.device)
    launch = pdl.launch_options(x.device)
    _gemv_kernel[(triton.cdiv(n, c.block_n), splits)](
        x, _or(norm.residual, x), norm.weight, _or(norm.total, x), weight,
        _or(bias, x), part, n, k, k_per_split, weight.stride(0),
        part.stride(0) if splits > 1 else 0, norm.eps, FORMAT=fmt.code,
        TYPE_SIZE=fmt.type_size, HAS_BIAS=bias is not None and splits == 1,
        NORM=normed, HAS_RES=norm.residual is not None, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        WIDTH=unit_width(fmt), GAP=unit_gap(fmt), num_warps=c.num_warps, **launch)
    if splits > 1:
        sum_splits(part, bias, out, launch)
    return out


def _or(tensor, placeholder):
    """A pointer argument the kernel does not read when ``tensor`` is None."""
    return placeholder if tensor is None else tensor


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               launch: dict) -> None:
    """``out = sum of part's splits (+ bias)`` in a fixed order (deterministic): the
    split-K GEMV's reduction kernel, shared with ``triton_gguf_matmul``."""
    splits, m, n = part.shape
    block = min(1024, next_power_of_2(n))
    triton_gemv._reduce_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else out, out, n, splits, part.stride(0),
        part.stride(1), out.stride(0), HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        **launch)
