"""Tensor-core matrix product over a GGUF weight: ``x [M, K] @ W[N, K].T`` for prefill and
batches of 2 rows or more, each weight tile decoded in registers to x's dtype and fed to
``tl.dot`` (fp32 accumulation).

The program computes the product transposed, ``W_tile @ x_tile.T``: the decoded weight is
the left operand, which Hopper's wgmma reads from registers (the right one must be staged
in shared memory, as the x tile is loaded), and the weight's rows fill the instruction's
64-row side even when a decode batch has only a few rows.

A decode batch of up to 64 rows is one row tile, so it reads each weight block once, as
the matrix-vector kernel does, with K split over programs to keep every SM streaming (the GEMV's reduction sums them);
prefill tiles are 128 x 128, visited in bands of
``BAND_M`` row tiles so that the weight tiles a band shares stay in L2. ``linear`` picks
this kernel or ``triton_gguf_gemv`` by the number of rows: it is the GGUF matmul op.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_attention, triton_gguf_gemv
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.gguf_blocks import Q, BlockFormat, check_linear
from tokenspeed.backends.kernels.triton_gemv import split_k
from tokenspeed.backends.kernels.triton_gguf_dequant import (ONE_BITS, k_head_words, k_scale_min,
                                                          mantissa_float, read_half, reads_words,
                                                          weight_tile)

SKINNY_M = 64


@attrs.frozen
class MatmulConfig:
    """Tile rows (of x) and columns (weight rows), scale groups per K tile, K splits (each
    a program, summed by a second kernel), the launch's warps and stages, and whether a
    Q4_K tile is read as byte pairs (``_q4_k_pairs``: whole tiles of whole 64-element
    chunks)."""
    block_m: int
    block_n: int
    groups: int
    splits: int
    num_warps: int
    num_stages: int
    pairs: bool = False


@triton.jit
def _banded_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BAND_M: tl.constexpr):
    """(row tile, column tile) of this program: bands of ``BAND_M`` row tiles walk the
    columns together, so a weight tile is read by the band while it is in L2."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid, per_band = tl.program_id(0), BAND_M * tiles_n
    band = pid // per_band
    band_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - band * BAND_M, BAND_M)
    return band * BAND_M + (pid % per_band) % band_rows, (pid % per_band) // band_rows


@triton.jit
def _pair_order(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """An input tile's columns in the order ``_q4_k_pairs`` decodes: in each 64-column
    chunk, byte ``t`` gives positions ``2t`` and ``2t + 1`` its elements ``t`` and ``32 + t``."""
    chunks = tl.reshape(x, [BLOCK_M, BLOCK_K // 64, 2, 32])
    return tl.reshape(tl.permute(chunks, (0, 1, 3, 2)), [BLOCK_M, BLOCK_K])


@triton.jit
def _q4_k_pairs(w_ptr, n, N, k0, stride_wn, one_bits, TYPE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """A Q4_K tile, fp32 ``[BLOCK_N, BLOCK_K]`` in ``_pair_order``: its whole 64-element
    chunks read as their 32 bytes, each byte's nibbles decoded side by side. Where the
    rows are 4-byte aligned (``WORDS``) a chunk is 8 words and a nibble a float by its bits
    (``_word_pairs``); otherwise 32 bytes, each nibble converted.
    ``weight_tile`` instead reads a byte for each element at a computed address: compiled
    for sm_90 at the engine's 32-row tile of the 1B shape's gate/up, 16.9 instructions an
    element against 12.0 for bytes here and 12.1 for words, whose conversions are 0.7 an
    element instead of 1.7, all of them to bf16: at such counts issue and the conversions,
    more than memory, bound a decode batch's product (timed in ``_decode_tiles``). No
    weight load is masked: ``_check_tiles`` makes every split whole tiles, and rows past
    ``N`` read the last row, their sums never stored."""
    CHUNKS: tl.constexpr = BLOCK_K // 64
    c = k0 // 64 + tl.arange(0, CHUNKS)[None, :, None]
    rows = tl.minimum(n, N - 1).to(tl.int64)[:, None, None] * stride_wn
    block = w_ptr + rows + (c // 4) * TYPE_SIZE
    s, every = 2 * (c % 4), tl.full([1, 1, 1], True, tl.int1)
    if WORDS:
        d, dmin, scale_lo, least_lo = k_head_words(block, s, every)
        d, dmin, scale_hi, least_hi = k_head_words(block, s + 1, every)
        words = (block + 16 + (c % 4) * 32).to(tl.pointer_type(tl.int32))
        tile = _word_pairs(tl.load(words + tl.arange(0, 8)[None, None, :]), d * scale_lo,
                           dmin * least_lo, d * scale_hi, dmin * least_hi, one_bits)
    else:
        scale_lo, least_lo = k_scale_min(block, s, every)
        scale_hi, least_hi = k_scale_min(block, s + 1, every)
        d, dmin = read_half(block, every), read_half(block + 2, every)
        q = tl.load(block + 16 + (c % 4) * 32 + tl.arange(0, 32)[None, None, :]).to(tl.int32)
        lo = (d * scale_lo) * (q & 15).to(tl.float32) + -(dmin * least_lo)
        hi = (d * scale_hi) * (q >> 4).to(tl.float32) + -(dmin * least_hi)
        tile = tl.join(lo, hi)
    return tl.reshape(tile, [BLOCK_N, BLOCK_K])


@triton.jit
def _word_pairs(q, scale_lo, least_lo, scale_hi, least_hi, one_bits):
    """``[R, C, 8]`` words of nibbles decoded ``[R, C, 8, 2, 2, 2]``, flat in
    ``_pair_order``: nibble ``k`` of word ``v`` (byte ``k // 2``'s high nibble when ``k``
    is odd) lands at ``8v + k``. A nibble ``n`` is read as ``f = 1 + n / 16``
    (``mantissa_float``), so its weight ``scale n - least`` is ``16 scale f - (16 scale +
    least)``: one FMA an element, as from the integer."""
    f0, f1 = mantissa_float(q, 0, 4, one_bits), mantissa_float(q, 4, 4, one_bits)
    f2, f3 = mantissa_float(q, 8, 4, one_bits), mantissa_float(q, 12, 4, one_bits)
    f4, f5 = mantissa_float(q, 16, 4, one_bits), mantissa_float(q, 20, 4, one_bits)
    f6, f7 = mantissa_float(q, 24, 4, one_bits), mantissa_float(q, 28, 4, one_bits)
    even = tl.join(tl.join(f0, f4), tl.join(f2, f6))  # [.., c1, c2]: nibble 4 c1 + 2 c2
    odd = tl.join(tl.join(f1, f5), tl.join(f3, f7))
    a_lo, a_hi = (16.0 * scale_lo)[:, :, :, None, None], (16.0 * scale_hi)[:, :, :, None, None]
    b_lo = (16.0 * scale_lo + least_lo)[:, :, :, None, None]
    b_hi = (16.0 * scale_hi + least_hi)[:, :, :, None, None]
    return tl.join(a_lo * even - b_lo, a_hi * odd - b_hi)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_xm,
                   stride_wn, stride_os, stride_om, one_bits, FORMAT: tl.constexpr,
                   TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                   BAND_M: tl.constexpr, PRECISION: tl.constexpr, WORDS: tl.constexpr,
                   PAIRS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    tile_m, tile_n = _banded_tile(M, N, BLOCK_M, BLOCK_N, BAND_M)
    split = tl.program_id(1)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    BLOCK_K: tl.constexpr = GROUPS * GROUP
    kk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_tile = x_ptr + m.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # the product transposed: see above
    pdl.wait(USE_PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PAIRS:  # whole tiles (see _q4_k_pairs)
            x = _pair_order(tl.load(x_tile + k0, mask=mmask[:, None], other=0.0), BLOCK_M, BLOCK_K)
            w = _q4_k_pairs(w_ptr, n, N, k0, stride_wn, one_bits, TYPE_SIZE, BLOCK_N, BLOCK_K, WORDS)
        else:
            x = tl.load(x_tile + k0, mask=mmask[:, None] & (k0 + kk < k_hi)[None, :], other=0.0)
            w = weight_tile(w_ptr, n, nmask, k0 // GROUP, k_hi // GROUP, stride_wn, FORMAT,
                            TYPE_SIZE, BLOCK_N, GROUPS, GROUP, WORDS)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + split.to(tl.int64) * stride_os + m.to(tl.int64)[None, :] * stride_om + \
        n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


def choose_config(m: int, n: int, k: int, fmt: BlockFormat, sm_count: int) -> MatmulConfig:
    """Up to ``SKINNY_M`` rows, one row tile (a decode batch reads the weight once): see
    ``_decode_tiles``. More rows: 128 x 128 tiles, or 64 x 64 ones (K split if need be)
    where the large ones would leave SMs idle, with K tiles of 64: longer ones spill
    registers for some formats past 32 rows (ptxas, sm_90a)."""
    if m <= SKINNY_M:
        return _decode_tiles(m, n, k, fmt, sm_count)
    large = MatmulConfig(128, 128, 64 // fmt.group_size, 1, 8, 3)
    if _tiles(large, m, n) >= sm_count:
        return large
    return _filled(MatmulConfig(64, 64, 64 // fmt.group_size, 1, 4, 3), m, n, k,
                   2 * sm_count, max_splits=4, min_split=1024, idle_below=sm_count)


def _decode_tiles(m: int, n: int, k: int, fmt: BlockFormat, sm_count: int) -> MatmulConfig:
    """A program has only a few KB in flight, so a decode batch wants several programs an
    SM. Wide tiles (128 columns, 64-long K tiles, 3 stages) where a vocabulary head has
    programs enough from its columns alone, and for Q6_K, whose decoding is the heaviest,
    K split towards at most two programs an SM; any other weight 64 columns, 128-long K
    tiles, 2 stages, K split towards at most four. A split is at least 256 long, and at
    most 16 of them. Chosen from a sweep on an H100 (8 and 32 rows, Q4_K, Q8_0 and Q6_K,
    the 1B shape's projections): the model's linears at 32 rows 1.21x (Q4_K), 1.10x (Q8_0)
    and 1.12x (Q6_K) faster than the earlier rule (64 columns, 3 stages, up to 8 splits
    towards at least four programs an SM), within 1.03x, 1.07x and 1.02x of each shape's
    best config; Q4_K at 8 rows 1.08x faster, 1.23x off its best (PERFORMANCE.md,
    2026-12-05). 33 to 64 rows (not swept) keep the earlier rule. A Q4_K tile is read as
    byte pairs (``_q4_k_pairs``): on an H100 at these tiles the 1B shape's linears a token
    took 1.121 ms instead of 1.616 at 8 rows and 1.215 instead of 1.445 at 32, and its
    decode at batch 32 through ``ts.LLM`` 1.72-1.73 ms instead of 2.02-2.05 (2026-12-06;
    at 2048 rows they were 2 % slower, so a prefill's tiles read elements)."""
    return attrs.evolve(_decode_shape(m, n, k, fmt, sm_count), pairs=fmt.qtype == Q.Q4_K)


def _decode_shape(m: int, n: int, k: int, fmt: BlockFormat, sm_count: int) -> MatmulConfig:
    """``_decode_tiles``' tiles, warps, stages and splits."""
    block_m = max(16, next_power_of_2(m))
    if block_m > 32:
        return _filled(MatmulConfig(block_m, 64, 64 // fmt.group_size, 1, 4, 3), m, n, k,
                       4 * sm_count, max_splits=8, min_split=256)
    if triton.cdiv(n, 64) >= 4 * sm_count or fmt.qtype == Q.Q6_K:
        return _split(MatmulConfig(block_m, 128, 64 // fmt.group_size, 1, 4, 3), n, k,
                      2 * sm_count)
    return _split(MatmulConfig(block_m, 64, 128 // fmt.group_size, 1, 4, 2), n, k,
                  4 * sm_count)


def _split(config: MatmulConfig, n: int, k: int, programs: int) -> MatmulConfig:
    """``config`` with K split in up to 16, each split at least 256 long, so that the
    programs come to at most ``programs`` (no split where the columns alone reach it)."""
    splits = max(1, min(16, programs // triton.cdiv(n, config.block_n), k // 256))
    return attrs.evolve(config, splits=splits)


def _tiles(config: MatmulConfig, m: int, n: int) -> int:
    return triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)


def _filled(config: MatmulConfig, m, n, k, programs, max_splits, min_split,
            idle_below=None) -> MatmulConfig:
    """``config`` with K split towards ``programs`` programs, each split at least
    ``min_split`` long, when its tiles are fewer than ``idle_below`` (``programs``)."""
    tiles = _tiles(config, m, n)
    if tiles >= (idle_below or programs):
        return config
    splits = min(max_splits, triton.cdiv(programs, tiles), max(1, k // min_split))
    return attrs.evolve(config, splits=splits)


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
    c = config or choose_config(m, n, k, fmt, triton_attention.sm_count(x.device))
    _check_tiles(c, k, fmt)
    k_per_split, splits = split_k(k, c.groups * fmt.group_size, c.splits)
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                               device=x.device)
    launch = pdl.launch_options(x.device)
    _matmul_kernel[(triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), splits)](
        x, weight, bias if bias is not None and splits == 1 else x, part, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), part.stride(0) if splits > 1 else 0, part.stride(-2), ONE_BITS,
        FORMAT=fmt.code, TYPE_SIZE=fmt.type_size, HAS_BIAS=bias is not None and splits == 1,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, GROUPS=c.groups, GROUP=fmt.group_size, BAND_M=8,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        WORDS=reads_words(weight, fmt), PAIRS=c.pairs, num_warps=c.num_warps,
        num_stages=c.num_stages, **launch)
    if splits > 1:
        triton_gguf_gemv.sum_splits(part, bias, out, launch)
    return out


def _check_tiles(c: MatmulConfig, k: int, fmt: BlockFormat) -> None:
    """Tile sides are powers of two (Triton's ranges); byte pairs read Q4_K tiles of whole
    64-element chunks, unmasked: K whole tiles."""
    tile = c.groups * fmt.group_size
    sides = {"block_m": c.block_m, "block_n": c.block_n, "K tile (groups x group size)": tile}
    for name, side in sides.items():
        if side < 1 or side & (side - 1):
            raise ValueError(f"a matmul tile's {name} must be a power of two; got {side}")
    if c.pairs and (fmt.qtype != Q.Q4_K or tile % 64 or k % tile):
        raise ValueError(f"byte pairs read Q4_K tiles of whole 64-element chunks that divide K; got "
                         f"{fmt.name}, tiles of {tile} and K {k}")


def linear(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat,
           bias: torch.Tensor = None) -> torch.Tensor:
    """The GGUF matmul op: one row by the matrix-vector kernel, more by tensor cores."""
    if x.dim() == 2 and x.shape[0] == 1:
        return triton_gguf_gemv.gemv(x, weight, fmt, bias)
    return matmul(x, weight, fmt, bias)

