"""Decoding GGUF blocks inside a Triton program, shared by the GGUF matmul and embedding
kernels (layouts: ``gguf_blocks.py``; the matrix-vector product reads them in units,
``triton_gguf_units.py``, with the readers and constants here).

A tile is ``[rows, groups, group_size]``: ``row`` is each row's byte offset
(``[R, 1, 1]``), ``g`` the groups' index within the row (``[1, G, 1]``), ``j`` the
element within a group (``[1, 1, GROUP]``). Scales and offsets are read once per group
(``[R, G, 1]``), quants once per element; an element's value is ``scale * q + offset``
in fp32, as ``gguf.quants.dequantize`` computes it (fp16 scales widened to fp32). The
byte offsets inside a block follow llama.cpp's structs (``block_q4_K`` and kin) in the
order ``gguf.quants`` unpacks them. A Q4_K or Q5_K block's 16-byte head is read as four
words where the rows allow (``reads_words``), byte by byte elsewhere.
"""

import torch
import triton
import triton.language as tl
from gguf.constants import QK_K, GGMLQuantizationType as Q

from tokenspeed.backends.kernels.gguf_blocks import GATHERED_CODE, GATHERED_RUN

Q8_0 = tl.constexpr(int(Q.Q8_0))
Q8_0_G8 = tl.constexpr(GATHERED_CODE)
RUN = tl.constexpr(GATHERED_RUN)                # Q8_0_G8: blocks a run, their fp16 scales first
Q4_0 = tl.constexpr(int(Q.Q4_0))
Q4_1 = tl.constexpr(int(Q.Q4_1))
Q5_0 = tl.constexpr(int(Q.Q5_0))
Q5_1 = tl.constexpr(int(Q.Q5_1))
Q4_K = tl.constexpr(int(Q.Q4_K))
Q5_K = tl.constexpr(int(Q.Q5_K))
Q6_K = tl.constexpr(int(Q.Q6_K))
K_SUB_BLOCKS = tl.constexpr(8)                 # Q4_K / Q5_K: 8 sub-blocks of 32, 6-bit scales
K_SCALES = tl.constexpr(4)                     # Q4_K / Q5_K: 2 fp16 (d, dmin), then 12 scale bytes
K_QH = tl.constexpr(16)                        # Q5_K: the high bits, QK_K / 8 bytes
Q4_K_QS = tl.constexpr(16)                     # Q4_K: the nibbles, QK_K / 2 bytes
Q5_K_QS = tl.constexpr(16 + QK_K // 8)         # Q5_K: the nibbles, after the high bits
Q6_K_GROUPS = tl.constexpr(QK_K // 16)         # Q6_K: 16 int8 scales, one per 16 elements
Q6_K_QH = tl.constexpr(QK_K // 2)              # Q6_K: low nibbles first, then 2-bit highs
Q6_K_SCALES = tl.constexpr(QK_K // 2 + QK_K // 4)
Q6_K_D = tl.constexpr(QK_K // 2 + QK_K // 4 + QK_K // 16)


def reads_words(weight: torch.Tensor, fmt) -> bool:
    """Whether the kernels read a Q4_K or Q5_K block's head as words (``k_head_words``):
    their blocks (144 and 176 bytes) keep every head 4-byte aligned when the rows are."""
    return (fmt.qtype in (Q.Q4_K, Q.Q5_K) and weight.data_ptr() % 4 == 0
            and weight.stride(0) % 4 == 0)


ONE_BITS = 0x3F800000  # 1.0's bits: a kernel argument (see ``mantissa_float``)


@triton.jit
def mantissa_float(word, FIRST: tl.constexpr, WIDTH: tl.constexpr, one_bits):
    """Bits ``FIRST`` to ``FIRST + WIDTH`` of 32-bit words, a value ``v``, as the float
    ``1 + v / 2**WIDTH``: moved to the top of 1.0's mantissa (``one_bits``), with no
    conversion instruction (``I2F`` runs at a quarter of the FMA rate on sm_90, one an
    element in a product that reads the integer). A right shift's sign bits land above the
    mantissa (``FIRST + WIDTH`` is at most 32), where the mask clears them. ``one_bits``
    comes as an argument so that ptxas keeps it in a register and the mask and the or are
    one LOP3 (with two immediates they take two)."""
    TOP: tl.constexpr = 23 - WIDTH
    if FIRST <= TOP:
        moved = word << (TOP - FIRST)
    else:
        moved = word >> (FIRST - TOP)
    return ((moved & (((1 << WIDTH) - 1) << TOP)) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def read_byte(ptr, mask):
    """The unsigned byte at ``ptr``, as int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def read_int8(ptr, mask):
    """The signed byte at ``ptr``, as fp32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def read_short(ptr, mask):
    """The unsigned 16 bits at byte ``ptr`` (2-byte aligned, as ``read_half``), as int32."""
    return tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32)


@triton.jit
def read_half(ptr, mask):
    """The fp16 at byte ``ptr``, as fp32. Every fp16 of a block sits at an even offset and
    every type size is even, so rows starting at even addresses keep them 2-byte aligned
    (``gguf_blocks.check_weight``)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _simple(w_ptr, row, g, j, mask, FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: a block is one group; fp16 d (and min m for *_1),
    then (5-bit formats) 32 high bits, then the quants."""
    base = w_ptr + row + g * TYPE_SIZE
    d = read_half(base, mask)
    if FORMAT == Q8_0:
        return read_int8(base + 2 + j, mask), d, tl.zeros_like(d)
    header: tl.constexpr = 4 if (FORMAT == Q4_1 or FORMAT == Q5_1) else 2
    five: tl.constexpr = FORMAT == Q5_0 or FORMAT == Q5_1
    quants: tl.constexpr = header + 4 if five else header
    q = (read_byte(base + quants + j % 16, mask) >> (4 * (j // 16))) & 15
    if five:
        q = q | (((read_byte(base + header + j // 8, mask) >> (j % 8)) & 1) << 4)
    if header == 4:
        return q.to(tl.float32), d, read_half(base + 2, mask)
    return (q - (16 if five else 8)).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def gathered_run(base, b, mask):
    """Q8_0_G8: block ``b`` (of ``RUN``) of the run at ``base``: its fp16 scale (fp32) and the
    address of its 32 quants, 16-byte aligned where the rows are."""
    return read_half(base + 2 * b, mask), base + 2 * RUN + b * 32


@triton.jit
def _q8_0_g8(w_ptr, row, g, j, mask, TYPE_SIZE: tl.constexpr):
    """Q8_0_G8 (``gguf_blocks``): group ``g`` is block ``g % RUN`` of run ``g // RUN``."""
    d, quants = gathered_run(w_ptr + row + (g // RUN) * TYPE_SIZE, g % RUN, mask)
    return read_int8(quants + j, mask), d, tl.zeros_like(d)


@triton.jit
def _six_bits(a, b, c, s):
    """Q4_K / Q5_K: sub-block ``s``'s 6-bit scale and min from bytes ``s % 4`` (``a``),
    ``4 + s % 4`` (``b``) and ``8 + s % 4`` (``c``) of the 12, as fp32."""
    upper = s >= 4
    scale = tl.where(upper, (c & 15) | ((a >> 2) & 48), a & 63).to(tl.float32)
    least = tl.where(upper, (c >> 4) | ((b >> 2) & 48), b & 63).to(tl.float32)
    return scale, least


@triton.jit
def k_scale_min(base, s, mask):
    """Q4_K / Q5_K: sub-block ``s``'s 6-bit scale and min, unpacked from the 12 bytes."""
    low = base + K_SCALES + s % 4
    return _six_bits(read_byte(low, mask), read_byte(low + 4, mask), read_byte(low + 8, mask), s)


@triton.jit
def _halves(word):
    """The two fp16 of a word (low, high), as fp32."""
    low = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    high = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return low.to(tl.float32), high.to(tl.float32)


@triton.jit
def k_head_words(base, s, mask):
    """Q4_K / Q5_K: a block's 16-byte head as four 32-bit words, one load (``base`` 4-byte
    aligned): d, dmin, and sub-block ``s``'s 6-bit scale and min as ``k_scale_min``
    unpacks them. Triton pipelines loads of 4 bytes or more (asynchronous copies), so the
    head's byte loads stalled every K tile; read as words, the 1B shape's projections at 32
    rows took 1.74 ms a token instead of 2.56 on an H100 (PERFORMANCE.md, 2026-12-05)."""
    head = tl.load(base.to(tl.pointer_type(tl.int32)) + tl.arange(0, 4)[None, None, :],
                   mask=mask, other=0)
    even, odd = tl.split(tl.reshape(head, [head.shape[0], head.shape[1], 2, 2]))
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    d, dmin = _halves(w0[:, :, None])
    shift = 8 * (s % 4)
    scale, least = _six_bits((w1[:, :, None] >> shift) & 255, (w2[:, :, None] >> shift) & 255,
                             (w3[:, :, None] >> shift) & 255, s)
    return d, dmin, scale, least


@triton.jit
def _q4_q5_k(w_ptr, row, g, j, mask, FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr,
             WORDS: tl.constexpr):
    """Q4_K, Q5_K: fp16 d and dmin, 8 pairs of 6-bit (scale, min) packed in 12 bytes, then
    (Q5_K) 32 bytes of high bits, then nibbles: byte b of each 32 holds sub-blocks 2c and
    2c + 1 (low, high nibble). ``WORDS``: the head read as words (``k_head_words``)."""
    base = w_ptr + row + (g // K_SUB_BLOCKS) * TYPE_SIZE
    s = g % K_SUB_BLOCKS
    if WORDS:
        d, dmin, scale, least = k_head_words(base, s, mask)
    else:
        scale, least = k_scale_min(base, s, mask)
        d, dmin = read_half(base, mask), read_half(base + 2, mask)
    quants: tl.constexpr = Q5_K_QS if FORMAT == Q5_K else Q4_K_QS
    q = (read_byte(base + quants + (s // 2) * 32 + j, mask) >> (4 * (s % 2))) & 15
    if FORMAT == Q5_K:
        q = q | (((read_byte(base + K_QH + j, mask) >> s) & 1) << 4)
    return q.to(tl.float32), d * scale, -(dmin * least)


@triton.jit
def _q6_k(w_ptr, row, g, j, mask, TYPE_SIZE: tl.constexpr):
    """Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d. Element
    e of a half h = e // 128 takes nibble (r // 64) of byte r % 64 and bit pair r // 32 of
    byte r % 32, r = e % 128; the value is d * scale * (q - 32)."""
    base = w_ptr + row + (g // Q6_K_GROUPS) * TYPE_SIZE
    s = g % Q6_K_GROUPS
    e = s * 16 + j
    h, r = e // 128, e % 128
    low = (read_byte(base + h * 64 + r % 64, mask) >> (4 * (r // 64))) & 15
    high = (read_byte(base + Q6_K_QH + h * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
    d = read_half(base + Q6_K_D, mask) * read_int8(base + Q6_K_SCALES + s, mask)
    return ((low | (high << 4)) - 32).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def group_parts(w_ptr, row, g, j, mask, FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                WORDS: tl.constexpr):
    """The groups ``g`` of rows at byte offsets ``row`` as ``(q, scale, offset)``: fp32
    quants ``[R, G, GROUP]`` (integers, a format's fixed bias subtracted) and per group
    ``[R, G, 1]`` the scale and offset (0 where the format has none), the value being
    ``scale * q + offset`` (``group_values``). ``mask``: ``[R, G, 1]``, the groups that
    exist; others read as 0."""
    if FORMAT == Q6_K:
        parts = _q6_k(w_ptr, row, g, j, mask, TYPE_SIZE)
    elif FORMAT == Q4_K or FORMAT == Q5_K:
        parts = _q4_q5_k(w_ptr, row, g, j, mask, FORMAT, TYPE_SIZE, WORDS)
    elif FORMAT == Q8_0_G8:
        parts = _q8_0_g8(w_ptr, row, g, j, mask, TYPE_SIZE)
    else:
        parts = _simple(w_ptr, row, g, j, mask, FORMAT, TYPE_SIZE)
    return parts


@triton.jit
def group_values(w_ptr, row, g, j, mask, FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                 WORDS: tl.constexpr):
    """fp32 ``[R, G, GROUP]``: the values of groups ``g`` of rows at byte offsets ``row``
    (``mask``: ``[R, G, 1]``, the groups that exist; others read as 0)."""
    q, scale, offset = group_parts(w_ptr, row, g, j, mask, FORMAT, TYPE_SIZE, WORDS)
    if FORMAT == Q4_1 or FORMAT == Q5_1 or FORMAT == Q4_K or FORMAT == Q5_K:
        values = scale * q + offset
    else:
        values = scale * q
    return values


@triton.jit
def weight_groups(w_ptr, n, nmask, g0, groups, stride_wn, FORMAT: tl.constexpr,
                  TYPE_SIZE: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                  WORDS: tl.constexpr):
    """fp32 ``[BLOCK_N, GROUPS, GROUP]``: rows ``n`` (``[BLOCK_N]``), groups ``g0`` to
    ``g0 + GROUPS`` of each (``groups``: how many a row has; past them, and past
    ``nmask``, zeros)."""
    g = g0 + tl.arange(0, GROUPS)[None, :, None]
    j = tl.arange(0, GROUP)[None, None, :]
    row = n.to(tl.int64)[:, None, None] * stride_wn
    return group_values(w_ptr, row, g, j, nmask[:, None, None] & (g < groups), FORMAT, TYPE_SIZE,
                        WORDS)


@triton.jit
def weight_tile(w_ptr, n, nmask, g0, groups, stride_wn, FORMAT: tl.constexpr,
                TYPE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                GROUP: tl.constexpr, WORDS: tl.constexpr):
    """``weight_groups`` as ``[BLOCK_N, GROUPS * GROUP]`` (the tensor-core tile)."""
    values = weight_groups(w_ptr, n, nmask, g0, groups, stride_wn, FORMAT, TYPE_SIZE, GROUPS, GROUP,
                           WORDS)
    return tl.reshape(values, [BLOCK_N, GROUPS * GROUP])
