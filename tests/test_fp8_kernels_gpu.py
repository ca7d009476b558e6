"""The FP8 kernels on a GPU, in bf16: the paths the interpreter cannot run in 16 bits
(the GEMV's ``tl.dot``, the FP8 tensor cores), with the chosen configs. Tolerances as in
``test_fp8_kernels.py``, widened to 16-bit rounding."""

import pytest
import torch

from tokenspeed.backends.kernels import fp8_matmul, fp8_weights, reference, triton_fp8_gemv

from fp8_cases import assert_within, fp8_weight, quantized_rows, rand

LAYOUTS = ["channel", "block"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_on_the_gpu(layout):
    """The 1B model's down projection (gated: the MLP's gate_up rows) for decode and small
    batches, and a short-K weight for a prefill's 2048 rows (its large tiles), within
    16-bit rounding of the float64 product."""
    weight, scale = fp8_weight(layout, n=2048, k=8192, seed=15)
    w, bias = fp8_weights.dequantize(weight, scale), rand(2048, seed=16).bfloat16()
    for m in (1, 16):
        gate_up = rand(m, 2 * 8192, seed=m).bfloat16()
        got = triton_fp8_gemv.linear(gate_up, weight, scale, bias, gated=True)
        assert_within(got.float(), reference.silu_and_mul(gate_up).float(), w, bias.float(), relative=2e-2)
    gate_up = rand(300, 2 * 8192, seed=17).bfloat16()
    got = fp8_matmul.linear(gate_up, weight, scale, bias, gated=True)
    assert_within(got.float(), reference.silu_and_mul(gate_up).float(), w, bias.float(), relative=2**-4)
    group = fp8_weights.BLOCK if layout == "block" else None
    short, short_scale = fp8_weight(layout, n=2048, k=256, seed=18)
    for m, (weight, scale) in ((17, (weight, scale)), (300, (weight, scale)), (2048, (short, short_scale))):
        x = rand(m, weight.shape[1], seed=m).bfloat16()
        got = fp8_matmul.linear(x, weight, scale, bias)
        assert got.dtype == torch.bfloat16
        assert_within(got.float(), quantized_rows(x, group), fp8_weights.dequantize(weight, scale), bias.float(),
                      relative=2e-2)
