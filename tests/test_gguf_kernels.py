"""The GGUF kernels (matrix-vector, tensor-core matmul, embedding gather) against the
``gguf`` package's own dequantization followed by a float op, for every supported block
format, under the Triton interpreter on CPU (for real on a GPU).

Weights of the simple formats are written by ``gguf.quants.quantize``; the K-quants, which
it cannot write, are random bytes with modest finite fp16 scales set in place (every byte
pattern of their packed 6-bit and int8 scales and quants is valid). Shapes are small and
odd: rows not a multiple of a program's row block, K of a few blocks, batches of 1, 3 and 17.

Tolerances: fp32 inputs accumulate in fp32 in another order than the float64 reference,
so each output is within ``1e-5 * sum_k |x_k w_nk|`` of it; 16-bit inputs (the matmul
rounds the decoded weight to x's dtype for the tensor cores; the output is rounded to it)
within ``2e-2 * sum_k |x_k w_nk|``. Dequantization itself is exact under the interpreter
(the same fp32 products as ``gguf``'s); a GPU may fuse ``scale * q + offset`` into one
rounding, so it is compared within 2^-20 of the table's largest value.
"""

import itertools
import json
import os
import sys

import attrs
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from sm90 import assert_compiles  # noqa: E402

from tokenspeed.backends.kernels import gguf_reference, reference  # noqa: E402
from tokenspeed.backends.kernels import triton_gguf_dequant, triton_gguf_embedding, triton_gguf_gemv, triton_gguf_matmul  # noqa: E402
from tokenspeed.backends.kernels import triton_gguf_wide  # noqa: E402
from tokenspeed.ir.weights import Q8_0_BLOCK_BYTES, gather_scales, scatter_scales  # noqa: E402
from tokenspeed.backends.kernels.gguf_blocks import (  # noqa: E402
    GATHERED, SUPPORTED, block_format)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [q.name for q in SUPPORTED] + [GATHERED]
SCALE_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of fp16 fields
FEW = settings(max_examples=8, deadline=None, derandomize=True)


def quantized(name: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """``uint8 [rows, row_bytes]`` of format ``name`` (Q8_0_G8: Q8_0's, gathered)."""
    if name == GATHERED:
        return gather_scales(quantized("Q8_0", rows, k, seed))
    fmt, rng = block_format(name), np.random.default_rng(seed)
    if name not in SCALE_HALVES:
        weights = rng.standard_normal((rows, k)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(weights, fmt.qtype)).to(DEVICE)
    blocks = rng.integers(0, 256, (rows, k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for offset in SCALE_HALVES[name]:
        scales = rng.uniform(-0.02, 0.02, blocks.shape[:2] + (1,)).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1)).to(DEVICE)


def assert_within(got, x, weight, fmt, bias=None, relative=1e-5):
    """|got - exact| <= relative * sum_k |x_k w_nk| elementwise (exact: float64)."""
    w = gguf_reference.dequantize(weight.cpu(), fmt).double()
    x = x.cpu().double()
    exact = x @ w.T + (bias.cpu().double() if bias is not None else 0)
    bound = relative * (x.abs() @ w.abs().T) + 1e-6
    error = (got.cpu().double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"


@pytest.mark.parametrize("name", FORMATS)
def test_gemv_equals_the_dequantized_product(name):
    fmt = block_format(name)
    k = 2 * fmt.block_size if fmt.block_size == 256 else 8 * fmt.block_size
    weight = quantized(name, 37, k)  # 37 rows: not a multiple of any row block
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    several_tiles = triton_gguf_gemv.GemvConfig(block_n=4, block_k=64, splits=1, num_warps=4)
    split = triton_gguf_gemv.GemvConfig(block_n=8, block_k=64, splits=3, num_warps=4)
    for config in (None, several_tiles, split):
        got = triton_gguf_gemv.gemv(x, weight, fmt, config=config)
        assert got.shape == (1, 37) and got.dtype == torch.float32
        assert_within(got, x, weight, fmt)


WIDE = ["Q4_K", GATHERED]


@pytest.mark.parametrize("name", WIDE)
def test_wide_gemv_equals_the_dequantized_product(name):
    """Rows not a multiple of a program's (the last program's extra rows read the last row,
    unstored), K of three blocks in tiles of two and four (the last tile part empty), of one
    (K whole tiles, unmasked), and the chosen tiles; K of two blocks in one whole tile; a
    bias; 16-bit inputs."""
    fmt = block_format(name)
    weight, bias = quantized(name, 37, 3 * 256, seed=4), torch.randn(37).to(DEVICE)
    x = torch.randn(1, 3 * 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for config in (None, triton_gguf_wide.WideConfig(4, 2, 1, 1), triton_gguf_wide.WideConfig(8, 4, 2, 2),
                   triton_gguf_wide.WideConfig(2, 1, 1, 1)):
        got = triton_gguf_wide.gemv(x, weight, fmt, bias, config=config)
        assert got.shape == (1, 37) and got.dtype == torch.float32
        assert_within(got, x, weight, fmt, bias)
    even = quantized(name, 37, 2 * 256, seed=5)
    x_even = torch.randn(1, 2 * 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert_within(triton_gguf_wide.gemv(x_even, even, fmt, bias, config=triton_gguf_wide.WideConfig(4, 2, 1, 1)),
                  x_even, even, fmt, bias)
    for dtype in (torch.bfloat16, torch.float16):
        half = triton_gguf_wide.gemv(x.to(dtype), weight, fmt)
        assert half.dtype == dtype
        assert_within(half.float(), x.to(dtype).float(), weight, fmt, relative=2e-2)


@pytest.mark.parametrize("name", WIDE + ["Q8_0", "Q6_K"])
def test_one_row_of_a_wide_weight_goes_to_the_wide_gemv(name, monkeypatch):
    """From ``WIDE_ROWS`` rows (here made 16) a Q4_K or Q8_0_G8 weight's one-row product is
    the wide kernel's; a narrower one, or another format, the unit GEMV's."""
    monkeypatch.setattr(triton_gguf_wide, "WIDE_ROWS", 16)
    called = []
    monkeypatch.setattr(triton_gguf_wide, "_wide_kernel", _Recorded(triton_gguf_wide._wide_kernel, called))
    fmt = block_format(name)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for rows in (15, 16):
        weight = quantized(name, rows, 256, seed=rows)
        assert_within(triton_gguf_gemv.gemv(x, weight, fmt), x, weight, fmt)
    assert len(called) == (1 if name in WIDE else 0)


class _Recorded:
    """A kernel whose launches are counted."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def test_the_wide_gemv_refuses_what_it_cannot_read():
    q4k, weight = block_format("Q4_K"), quantized("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="one row of a Q4_K or Q8_0_G8 weight; got 2 rows of Q4_K"):
        triton_gguf_wide.gemv(torch.zeros(2, 256, device=DEVICE), weight, q4k)
    with pytest.raises(ValueError, match="one row of a Q4_K or Q8_0_G8 weight; got 1 rows of Q8_0"):
        triton_gguf_wide.gemv(torch.zeros(1, 256, device=DEVICE), quantized("Q8_0", 4, 256), block_format("Q8_0"))
    shifted = torch.zeros(4 * 144 + 2, dtype=torch.uint8, device=DEVICE)[2:].view(4, 144)
    with pytest.raises(ValueError, match="rows must start 16-byte aligned; got address"):
        triton_gguf_wide.gemv(torch.zeros(1, 256, device=DEVICE), shifted, q4k)
    assert not triton_gguf_wide.serves(shifted[:1].expand(1 << 14, 144), q4k)
    padded = torch.zeros(1 << 14, 146, dtype=torch.uint8)[:, :144]   # rows 146 bytes apart
    assert triton_gguf_wide.serves(torch.zeros(1 << 14, 144, dtype=torch.uint8), q4k)
    assert not triton_gguf_wide.serves(padded, q4k)
    with pytest.raises(ValueError, match="block_n and blocks must be powers of two; got 3 and 2"):
        triton_gguf_wide.gemv(torch.zeros(1, 256, device=DEVICE), weight, q4k, config=triton_gguf_wide.WideConfig(3, 2, 1, 1))


@pytest.mark.parametrize("name", FORMATS)
def test_matmul_equals_the_dequantized_product(name):
    fmt = block_format(name)
    k = 256 if fmt.block_size == 256 else 4 * fmt.block_size
    weight = quantized(name, 45, k, seed=2)
    split = triton_gguf_matmul.MatmulConfig(16, 16, 64 // fmt.group_size, 3, 4, 2)
    for m, config in ((3, None), (17, None), (17, split)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        got = triton_gguf_matmul.matmul(x, weight, fmt, config=config)
        assert got.shape == (m, 45) and got.dtype == torch.float32
        assert_within(got, x, weight, fmt)


@triton.jit
def _mantissa_floats(words_ptr, out_ptr, one_bits, FIRST: tl.constexpr, WIDTH: tl.constexpr):
    i = tl.arange(0, 64)
    tl.store(out_ptr + i, triton_gguf_dequant.mantissa_float(tl.load(words_ptr + i), FIRST, WIDTH, one_bits))


@FEW
@given(words=st.lists(st.integers(-2**31, 2**31 - 1), min_size=64, max_size=64))
def test_a_field_made_a_float_by_its_bits_is_one_plus_its_value_over_its_range(words):
    """Every field the kernels read so (nibbles, bytes, the top ones under a right shift that
    brings the sign bit along) is exactly ``1 + value / 2**width``."""
    w = torch.tensor(words, dtype=torch.int32, device=DEVICE)
    for width in (4, 8):
        for first in range(0, 32, width):
            out = torch.empty(64, dtype=torch.float32, device=DEVICE)
            _mantissa_floats[(1,)](w, out, triton_gguf_dequant.ONE_BITS, FIRST=first, WIDTH=width)
            value = (w.long() & 0xFFFFFFFF) >> first & ((1 << width) - 1)
            assert torch.equal(out.cpu(), 1 + value.cpu().double().float() / 2**width), (first, width)


@triton.jit
def _no_byte_head(base, s, mask):
    tl.static_assert(False, "a block head 4-byte aligned was read byte by byte")


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("offset", [0, 2])
def test_k_quant_heads_read_as_words_or_bytes(name, offset, monkeypatch):
    """A K-quant block's head is read as words where the rows start 4-byte aligned, byte by
    byte otherwise (a table viewed 2 bytes into its storage); the products and the rows
    gathered are the dequantized weight's either way. Under the interpreter an aligned
    table's kernels would fail on the byte reader (a compiled kernel keeps the reader it
    was built with)."""
    if offset == 0 and not torch.cuda.is_available():
        monkeypatch.setattr(triton_gguf_dequant, "k_scale_min", _no_byte_head)
    fmt = block_format(name)
    blocks = quantized(name, 19, 512, seed=5)
    storage = torch.empty(blocks.numel() + 4, dtype=torch.uint8, device=DEVICE)
    weight = storage[offset:offset + blocks.numel()].view(blocks.shape)
    weight.copy_(blocks)
    assert triton_gguf_dequant.reads_words(weight, fmt) == (offset == 0)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert_within(triton_gguf_matmul.matmul(x, weight, fmt), x, weight, fmt)
    table = gguf_reference.dequantize(weight, fmt)
    exact = dict(rtol=2**-20, atol=2**-20 * float(table.abs().max()))
    torch.testing.assert_close(triton_gguf_embedding.dequantize(weight, fmt, torch.float32), table, **exact)


@FEW
@given(name=st.sampled_from(FORMATS), m=st.integers(1, 40), rows=st.integers(1, 70),
       blocks=st.integers(1, 3), block_m=st.sampled_from([16, 32]), splits=st.integers(1, 3))
def test_linear_on_odd_shapes(name, m, rows, blocks, block_m, splits):
    """``linear`` (one row: the gemv; more: tiles), and the tiles forced small so that
    several row and column tiles and bands meet the edges, with K split (a split may get
    less than the others, or nothing), with a bias."""
    fmt = block_format(name)
    k = blocks * fmt.block_size  # 32, 64, 96 or 256, 512, 768
    weight, gen = quantized(name, rows, k, seed=rows), torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=gen).to(DEVICE), torch.randn(rows, generator=gen).to(DEVICE)
    assert_within(triton_gguf_matmul.linear(x, weight, fmt, bias), x, weight, fmt, bias)
    tiles = triton_gguf_matmul.MatmulConfig(block_m, 16, max(1, 32 // fmt.group_size), splits, 4, 2)
    assert_within(triton_gguf_matmul.matmul(x, weight, fmt, bias, config=tiles), x, weight, fmt, bias)


@FEW
@given(m=st.integers(2, 40), rows=st.integers(1, 70), blocks=st.integers(1, 3), chunks=st.sampled_from([1, 2, 4]),
       splits=st.integers(1, 3), offset=st.sampled_from([0, 2]))
def test_q4_k_tiles_read_as_byte_pairs(m, rows, blocks, chunks, splits, offset):
    """A Q4_K tile read as whole chunks of byte pairs (``pairs``), its input in the same
    order: the product is the dequantized weight's, with K split, at the edges of rows and
    columns, its block heads read as words or (rows 2 bytes off) byte by byte."""
    fmt, k = block_format("Q4_K"), blocks * 256
    stored = quantized("Q4_K", rows, k, seed=rows)
    storage = torch.empty(stored.numel() + 4, dtype=torch.uint8, device=DEVICE)
    weight = storage[offset:offset + stored.numel()].view(stored.shape)
    weight.copy_(stored)
    gen = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=gen).to(DEVICE), torch.randn(rows, generator=gen).to(DEVICE)
    pairs = triton_gguf_matmul.MatmulConfig(16, 16, 2 * chunks, splits, 4, 2, pairs=True)
    assert_within(triton_gguf_matmul.matmul(x, weight, fmt, bias, config=pairs), x, weight, fmt, bias)


def test_byte_pairs_take_whole_chunks_of_q4_k():
    """Refused: a tile of half a chunk, a tile longer than K (read unmasked, it would run
    past the row), another format."""
    pairs = lambda groups: triton_gguf_matmul.MatmulConfig(16, 16, groups, 1, 4, 2, pairs=True)
    for name, k, groups in (("Q4_K", 256, 1), ("Q4_K", 256, 16), ("Q8_0", 256, 2)):
        fmt = block_format(name)
        with pytest.raises(ValueError, match=f"got {name}, tiles of {groups * fmt.group_size} and K {k}"):
            triton_gguf_matmul.matmul(torch.zeros(2, k, device=DEVICE), quantized(name, 4, k, seed=1), fmt,
                                      config=pairs(groups))


@pytest.mark.parametrize("name", FORMATS)
def test_tiles_read_a_decode_batchs_weight_once_and_fill_the_gpu(name):
    """The 1B model's down projection on an H200's 132 SMs: up to 64 rows are one row
    tile (a Q4_K tile read as byte pairs); every batch, and one row of any projection, gets
    at least a program an SM (K split where tiles alone do not)."""
    fmt, sms = block_format(name), 132
    for m in (2, 7, 16, 17, 33, 64, 65, 128, 300, 2048):
        c = triton_gguf_matmul.choose_config(m, 2048, 8192, fmt, sms)
        assert m > triton_gguf_matmul.SKINNY_M or c.block_m >= m
        assert c.pairs == (name == "Q4_K" and m <= triton_gguf_matmul.SKINNY_M)  # a prefill reads elements
        tiles = -(-m // c.block_m) * -(-2048 // c.block_n)
        assert tiles * c.splits >= sms and (c.groups * fmt.group_size) in (64, 128)
    for n, k in ((2048, 8192), (512, 2048), (128256, 2048)):  # one row
        c = triton_gguf_gemv.choose_config(n, k, fmt, sms)
        assert -(-n // c.block_n) * c.splits >= sms
    short, long = (triton_gguf_gemv.choose_config(2048, k, fmt, sms) for k in (2048, 8192))
    assert (short.num_warps, long.num_warps) == (2, 4)  # a long loop waits on memory at every tile
    for m, (n, k) in itertools.product((2, 8, 32), ((3072, 2048), (16384, 2048), (2048, 8192))):
        c = triton_gguf_matmul.choose_config(m, n, k, fmt, sms)  # split to at most four programs an SM
        assert c.splits > 1 and sms <= -(-n // c.block_n) * c.splits <= 4 * sms
    head = triton_gguf_matmul.choose_config(32, 128256, 2048, fmt, sms)
    assert head.splits == 1 and head.block_n == 128, head  # a vocabulary's columns fill the GPU alone


@pytest.mark.parametrize("name", ["Q8_0", "Q5_1", "Q4_K", "Q6_K", GATHERED])
def test_gemv_computes_its_normed_input(name):
    """As ``triton_gemv`` does for bf16 weights: rms_norm(x + residual) * norm weight (its
    sum written once), as the unfused ops compute it."""
    fmt, k, rows = block_format(name), 512, 13  # 13: not a multiple of any row block
    weight, gen = quantized(name, rows, k, seed=5), torch.Generator().manual_seed(5)
    x, residual, norm_weight, bias = (torch.randn(shape, generator=gen).to(DEVICE)
                                      for shape in ((1, k), (1, k), (k,), (rows,)))
    several_tiles = triton_gguf_gemv.GemvConfig(4, 128, 1, 4)
    split = triton_gguf_gemv.GemvConfig(4, 128, 3, 4)
    for config in (None, several_tiles, split):
        for res in (None, residual):
            out, total = triton_gguf_gemv.norm_gemv(x, res, norm_weight, 1e-5, weight, fmt, config=config)
            normed = reference.rms_norm(x if res is None else x + res, norm_weight, 1e-5)
            assert_within(out, normed, weight, fmt)
            assert total is None if res is None else torch.equal(total, x + res)
    expected = gguf_reference.norm_linear(x, residual, norm_weight, 1e-5, weight, fmt, bias)
    got = triton_gguf_gemv.norm_gemv(x, residual, norm_weight, 1e-5, weight, fmt, bias)
    assert_within(got[0], reference.rms_norm(x + residual, norm_weight, 1e-5), weight, fmt, bias)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", GATHERED])
def test_16_bit_inputs(name, dtype):
    """The interpreter's bf16 ``tl.dot`` is wrong (the products of bf16 tiles it loads
    itself come out ~1e10), so bf16 reaches the tensor-core kernel only on a GPU."""
    fmt = block_format(name)
    weight = quantized(name, 20, 256, seed=3)
    for m in (1, 17) if DEVICE == "cuda" or dtype != torch.bfloat16 else (1,):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        got = triton_gguf_matmul.linear(x, weight, fmt)
        assert got.dtype == dtype
        assert_within(got.float(), x.float(), weight, fmt, relative=2e-2)


@pytest.mark.parametrize("name", FORMATS)
def test_embedding_gathers_dequantized_rows(name):
    fmt = block_format(name)
    k = 512 if fmt.block_size == 256 else 96
    weight = quantized(name, 11, k, seed=4)
    table = gguf_reference.dequantize(weight, fmt)
    ids = torch.tensor([3, 0, 10, 3, 7], device=DEVICE)
    exact = dict(rtol=2**-20, atol=2**-20 * float(table.abs().max()))  # a GPU may fuse d * q + m
    got = triton_gguf_embedding.embedding(ids, weight, fmt, torch.float32)
    torch.testing.assert_close(got, gguf_reference.embedding(ids, weight, fmt, torch.float32), **exact)
    got = triton_gguf_embedding.embedding(ids.int(), weight, fmt, torch.bfloat16)
    # within one bf16 step: the interpreter rounds fp32 to bf16 toward zero, a GPU to nearest
    torch.testing.assert_close(got.float(), table[ids], rtol=2**-7, atol=0)
    torch.testing.assert_close(triton_gguf_embedding.dequantize(weight, fmt, torch.float32), table, **exact)


def test_layouts_are_the_gguf_packages():
    for qtype in SUPPORTED:
        fmt = block_format(qtype)
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[qtype]
        assert fmt.block_size % fmt.group_size == 0
        assert (7, fmt.row_bytes(512)) == gguf.quants.quant_shape_to_byte_shape((7, 512), qtype)
    assert block_format("Q6_K") == block_format(14) == block_format(gguf.GGMLQuantizationType.Q6_K)
    assert Q8_0_BLOCK_BYTES == GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][1]


@FEW
@given(rows=st.integers(0, 5), runs=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gathered_q8_0_holds_every_byte_of_its_blocks(rows, runs, seed):
    """Q8_0_G8 moves bytes only: its rows scatter back to the Q8_0 rows, each run starts
    with its eight blocks' scales, and each block's 32 quants follow at 16-byte offsets."""
    blocks = torch.randint(0, 256, (rows, runs * 272), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    gathered = gather_scales(blocks)
    assert torch.equal(scatter_scales(gathered), blocks)
    q8, run = blocks.view(rows, runs, 8, 34), gathered.view(rows, runs, 272)
    assert torch.equal(run[..., :16].unflatten(2, (8, 2)), q8[..., :2])
    for b in range(8):
        assert torch.equal(run[..., 16 + 32 * b: 48 + 32 * b], q8[:, :, b, 2:])
    fmt = block_format(GATHERED)
    assert (fmt.block_size, fmt.type_size, fmt.group_size, fmt.name) == (256, 272, 32, GATHERED)
    with pytest.raises(ValueError, match="whole runs of 272 bytes"):
        gather_scales(blocks[:, :34])


def test_bad_calls_are_named():
    q4k = block_format("Q4_K")
    with pytest.raises(ValueError, match="GGUF type Q2_K has no kernel; supported: Q8_0, Q4_0"):
        block_format("Q2_K")
    with pytest.raises(ValueError, match="unknown GGUF type 'Q9'"):
        block_format("Q9")
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 256 elements; got 100"):
        q4k.row_bytes(100)
    weight = quantized("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 144 bytes; got 100"):
        triton_gguf_gemv.gemv(torch.zeros(1, 256), weight[:, :100], q4k)
    odd = torch.zeros(4 * 144 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(4, 144)
    with pytest.raises(ValueError, match="Q4_K weight's rows must start at even addresses"):
        triton_gguf_matmul.linear(torch.zeros(1, 256, device=DEVICE), odd, q4k)
    with pytest.raises(ValueError, match=r"x must be \[1, 256\] for a Q4_K weight of 256 columns; got \(1, 255\)"):
        triton_gguf_matmul.linear(torch.zeros(1, 255), weight, q4k)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\] for a Q4_K weight of 256 columns; got \(3, 255\)"):
        triton_gguf_matmul.linear(torch.zeros(3, 255), weight, q4k)
    with pytest.raises(ValueError, match="x must be bfloat16, float16 or float32; got torch.int64"):
        triton_gguf_matmul.matmul(torch.zeros(2, 256, dtype=torch.long), weight, q4k)
    with pytest.raises(ValueError, match=r"must be uint8 \[N, row_bytes\]; got torch.float32"):
        triton_gguf_matmul.matmul(torch.zeros(2, 256), weight.float(), q4k)
    with pytest.raises(ValueError, match=r"bias must be \[4\]; got \(5,\)"):
        triton_gguf_matmul.linear(torch.zeros(1, 256), weight, q4k, torch.zeros(5))
    with pytest.raises(ValueError, match=r"norm weight must be \[256\]; got \(255,\)"):
        triton_gguf_gemv.norm_gemv(torch.zeros(1, 256), None, torch.zeros(255), 1e-5, weight, q4k)
    with pytest.raises(ValueError, match=r"x must be \[1, 256\] for a Q4_K weight of 256 columns; got \(2, 256\)"):
        triton_gguf_gemv.gemv(torch.zeros(2, 256), weight, q4k)
    with pytest.raises(ValueError, match=r"x must be one row \[1, 256\]; got \(2, 256\)"):
        triton_gguf_gemv.norm_gemv(torch.zeros(2, 256), None, torch.zeros(256), 1e-5, weight, q4k)
    with pytest.raises(ValueError, match="block_k must be a power of two of at least 64; got 96"):
        triton_gguf_gemv.gemv(torch.zeros(1, 256, device=DEVICE), weight, q4k,
                              config=triton_gguf_gemv.GemvConfig(1, 96, 1, 1))
    tiles = triton_gguf_matmul.MatmulConfig
    for config, message in ((tiles(16, 24, 2, 1, 4, 2), "block_n must be a power of two; got 24"),
                            (tiles(16, 16, 6, 1, 4, 2, pairs=True), r"K tile \(.*\) must be a power of two; got 192")):
        with pytest.raises(ValueError, match=message):
            triton_gguf_matmul.matmul(torch.zeros(2, 768, device=DEVICE), quantized("Q4_K", 4, 768), q4k,
                                      config=config)
    with pytest.raises(ValueError, match=r"ids must be int32 or int64 \[T\]; got torch.float32"):
        triton_gguf_embedding.embedding(torch.zeros(3), weight, q4k, torch.float32)


def test_the_benchmark_runs_tiny(tmp_path, monkeypatch, capsys):
    from benchmarks import gguf_gemv
    out = tmp_path / "gguf.json"
    monkeypatch.setattr(sys, "argv", ["gguf_gemv", "--tiny", "--rows", "1", "2", "--formats", "Q4_K",
                                      "--json", str(out)])
    gguf_gemv.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["rows"]) for r in rows] == [
        ("torch float32", 1), ("triton_gemv float32", 1), ("Q4_K", 1),
        ("torch float32", 2), ("triton_gemv float32", 2), ("Q4_K", 2)]
    assert "GGUF linear kernels" in capsys.readouterr().out


@pytest.mark.parametrize("name", FORMATS)
def test_the_sweep_times_the_chosen_configs(name):
    """``--sweep`` compares the engine's own choice with the others: for every row count
    of a decode step and every projection of the 1B shape, the chosen config is one of the
    sweep's candidates (on an H100's 132 SMs)."""
    from benchmarks import gguf_gemv
    fmt = block_format(name)
    for m, shape in itertools.product((1, 2, 8, 32, 64), gguf_gemv.PROJECTIONS.values()):
        wide = m == 1 and triton_gguf_wide.serves(torch.empty(shape[0], fmt.row_bytes(shape[1]), dtype=torch.uint8,
                                                               device="meta"), fmt)
        chosen = triton_gguf_wide.choose_config(*shape, fmt) if wide else \
            triton_gguf_gemv.choose_config(*shape, fmt, 132) if m == 1 else \
            triton_gguf_matmul.choose_config(m, *shape, fmt, 132)
        assert chosen in gguf_gemv.candidates(fmt, m, shape, 132), (m, shape, chosen)
        assert wide == (m == 1 and name in WIDE and shape[0] >= 8192)
        if 1 < m <= triton_gguf_matmul.SKINNY_M:  # and a Q4_K tile read as byte pairs
            pairs = attrs.evolve(chosen, pairs=True)
            assert (pairs in gguf_gemv.candidates(fmt, m, shape, 132)) == (name == "Q4_K"), (m, shape)


def test_model_linears_count_every_layer_and_the_head_once():
    from benchmarks import gguf_gemv
    timed = {("qkv", "chosen"): 3.0, ("qkv", "(a)"): 2.0, ("head", "chosen"): 50.0, ("head", "(b)"): 60.0}
    rows = [{"format": "Q4_K", "rows": 1, "projection": p, "config": c, "us": us} for (p, c), us in timed.items()]
    rows.append({"format": "torch bfloat16", "rows": 1, "projection": "qkv", "us": 1.0})  # not swept
    assert gguf_gemv.model_linears(rows, ["qkv", "head"], 16) == [
        {"format": "Q4_K", "rows": 1, "chosen_ms": (16 * 3.0 + 50.0) / 1e3, "best_ms": (16 * 2.0 + 50.0) / 1e3}]


SM90 = """
import re, sys
import triton
from sm90 import compile_sm90
from tokenspeed.backends.kernels import triton_gguf_embedding as e, triton_gguf_gemv as v, triton_gguf_matmul as m
from tokenspeed.backends.kernels import triton_gguf_units as d, triton_gguf_wide as w
from tokenspeed.backends.kernels.gguf_blocks import block_format

def check(fmt):
    common = dict(FORMAT=fmt.code, TYPE_SIZE=fmt.type_size, USE_PDL=True)
    group = dict(GROUP=fmt.group_size, **common)
    one_row = v.choose_config(2048, 8192, fmt, 132)
    for norm in (False, True):
        gemv = compile_sm90(v._gemv_kernel, dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", total_ptr="*bf16",
                            w_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16", N="i32", K="i32", k_per_split="i32",
                            stride_wn="i32", stride_os="i32", eps="fp32"),
                            dict(HAS_BIAS=True, NORM=norm, HAS_RES=norm, BLOCK_N=one_row.block_n,
                                 BLOCK_K=one_row.block_k, WIDTH=d.unit_width(fmt), GAP=d.unit_gap(fmt),
                                 **common), one_row.num_warps)
        assert "griddepcontrol.wait" in gemv.asm["ptx"]
        if fmt.name in ("Q4_K", "Q5_K", "Q8_0_G8"):  # 16-byte aligned quants: read 16 bytes a load
            assert "ld.global.v4.b32" in gemv.asm["ptx"], re.findall(r"ld\\.global[.\\w]*", gemv.asm["ptx"])
    tiles = [(rows, False) for rows in (16, 128, 2048)]  # the tiles of a decode batch, a small batch, a prefill
    for rows, pairs in tiles + ([(32, True), (2048, True)] if fmt.name == "Q4_K" else []):  # Q4_K's byte pairs too
        c = m.choose_config(rows, 2048, 8192, fmt, 132)
        mm = compile_sm90(m._matmul_kernel, dict(x_ptr="*bf16", w_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16",
                          M="i32", N="i32", K="i32", k_per_split="i32", stride_xm="i32", stride_wn="i32",
                          stride_os="i32", stride_om="i32", one_bits="i32"),
                          dict(HAS_BIAS=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, GROUPS=c.groups, BAND_M=8,
                               PRECISION="tf32", WORDS=fmt.name in ("Q4_K", "Q5_K"), PAIRS=pairs, **group),
                          c.num_warps)
        assert "mma" in mm.asm["ptx"], "tensor cores"
        if fmt.name in ("Q4_K", "Q5_K"):  # the block's head read as words, so every load is pipelined
            assert "ld.global.b8" not in mm.asm["ptx"] and "cp.async" in mm.asm["ptx"]
        if pairs:  # byte pairs as words: nibbles become floats by their bits, only the scales converted
            elements = c.block_n * c.groups * fmt.group_size // (32 * c.num_warps)
            assert len(re.findall(r"cvt\\.rn\\.f32\\.[su]", mm.asm["ptx"])) < elements // 4
    if fmt.name in ("Q4_K", "Q8_0_G8"):
        span = 64 if fmt.gathered else 32  # words of quants a block
        for rows in (16384, 128256):  # a gate/up, a head
            c = w.choose_config(rows, 2048, fmt)
            wide = compile_sm90(w._wide_kernel, dict(x_ptr="*bf16", w_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16",
                                N="i32", K="i32", stride_wn="i32", one_bits="i32"),
                                dict(HAS_BIAS=False, SPAN=span, BLOCK_N=c.block_n, BLOCKS=c.blocks, EVEN_K=True, **common),
                                c.num_warps, c.num_stages)
            ptx = wide.asm["ptx"]
            quant_loads = 2 * c.block_n * c.blocks * span * 4 // (16 * 32 * c.num_warps)  # 16 bytes a thread, twice
            assert "griddepcontrol.wait" in ptx and ptx.count("ld.global.v4.b32") >= quant_loads, \
                (quant_loads, sorted(set(re.findall(r"ld\\.global[.\\w]*", ptx))))
            # quants become floats by their bits: the integer conversions left are the scales'
            elements = 2 * c.block_n * c.blocks * 256 // (32 * c.num_warps)
            assert len(re.findall(r"cvt\\.rn\\.f32\\.[su]", ptx)) < elements // 8, fmt.name
    emb = compile_sm90(e._embedding_kernel, dict(ids_ptr="*i64", w_ptr="*u8", out_ptr="*bf16", K="i32", vocab="i32",
                       stride_wn="i32", stride_out="i32"),
                       dict(GROUPS=1024 // fmt.group_size, WORDS=fmt.name in ("Q4_K", "Q5_K"), **group))
    assert "griddepcontrol.wait" in emb.asm["ptx"]

for name in sys.argv[1:]:   # every format in one child: one start of torch and Triton
    check(block_format(name))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU tests compile for real")
def test_the_kernels_compile_for_sm90():
    """As tests/test_kernel_compile.py does for the others: in a child, without the
    interpreter (here with the alignment a launch specializes, which decides the loads);
    a failure's traceback names the format."""
    assert_compiles(["-c", SM90, *FORMATS])
