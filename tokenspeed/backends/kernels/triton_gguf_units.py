"""GGUF blocks read for a matrix-vector product: in *units*, each of whose quant bytes is
read once (``triton_gguf_gemv.py``; readers and layouts: ``triton_gguf_dequant.py``). A
block's scales, and Q5_K's and Q6_K's high bits, are read by each unit that uses them.

Reading a tile as scale groups (``group_parts``) reads a byte of two nibbles twice, once
for each group it serves, and Q6_K's bytes two and four times through computed offsets.
A unit is instead a run of ``unit_width`` bytes read once, decoded into two *halves*,
the elements of its bytes' low and high parts: a simple block's 16 bytes of nibbles (Q8_0:
its 32 quants as two runs of 16), 32 bytes of a Q4_K / Q5_K block's nibbles (two
sub-blocks), 16 of Q6_K's (elements 64 apart), a Q8_0_G8 block's 32 quants. Each
half shares one scale, so a matrix-vector product sums a half's products before it
scales them. On the H200 this alone took decoding the 1B shape from 4.07 to 2.12 ms a
token in Q6_K and from 1.10 to 0.92 in Q4_K (PERFORMANCE.md, 2026-12-04).
"""

import triton
import triton.language as tl

from tokenspeed.backends.kernels.gguf_blocks import Q
from tokenspeed.backends.kernels.triton_gguf_dequant import (
    K_QH, Q4_1, Q4_K_QS, Q5_0, Q5_1, Q5_K, Q5_K_QS, Q6_K, Q6_K_D, Q6_K_QH, Q6_K_SCALES, Q8_0,
    Q8_0_G8, RUN, Q4_K, gathered_run, k_scale_min, read_byte, read_half, read_int8, read_short)


@triton.jit
def _simple_halves(base, t, mask, FORMAT: tl.constexpr):
    """A simple format's block as two halves of 16: elements ``t`` and ``16 + t`` share
    byte ``t``'s nibbles (Q8_0: bytes ``t`` and ``16 + t``) and, for the 5-bit formats,
    bits ``t`` and ``16 + t`` of the high word, read as two 16-bit halves."""
    d = read_half(base, mask)
    zero = tl.zeros_like(d)
    if FORMAT == Q8_0:
        return (read_int8(base + 2 + t, mask), d, zero), (read_int8(base + 18 + t, mask), d, zero)
    header: tl.constexpr = 4 if (FORMAT == Q4_1 or FORMAT == Q5_1) else 2
    five: tl.constexpr = FORMAT == Q5_0 or FORMAT == Q5_1
    quants: tl.constexpr = header + 4 if five else header
    b = read_byte(base + quants + t, mask)
    lo, hi = b & 15, b >> 4
    if five:
        lo |= ((read_short(base + header, mask) >> t) & 1) << 4
        hi |= ((read_short(base + header + 2, mask) >> t) & 1) << 4
    if header == 4:
        m = read_half(base + 2, mask)
        return (lo.to(tl.float32), d, m), (hi.to(tl.float32), d, m)
    bias: tl.constexpr = 16 if five else 8
    return ((lo - bias).to(tl.float32), d, zero), ((hi - bias).to(tl.float32), d, zero)


@triton.jit
def _gathered_halves(base, b, t, mask):
    """Q8_0_G8: block ``b`` of the run at ``base``, its quants ``t`` and ``16 + t``."""
    d, quants = gathered_run(base, b, mask)
    zero = tl.zeros_like(d)
    return (read_int8(quants + t, mask), d, zero), (read_int8(quants + 16 + t, mask), d, zero)


@triton.jit
def _k_halves(base, c, t, mask, FORMAT: tl.constexpr):
    """Q4_K / Q5_K: the 32 bytes of nibbles ``c`` (of 4) of a block hold sub-blocks
    ``2c`` (low nibbles) and ``2c + 1`` (high); Q5_K's high bits are bits ``2c`` and
    ``2c + 1`` of the 32 bytes before them."""
    quants: tl.constexpr = Q5_K_QS if FORMAT == Q5_K else Q4_K_QS
    b = read_byte(base + quants + c * 32 + t, mask)
    lo, hi = b & 15, b >> 4
    if FORMAT == Q5_K:
        high = read_byte(base + K_QH + t, mask)
        lo |= ((high >> (2 * c)) & 1) << 4
        hi |= ((high >> (2 * c + 1)) & 1) << 4
    d, dmin = read_half(base, mask), read_half(base + 2, mask)
    scale_lo, least_lo = k_scale_min(base, 2 * c, mask)
    scale_hi, least_hi = k_scale_min(base, 2 * c + 1, mask)
    return ((lo.to(tl.float32), d * scale_lo, -(dmin * least_lo)),
            (hi.to(tl.float32), d * scale_hi, -(dmin * least_hi)))


@triton.jit
def _q6_k_halves(base, h, a, t, mask):
    """Q6_K: byte ``16a + t`` of half ``h``'s 64 bytes of nibbles holds elements
    ``16a + t`` (low) and ``64 + 16a + t`` (high) of the half; both take their top bits
    from byte ``16 (a % 2) + t`` of its 32 bytes of bit pairs (pairs ``a // 2`` and
    ``2 + a // 2``); their scales are the block's ``8h + a`` and ``8h + 4 + a``."""
    b = read_byte(base + h * 64 + a * 16 + t, mask)
    high = read_byte(base + Q6_K_QH + h * 32 + (a % 2) * 16 + t, mask)
    shift = 2 * (a // 2)
    lo = (b & 15) | (((high >> shift) & 3) << 4)
    hi = (b >> 4) | (((high >> (shift + 4)) & 3) << 4)
    d = read_half(base + Q6_K_D, mask)
    scales = base + Q6_K_SCALES + h * 8 + a
    zero = tl.zeros_like(d)
    return (((lo - 32).to(tl.float32), d * read_int8(scales, mask), zero),
            ((hi - 32).to(tl.float32), d * read_int8(scales + 4, mask), zero))


@triton.jit
def unit_halves(w_ptr, row, u, t, mask, FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """Units ``u`` of rows at byte offsets ``row``, each read once as the two halves its
    bytes hold (``unit_width``): per half ``(q, scale, offset)`` as ``group_parts``
    gives them, ``q`` ``[R, U, WIDTH]`` over lanes ``t`` and the scale and offset
    ``[R, U, 1]``. A byte of nibbles is read once for both of its elements; the first
    half's elements are ``unit_elements``, the second's that plus ``unit_gap``.
    ``mask``: ``[R, U, 1]``, the units that exist."""
    if FORMAT == Q6_K:
        halves = _q6_k_halves(w_ptr + row + (u // 8) * TYPE_SIZE, (u // 4) % 2, u % 4, t, mask)
    elif FORMAT == Q4_K or FORMAT == Q5_K:
        halves = _k_halves(w_ptr + row + (u // 4) * TYPE_SIZE, u % 4, t, mask, FORMAT)
    elif FORMAT == Q8_0_G8:
        halves = _gathered_halves(w_ptr + row + (u // RUN) * TYPE_SIZE, u % RUN, t, mask)
    else:
        halves = _simple_halves(w_ptr + row + u * TYPE_SIZE, t, mask, FORMAT)
    return halves


@triton.jit
def unit_elements(u, t, FORMAT: tl.constexpr):
    """The row elements of units ``u``'s first halves at lanes ``t``."""
    if FORMAT == Q6_K:
        first = (u // 4) * 128 + (u % 4) * 16 + t
    elif FORMAT == Q4_K or FORMAT == Q5_K:
        first = u * 64 + t
    else:
        first = u * 32 + t
    return first


def unit_width(fmt) -> int:
    """Lanes of a unit (``unit_halves``): a K-quant's 32 bytes of nibbles for Q4_K and
    Q5_K, 16 elsewhere; a unit is two halves of that many elements."""
    return 32 if fmt.qtype in (Q.Q4_K, Q.Q5_K) else 16


def unit_gap(fmt) -> int:
    """How far a unit's second half's elements lie past its first's."""
    return 64 if fmt.qtype == Q.Q6_K else unit_width(fmt)
