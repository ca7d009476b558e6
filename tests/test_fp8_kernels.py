"""The FP8 weight kernels (decode GEMV, block-scaled FP8 matmul, per-token activation
quantizer, ``torch._scaled_mm`` path) against ``fp8_weights``' torch reference, under the
Triton interpreter on CPU (for real on a GPU), for both scale layouts: one per output
channel, and one per 128 x 128 tile.

Shapes are small and odd: N not a multiple of 128 (a partial block row) nor of a
program's rows, K a multiple of 16 but not of 128 (a partial block column), M of 1, 3,
16, 17 and past 64.

Tolerances: the GEMV multiplies x by the FP8 weight in fp32, so each output is within
``1e-5 * sum_k |x_k w_nk|`` of the float64 product (another summation order). The FP8
matmuls multiply quantized activations: against the product of the reference's
quantized activations they are within the same fp32 bound; against x itself within
``2^-4 * sum_k |x_k w_nk|`` (e4m3 keeps 3 mantissa bits: each activation moves by at
most 2^-4 of itself, or an absolute 2^-10 of its scale below the normal range).
Activation quantization is bit-exact: the kernel rounds in fp32 before converting, so
the interpreter's conversion (which mis-rounds values whose rounding carries into the
next exponent) and a GPU's agree with torch's.
"""

import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

from tokenspeed.backends.kernels import fp8_matmul, fp8_weights, reference  # noqa: E402
from tokenspeed.backends.kernels import triton_fp8_block_matmul, triton_fp8_gemv, triton_fp8_quantize  # noqa: E402
from tokenspeed.backends.kernels.fp8_weights import FP8  # noqa: E402

from fp8_cases import (DEVICE, K, N, TENSOR_CORE_RELATIVE, assert_within, fp8_weight,  # noqa: E402
                       quantized_rows, rand)

LAYOUTS = ["channel", "block"]
FEW = settings(max_examples=6, deadline=None, derandomize=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemv_equals_the_dequantized_product(layout):
    """One row, several K tiles (the last partial), K split, a column block straddling
    the block rows; 3 and 16 rows through ``tl.dot``; with and without a bias."""
    weight, scale = fp8_weight(layout)
    w, bias = fp8_weights.dequantize(weight, scale), rand(N, seed=2)
    tiles, split = triton_fp8_gemv.GemvConfig(16, 64, 1, 4, 1), triton_fp8_gemv.GemvConfig(16, 128, 2, 4, 1)
    for m, configs in ((1, (tiles, split)), (3, (None,)), (16, (split,))):
        x = rand(m, K, seed=m)
        for config in configs:
            got = triton_fp8_gemv.linear(x, weight, scale, bias, config=config)
            assert got.shape == (m, N) and got.dtype == torch.float32
            assert_within(got, x, w, bias)
    small, small_scale = fp8_weight(layout, n=37, seed=3)  # the chosen config, one row
    x = rand(1, K, seed=4)
    assert_within(triton_fp8_gemv.linear(x, small, small_scale), x, fp8_weights.dequantize(small, small_scale))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernels_compute_their_gated_input(layout):
    """silu(gate) * up of ``[M, 2K]`` rows, as the unfused activation computes it: read by
    the GEMV, or quantized by the matmuls' activation quantizer."""
    n = 160 if layout == "channel" else N  # torch._scaled_mm needs N % 16 == 0
    weight, scale = fp8_weight(layout, n=n, seed=5)
    w = fp8_weights.dequantize(weight, scale)
    for m, config in ((1, triton_fp8_gemv.GemvConfig(16, 64, 2, 4, 1)), (3, None)):
        gate_up = rand(m, 2 * K, seed=6)
        got = triton_fp8_gemv.linear(gate_up, weight, scale, gated=True, config=config)
        assert_within(got, reference.silu_and_mul(gate_up), w)
    gate_up = rand(17, 2 * K, seed=7)
    got = fp8_matmul.linear(gate_up, weight, scale, gated=True)
    assert_within(got, reference.silu_and_mul(gate_up), w, relative=2**-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "alone"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_norms_its_one_row_as_the_norm_kernel_does(layout, residual, dtype):
    """``norm_linear``: rms_norm(x + residual) * weight read by the GEMV, over several K
    tiles and a split K (the statistics of the whole row in every program), equals the
    norm's reference then the GEMV, and the sum comes out to the bit; in bfloat16 (on the
    CPU the interpreter truncates where torch rounds to nearest) within a step of each
    rounding: the sum's, and the normed input's twice."""
    weight, scale = fp8_weight(layout, seed=8)
    w = fp8_weights.dequantize(weight, scale)
    x, res, norm_weight = (t.to(dtype) for t in (rand(1, K, seed=9), rand(1, K, seed=10), rand(K, seed=11) + 1.5))
    res = res if residual else None
    normed, *total = [reference.rms_norm(x, norm_weight, 1e-6)] if res is None else \
        reference.add_rms_norm(x, res, norm_weight, 1e-6)
    exact = dtype == torch.float32 or x.is_cuda
    for config in (triton_fp8_gemv.GemvConfig(16, 64, 1, 4, 1), triton_fp8_gemv.GemvConfig(16, 64, 2, 4, 1), None):
        got, got_total = triton_fp8_gemv.norm_linear(x, res, norm_weight, 1e-6, weight, scale, config=config)
        assert got.dtype == dtype and (got_total is None) == (res is None)
        assert_within(got.float(), normed.float(), w, relative=1e-5 if dtype == torch.float32 else 2 ** -5)
        if res is not None:
            assert torch.equal(got_total, total[0]) if exact else \
                torch.allclose(got_total.float(), total[0].float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matmul_equals_the_product_of_quantized_rows(layout):
    """``fp8_matmul.linear`` (``torch._scaled_mm`` per channel, the Triton kernel for
    blocks) for a skinny batch and one past ``SKINNY_M``, with K split, with a bias."""
    n = 160 if layout == "channel" else N  # torch._scaled_mm needs N % 16 == 0
    weight, scale = fp8_weight(layout, n=n, seed=7)
    w, bias = fp8_weights.dequantize(weight, scale), rand(n, seed=8)
    group = fp8_weights.BLOCK if layout == "block" else None
    for m in (17, 70):
        x = rand(m, K, seed=m)
        got = fp8_matmul.linear(x, weight, scale, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert_within(got, quantized_rows(x, group), w, bias, TENSOR_CORE_RELATIVE)
        assert_within(got, x, w, bias, relative=2**-4)
    if layout == "block":
        x = rand(17, K, seed=9)
        split = triton_fp8_block_matmul.MatmulConfig(16, 32, 2, 4, 2)
        got = triton_fp8_block_matmul.linear(x, weight, scale, bias, config=split)
        assert_within(got, quantized_rows(x, group), w, bias, TENSOR_CORE_RELATIVE)


@settings(max_examples=9, deadline=None, derandomize=True)
@given(kernel=st.sampled_from(["gemv channel", "gemv block", "block", "scaled_mm"]),
       rows=st.integers(1, 16), n=st.integers(1, 10).map(lambda c: 16 * c),
       k=st.integers(1, 18).map(lambda c: 16 * c), block_n=st.sampled_from([16, 32]),
       block_k=st.sampled_from([16, 64, 128]), splits=st.integers(1, 3), with_bias=st.booleans())
def test_linear_on_odd_shapes(kernel, rows, n, k, block_n, block_k, splits, with_bias):
    """Every kernel with its tiles forced small, so that row and column tiles, block rows
    and K splits (one may get less than the others, or nothing) meet the edges: the GEMV
    up to 16 rows, the block matmul and ``torch._scaled_mm`` (whose N stays a multiple of
    16) from 17."""
    n = n if kernel == "scaled_mm" else n - 3
    m = rows if kernel.startswith("gemv") else rows + 16
    weight, scale = fp8_weight("block" if "block" in kernel else "channel", n=n, k=k, seed=n + k)
    w, x = fp8_weights.dequantize(weight, scale), rand(m, k, seed=m)
    bias = rand(n, seed=k) if with_bias else None
    if kernel.startswith("gemv"):
        config = triton_fp8_gemv.GemvConfig(block_n // (16 if m == 1 else 1), block_k, splits, 4, 1)
        assert_within(triton_fp8_gemv.linear(x, weight, scale, bias, config=config), x, w, bias)
    elif kernel == "block":
        config = triton_fp8_block_matmul.MatmulConfig(16, block_n, splits, 4, 1)
        got = triton_fp8_block_matmul.linear(x, weight, scale, bias, config=config)
        assert_within(got, quantized_rows(x, fp8_weights.BLOCK), w, bias, TENSOR_CORE_RELATIVE)
    else:
        got = fp8_matmul.linear(x, weight, scale, bias)
        assert_within(got, quantized_rows(x), w, bias, TENSOR_CORE_RELATIVE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs(dtype):
    """Outputs in x's dtype: the fused bias of ``torch._scaled_mm``, the GEMV's rounding.
    The interpreter's 16-bit ``tl.dot`` is wrong (see tests/test_gguf_kernels.py), so
    the GEMV's several-row path and the block matmul take 16 bits only on a GPU."""
    weight, scale = fp8_weight("channel", n=48, seed=10)
    w, bias = fp8_weights.dequantize(weight, scale), rand(48, seed=11).to(dtype)
    x = rand(17, K, seed=12).to(dtype)
    got = fp8_matmul.linear(x, weight, scale, bias)
    assert got.dtype == dtype
    assert_within(got.float(), quantized_rows(x), w, bias.float(), relative=2e-2)
    one = x[:1]
    got = triton_fp8_gemv.linear(one, weight, scale, bias)
    assert got.dtype == dtype
    assert_within(got.float(), one.float(), w, bias.float(), relative=2e-2)


def test_activation_quantizer_equals_the_reference_bit_for_bit():
    """Per token and per 128 columns, rows of 1-17, a zero row (its scale from
    ``MIN_AMAX``), negative zeros, and values whose rounding carries into the next
    exponent (7.79 -> 8.0, where the interpreter's own conversion gives 4.0)."""
    x = rand(17, 300, seed=13) * 5
    x[3] = 0.0
    x[4, :8] = torch.tensor([448.0, 7.79, -7.79, 3.97, -0.0, 1e-4, -1e-4, 0.0147])
    for rows, group in ((1, None), (17, None), (3, 128), (17, 128), (17, 100)):
        got_q, got_scale = triton_fp8_quantize.quantize_activations(x[:rows], group)
        want_q, want_scale = fp8_weights.quantize_activation_groups(x[:rows], group)
        assert torch.equal(got_scale, want_scale)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert triton_fp8_quantize.quantize_activations(x[4:5])[0][0, 1].float() == 8.0
    assert fp8_weights.quantize_activations(x)[1].shape == (17, 1)


@pytest.mark.parametrize("k", [300, 2100], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "alone"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_norms_its_rows_as_the_norm_kernel_does(k, residual, dtype):
    """``quantize_normed``: rms_norm(x + residual) * weight quantized per row in one launch
    equals the norm's reference then the quantizer's, for 19 rows (a zero row among them)
    over one tile of columns and over two. Only 1/rms may round differently (another
    summation order), so every quantized value is within an e4m3 step of the reference's
    normed row, and in fp32 nearly all codes are the reference's own; the sum comes out to
    the bit (in bfloat16 on the CPU, whose interpreter truncates, within a rounding)."""
    x, res, norm_weight = (t.to(dtype) for t in (rand(19, k, seed=21) * 3, rand(19, k, seed=22), rand(k, seed=23)))
    x[5] = 0.0
    res = res if residual else None
    if res is not None:
        res[5] = 0.0
    normed, *total = [reference.rms_norm(x, norm_weight, 1e-6)] if res is None else \
        reference.add_rms_norm(x, res, norm_weight, 1e-6)
    q, scale, got_total = triton_fp8_quantize.quantize_normed(x, res, norm_weight, 1e-6)
    assert q.dtype == FP8 and scale.shape == (19, 1) and (got_total is None) == (res is None)
    want_q, want_scale = fp8_weights.quantize_activation_groups(normed.float(), None)
    torch.testing.assert_close(scale, want_scale, rtol=2 ** -6, atol=0)
    step = 2 ** -3 * normed.float().abs() + 2 ** -9 * scale  # e4m3 keeps 3 bits
    assert ((q.float() * scale - normed.float()).abs() <= step).all()
    if dtype == torch.float32:
        assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 0.01
    if res is not None:
        exact = dtype == torch.float32 or x.is_cuda
        assert torch.equal(got_total, total[0]) if exact else \
            torch.allclose(got_total.float(), total[0].float(), rtol=2 ** -7, atol=0)


def test_a_batch_past_the_gemv_norms_and_quantizes_in_one_launch(monkeypatch):
    """``cuda.norm_linear`` of a per-channel FP8 weight past ``GEMV_MAX_ROWS`` rows runs no
    norm kernel of its own: its rows are normed as they are quantized (block-scaled weights,
    and a single row of a large weight, still take the norm's kernel)."""
    from tokenspeed.backends.kernels import cuda, triton_fused
    launched = []
    for name in ("rms_norm", "add_rms_norm"):
        kernel = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *a, _k=kernel, _n=name: launched.append(_n) or _k(*a))
    x, residual, norm_weight = rand(20, 256, seed=1), rand(20, 256, seed=2), rand(256, seed=3)
    for layout, rows, want in (("channel", 20, []), ("block", 20, ["add_rms_norm"])):
        weight, scale = fp8_weight(layout, n=160, k=256, seed=4)
        launched.clear()
        out, total = cuda.norm_linear(x[:rows], residual[:rows], norm_weight, 1e-6, weight, None, "fp8_e4m3", scale)
        assert launched == want and out.shape == (rows, 160)
        torch.testing.assert_close(total, x[:rows] + residual[:rows])


def test_the_kernels_rounding_is_torchs_over_the_whole_range():
    """Every e4m3 step from the subnormals to 448, each value's neighbourhood and the
    midpoints (ties to even), with a row maximum of 448 so that the scale is 1."""
    grid = torch.linspace(-448.0, 448.0, 6001)
    tiny = torch.linspace(-0.03, 0.03, 3001)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    codes = codes[torch.isfinite(codes)]
    values = torch.cat([grid, tiny, codes, codes * (1 + 2**-5), codes * (1 - 2**-5)])
    row = torch.cat([torch.tensor([448.0]), values.clamp(-448, 448)])[None, :].to(DEVICE)
    q, scale = triton_fp8_quantize.quantize_activations(row)
    assert scale.item() == 1.0
    assert torch.equal(q.view(torch.uint8), row.to(FP8).view(torch.uint8))


@FEW
@given(rows=st.integers(1, 6), k=st.integers(1, 40).map(lambda c: 16 * c),
       zero_row=st.booleans(), magnitude=st.sampled_from([1e-3, 1.0, 1e4]))
def test_per_channel_quantization_round_trips(rows, k, zero_row, magnitude):
    """Each row's largest magnitude becomes 448 (scale 1 for a zero row), and every value
    comes back within half an e4m3 step: 2^-4 of itself, or 2^-10 of its row's scale."""
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * magnitude
    if zero_row:
        w[0] = 0.0
    q, scale = fp8_weights.quantize_per_channel(w)
    assert q.dtype == FP8 and scale.shape == (rows,)
    amax = q.float().abs().amax(1)
    assert torch.equal(amax[w.abs().amax(1) > 0], torch.full_like(amax, 448.0)[w.abs().amax(1) > 0])
    if zero_row:
        assert scale[0] == 1.0 and not q[0].float().any()
    error = (fp8_weights.dequantize(q, scale) - w).abs()
    assert (error <= 2**-4 * w.abs() + 2**-10 * scale[:, None]).all()


def test_block_dequantize_scales_each_tile():
    weight, scale = fp8_weight("block", seed=14)
    got = fp8_weights.dequantize(weight, scale)
    for i, j in ((0, 0), (1, 1), (1, 0), (0, 1)):  # the last tiles are partial (150 x 208)
        tile = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
        assert torch.equal(got[tile], weight[tile].float() * scale[i, j])
    assert fp8_weights.dequantize(weight, scale, torch.bfloat16).dtype == torch.bfloat16


def test_configs_fill_the_gpu_and_fit_block_scales():
    """On an H200's 132 SMs, for the 1B projections: every GEMV row count and every
    matmul batch keeps nearly every SM busy (K split where tiles alone do not; the bf16
    GEMV's 4 splits of the 32 column blocks of 2048 rows give 128 programs), a decode
    batch of up to 64 rows is one row tile, and each column block lies in one block row
    of a 128 x 128 scale."""
    sms = 132
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)):
        for m in (1, 2, 8, 16):
            c = triton_fp8_gemv.choose_config(m, n, k, sms)
            assert -(-n // c.block_n) * c.splits >= 0.95 * sms and 128 % c.block_n == 0
            assert m == 1 or 128 % c.block_k == 0
        for m in (17, 64, 65, 300, 2048):
            c = triton_fp8_block_matmul.choose_config(m, n, k, sms)
            assert m > triton_fp8_block_matmul.SKINNY_M or c.block_m >= m
            assert -(-m // c.block_m) * -(-n // c.block_n) * c.splits >= 0.95 * sms
            assert 128 % c.block_n == 0


def test_bad_calls_are_named():
    weight, scale = fp8_weight("channel", n=32, k=64)
    x = torch.zeros(1, 64, device=DEVICE)
    cases = [
        (lambda: triton_fp8_gemv.linear(x, weight.float(), scale),
         r"an FP8 weight must be float8_e4m3fn \[N, K\]; got torch.float32 \(32, 64\)"),
        (lambda: triton_fp8_gemv.linear(x, weight, scale[:31]),
         r"an FP8 weight \[32, 64\] needs a scale \[32\] \(per channel\) or \[1, 1\] \(128 x 128 blocks\); got \[31\]"),
        (lambda: triton_fp8_gemv.linear(x, weight, scale.double()),
         "an FP8 weight's scale must be float32; got torch.float64"),
        (lambda: triton_fp8_gemv.linear(x[:, :32], weight.t().contiguous().t()[:32, :32], scale),
         r"an FP8 weight must be contiguous \(row-major\)"),
        (lambda: triton_fp8_gemv.linear(x[:, :63], weight, scale),
         r"x must be \[M, 64\] for an FP8 weight of 64 columns; got \(1, 63\)"),
        (lambda: triton_fp8_gemv.linear(x.long(), weight, scale),
         "x must be bfloat16, float16 or float32; got torch.int64"),
        (lambda: triton_fp8_gemv.linear(x, weight, scale, torch.zeros(31, device=DEVICE)),
         r"bias must be \[32\]"),
        (lambda: triton_fp8_gemv.linear(x, weight, scale, gated=True),
         r"x must be \[M, 128\] \(gate, up\) for an FP8 weight of 64 columns; got \(1, 64\)"),
        (lambda: fp8_matmul.linear(torch.zeros(17, 64, device=DEVICE), weight, scale, gated=True),
         r"x must be \[M, 128\] \(gate, up\) for an FP8 weight of 64 columns; got \(17, 64\)"),
        (lambda: triton_fp8_quantize.quantize_activations(torch.zeros(2, 63), gated=True),
         r"activations to quantize must be bfloat16, float16 or float32 \[M, 2K\] \(gate, up\); got torch.float32 \(2, 63\)"),
        (lambda: triton_fp8_gemv.linear(torch.zeros(17, 64, device=DEVICE), weight, scale),
         "the FP8 GEMV takes at most 16 rows; got 17"),
        (lambda: triton_fp8_gemv.linear(x, weight, torch.ones(1, 1, device=DEVICE),
                                        config=triton_fp8_gemv.GemvConfig(48, 64, 1, 4, 1)),
         "block scales need block_n dividing 128"),
        (lambda: fp8_matmul.linear(torch.zeros(17, 40, device=DEVICE), weight[:, :40].contiguous(), scale),
         "torch._scaled_mm needs K and N multiples of 16; got K=40, N=32"),
        (lambda: triton_fp8_block_matmul.linear(torch.zeros(17, 64, device=DEVICE), weight, scale),
         r"the block FP8 matmul needs a 128 x 128 block scale \[1, 1\]; got \[32\]"),
        (lambda: fp8_weights.quantize_per_channel(torch.tensor([[1.0, float("inf")]])),
         "a weight to quantize must be finite; row 0 holds inf"),
        (lambda: triton_fp8_quantize.quantize_activations(x, group=0),
         "a quantization group must hold at least 1 column; got 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_the_benchmark_runs_tiny(tmp_path, monkeypatch, capsys):
    from benchmarks import fp8_linear
    out = tmp_path / "fp8.json"
    monkeypatch.setattr(sys, "argv", ["fp8_linear", "--tiny", "--rows", "1", "17",
                                      "--projections", "o", "--json", str(out)])
    fp8_linear.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["rows"]) for r in rows] == [
        ("torch float32", 1), ("triton_gemv float32", 1), ("fp8 channel", 1), ("fp8 block", 1),
        ("torch float32", 17), ("fp8 channel", 17), ("fp8 block", 17)]
    assert "FP8 linear kernels" in capsys.readouterr().out
