"""Matrix-vector product of a wide GGUF weight (a gate/up projection, a vocabulary head)
whose quants lie in 16-byte-aligned spans: Q4_K's 128 bytes of nibbles a block, a Q8_0_G8
run's 256 quants (``gguf_blocks``).

A wide weight has programs enough from its rows alone, so nothing here splits K, and the
engine gives it a normed input (``cuda.GGUF_NORM_GEMV_MAX_N``), so nothing here norms it.
A program reads a few rows by a tile of whole blocks as one 2-D load, a span per row and
block as 32-bit words, makes each quant a float by its bits (``mantissa_float``), sums each
32-element group's products after a reshape, and scales the group once.
The unit GEMV (``triton_gguf_gemv``) keeps ``[rows, units, lanes]`` tiles, whose
per-unit scales and half-unit inputs cost a wide weight more than its bytes: on an H100 at
the 1B shape (PERFORMANCE.md, 2026-12-06) this kernel took Q4_K's gate/up from 15.1 to
13.3 us and its head from 99.4 to 86.6, Q8_0_G8's from 25.8 and 153.5 (Q8_0's 20.8 and
155.4) to 14.5 and 95.4; at the narrower projections the unit GEMV's K splits won. (A
GPU's loader regathers only a Q8_0 output head: ``models.block_layers.gather_q8_0_head``.)
Tuned at K 2048 only; a wide weight of long K (a large model's down projection) runs
its K in one program.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.gguf_blocks import Q, BlockFormat, check_linear
from tokenspeed.backends.kernels.triton_gguf_dequant import (ONE_BITS, Q4_K, RUN, k_scale_min,
                                                          mantissa_float, read_half)
from tokenspeed.ir.weights import WIDE_ROWS

ELEMENTS = 256                     # elements a block (Q4_K) or a run (Q8_0_G8) holds
BLOCK = tl.constexpr(ELEMENTS)
SPAN_OFFSET = tl.constexpr(16)     # both formats: a block's (a run's) quants start 16 bytes in
HEAD_ROWS = 4 * WIDE_ROWS          # from here a wide weight takes a vocabulary head's config


@attrs.frozen
class WideConfig:
    """Output rows a program, blocks a K tile (a power of two), the launch's warps and
    pipeline stages."""
    block_n: int
    blocks: int
    num_warps: int
    num_stages: int


def serves(weight: torch.Tensor, fmt: BlockFormat) -> bool:
    """Whether a one-row product of this weight (``uint8 [N, row_bytes]``) runs here."""
    return weight.shape[0] >= WIDE_ROWS and (fmt.qtype == Q.Q4_K or fmt.gathered) and _aligned(weight)


def _aligned(weight: torch.Tensor) -> bool:
    """Every row starts 16-byte aligned, as the spans' 16-byte loads need."""
    return weight.data_ptr() % 16 == 0 and weight.stride(0) % 16 == 0


def choose_config(n: int, k: int, fmt: BlockFormat) -> WideConfig:
    """The best of a sweep on an H100 at the 1B shape's gate/up (16,384 rows) and head
    (128,256) (block rows 2-16, tiles of 2-8 blocks, 1-2 warps, 1-2 stages; 2026-12-06):
    Q4_K eight rows by tiles of two blocks at one warp (gate/up 14.3 us, the head 92.0),
    Q8_0_G8 four rows by four runs at one warp (14.7 and 94.7). Before quants became floats
    by their bits, 5c7ddf3's configs took Q4_K's gate/up 16.7 us and its head 85.3,
    Q8_0_G8's 14.2 and 104.0; through ``ts.LLM`` Q4_K's decode at batch 1 went from
    0.776-0.778 ms to 0.740-0.746, Q8_0's from 0.960-0.961 to 0.953."""
    head = n >= HEAD_ROWS
    if fmt.gathered:
        config = WideConfig(4, 4, 1, 1)
    else:
        config = WideConfig(8, 2, 1, 2 if head else 1)
    return attrs.evolve(config, blocks=min(config.blocks, next_power_of_2(k // ELEMENTS)))


@triton.jit
def _q4_k_tile(q, heads, x_ptr, k0, kmask, hmask, one_bits, BLOCK_N: tl.constexpr,
               BLOCKS: tl.constexpr):
    """A tile's products, ``[BLOCK_N, 4 * BLOCKS]``, from its quants as 32-bit words: word
    ``v`` of a block's 32-byte chunk ``c`` holds bytes ``4v`` to ``4v + 3``, byte ``t``'s
    low nibble element ``64c + t`` (sub-block ``2c``), its high nibble ``64c + 32 + t``.
    A nibble ``n`` becomes the float ``f = 1 + n / 16`` by its bits (``mantissa_float``),
    so a sub-block's ``sum n x`` is ``16 (sum f x - sum x)``: one shift and one LOP3 a
    nibble instead of a byte's extraction and an ``I2F`` (compiled for sm_90 at the 1B
    shape's gate/up: 9.0 instructions an element, one an ``I2F``, became 7.0, none)."""
    WORDS: tl.constexpr = 32 * BLOCKS
    UNITS: tl.constexpr = 4 * BLOCKS
    w = tl.arange(0, WORDS)
    xs = x_ptr + k0 + (w // 8) * 64 + (w % 8) * 4
    fx_lo = tl.zeros([BLOCK_N, WORDS], tl.float32)
    fx_hi = tl.zeros([BLOCK_N, WORDS], tl.float32)
    x_lo = tl.zeros([WORDS], tl.float32)
    x_hi = tl.zeros([WORDS], tl.float32)
    for byte in tl.static_range(4):  # its low nibble, then its high one
        lo_x = tl.load(xs + byte, mask=kmask, other=0.0).to(tl.float32)
        hi_x = tl.load(xs + 32 + byte, mask=kmask, other=0.0).to(tl.float32)
        fx_lo += mantissa_float(q, 8 * byte, 4, one_bits) * lo_x[None, :]
        fx_hi += mantissa_float(q, 8 * byte + 4, 4, one_bits) * hi_x[None, :]
        x_lo += lo_x
        x_hi += hi_x
    sum_lo = tl.sum(tl.reshape(x_lo, [UNITS, 8]), 1)[None, :]
    sum_hi = tl.sum(tl.reshape(x_hi, [UNITS, 8]), 1)[None, :]
    lo = 16.0 * (tl.sum(tl.reshape(fx_lo, [BLOCK_N, UNITS, 8]), 2) - sum_lo)
    hi = 16.0 * (tl.sum(tl.reshape(fx_hi, [BLOCK_N, UNITS, 8]), 2) - sum_hi)
    even = (2 * (tl.arange(0, UNITS) % 4))[None, :]
    scale_lo, least_lo = k_scale_min(heads, even, hmask)
    scale_hi, least_hi = k_scale_min(heads, even + 1, hmask)
    d, dmin = read_half(heads, hmask), read_half(heads + 2, hmask)
    return d * (scale_lo * lo + scale_hi * hi) - dmin * (least_lo * sum_lo + least_hi * sum_hi)


@triton.jit
def _gathered_tile(q, heads, x_ptr, k0, kmask, hmask, one_bits, BLOCK_N: tl.constexpr,
                   BLOCKS: tl.constexpr):
    """A tile's products, ``[BLOCK_N, 8 * BLOCKS]``, from its quants as 32-bit words (a
    run's quants are its elements in order, its eight fp16 scales first). A quant ``q``
    becomes ``f = 1 + (q + 128) / 256`` by its bits, its sign bit flipped
    (``mantissa_float``), so a block's ``sum q x`` is ``256 sum f x - 384 sum x`` (compiled
    for sm_90 at the 1B shape's head: 7.1 instructions an element, one an ``I2F``, became
    6.4, none)."""
    WORDS: tl.constexpr = 64 * BLOCKS
    w = tl.arange(0, WORDS)
    biased = q ^ -0x7F7F7F80  # 0x80808080 as an int32: each byte's sign bit flipped
    fx = tl.zeros([BLOCK_N, WORDS], tl.float32)
    xs = tl.zeros([WORDS], tl.float32)
    for byte in tl.static_range(4):
        f = mantissa_float(biased, 8 * byte, 8, one_bits)
        x = tl.load(x_ptr + k0 + 4 * w + byte, mask=kmask, other=0.0).to(tl.float32)
        fx += f * x[None, :]
        xs += x
    sums = tl.sum(tl.reshape(xs, [RUN * BLOCKS, 8]), 1)[None, :]
    dots = 256.0 * tl.sum(tl.reshape(fx, [BLOCK_N, RUN * BLOCKS, 8]), 2) - 384.0 * sums
    return dots * read_half(heads, hmask)


@triton.jit
def _tile(q, heads, x_ptr, b0, blocks, g, span, one_bits, FORMAT: tl.constexpr,
          SPAN: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCKS: tl.constexpr, EVEN_K: tl.constexpr):
    """The products of the tile at block ``b0``; ``EVEN_K``: K is whole tiles, nothing masked."""
    if EVEN_K:
        kmask, hmask = tl.full([BLOCKS * SPAN], True, tl.int1), tl.full([1, 1], True, tl.int1)
    else:
        kmask = b0 + span // SPAN < blocks
        hmask = (b0 + g // PER_BLOCK < blocks)[None, :]
    tile = (q, heads, x_ptr, b0 * BLOCK, kmask, hmask, one_bits)
    if FORMAT == Q4_K:
        products = _q4_k_tile(*tile, BLOCK_N, BLOCKS)
    else:
        products = _gathered_tile(*tile, BLOCK_N, BLOCKS)
    return products


@triton.jit
def _load_quants(quants, b0, blocks, span, SPAN: tl.constexpr, EVEN_K: tl.constexpr):
    """The quants of the tile at block ``b0``, its blocks past K read as zeros."""
    if EVEN_K:
        q = tl.load(quants)
    else:
        q = tl.load(quants, mask=(b0 + span // SPAN < blocks)[None, :], other=0)
    return q


@triton.jit
def _wide_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn, one_bits, FORMAT: tl.constexpr,
                 TYPE_SIZE: tl.constexpr, SPAN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Each tile's quants are loaded during the tile before (the first before the wait for
    the kernel that writes x); ``SPAN``: the 32-bit words of a block's quants (Q4_K: 32,
    a run: 64). Rows past ``N`` read the last row (their sums never stored), so no weight
    load is masked by rows, nor by K when it is whole tiles (``EVEN_K``): the masks' selects
    took about 0.6 of the 10 sm_90 instructions an element at the 1B shape's gate/up."""
    pdl.start(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    span = tl.arange(0, BLOCKS * SPAN)
    quants = rows + ((span // SPAN) * TYPE_SIZE + SPAN_OFFSET)[None, :]
    quants = quants.to(tl.pointer_type(tl.int32)) + (span % SPAN)[None, :]
    PER_BLOCK: tl.constexpr = 4 if FORMAT == Q4_K else RUN
    g = tl.arange(0, BLOCKS * PER_BLOCK)
    if FORMAT == Q4_K:
        heads = rows + ((g // 4) * TYPE_SIZE)[None, :]
    else:
        heads = rows + ((g // RUN) * TYPE_SIZE + 2 * (g % RUN))[None, :]
    blocks = K // BLOCK
    last = (blocks - 1) // BLOCKS * BLOCKS
    q = _load_quants(quants, 0, blocks, span, SPAN, EVEN_K)
    pdl.wait(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCKS * PER_BLOCK], tl.float32)
    for b0 in range(0, last, BLOCKS):  # every tile but the last loads the next one's quants
        acc += _tile(q, heads, x_ptr, b0, blocks, g, span, one_bits, FORMAT, SPAN, PER_BLOCK,
                     BLOCK_N, BLOCKS, EVEN_K)
        quants += BLOCKS * TYPE_SIZE // 4
        heads += BLOCKS * TYPE_SIZE
        q = _load_quants(quants, b0 + BLOCKS, blocks, span, SPAN, EVEN_K)
    acc += _tile(q, heads, x_ptr, last, blocks, g, span, one_bits, FORMAT, SPAN, PER_BLOCK,
                 BLOCK_N, BLOCKS, EVEN_K)
    y = tl.sum(acc, 1)
    nmask = n < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def gemv(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
         config: WideConfig | None = None) -> torch.Tensor:
    """``x [1, K] @ dequantize(weight).T (+ bias)`` as ``[1, N]`` in x's dtype, fp32
    accumulation; ``weight`` ``uint8 [N, row_bytes]`` in Q4_K or Q8_0_G8, K whole blocks."""
    check_linear(x, weight, fmt, bias)
    if x.shape[0] != 1 or not (fmt.qtype == Q.Q4_K or fmt.gathered):
        raise ValueError(f"the wide GEMV takes one row of a Q4_K or Q8_0_G8 weight; got "
                         f"{x.shape[0]} rows of {fmt.name}")
    if not _aligned(weight):
        raise ValueError(f"the wide GEMV reads 16-byte spans: the rows must start 16-byte aligned; "
                         f"got address {weight.data_ptr():#x} and row stride {weight.stride(0)}")
    return launch(x, weight, fmt, bias, config)


def launch(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor | None,
           config: WideConfig | None = None) -> torch.Tensor:
    """``gemv`` for a caller that has checked its arguments (``triton_gguf_gemv.gemv``: x,
    the weight and bias by ``check_linear``, the rest by ``serves``)."""
    k, n = x.shape[1], weight.shape[0]
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return out
    c = config or choose_config(n, k, fmt)
    if any(v < 1 or v & (v - 1) for v in (c.block_n, c.blocks)):
        raise ValueError(f"block_n and blocks must be powers of two; got {c.block_n} and {c.blocks}")
    _wide_kernel[(triton.cdiv(n, c.block_n),)](
        x.contiguous(), weight, bias if bias is not None else x, out, n, k, weight.stride(0), ONE_BITS,
        FORMAT=fmt.code, TYPE_SIZE=fmt.type_size, SPAN=ELEMENTS // 4 if fmt.gathered else ELEMENTS // 8,
        HAS_BIAS=bias is not None, BLOCK_N=c.block_n, BLOCKS=c.blocks,
        EVEN_K=k % (c.blocks * ELEMENTS) == 0, num_warps=c.num_warps,
        num_stages=c.num_stages, **pdl.launch_options(x.device))
    return out
