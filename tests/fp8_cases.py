"""FP8 weights and inputs for the FP8 kernel tests (``test_fp8_kernels.py``, and its GPU
file), and their float64 oracle."""

import torch

from tokenspeed.backends.kernels import fp8_weights
from tokenspeed.backends.kernels.fp8_weights import block_scale_shape

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# FP8 tensor cores on a Hopper GPU accumulate with about 14 mantissa bits (DeepSeek-V3's
# report measures it; seen here: errors up to 2^-13.6 of sum |x w|), not fp32's: the
# matmuls' products are compared within 2^-11 of it there, within fp32's order elsewhere.
TENSOR_CORE_RELATIVE = 2 ** -11 if torch.cuda.is_available() else 1e-5
N, K = 150, 208  # a partial block row and column; K % 16 == 0, so torch._scaled_mm takes it


def fp8_weight(layout: str, n: int = N, k: int = K, seed: int = 0):
    """(weight, scale): a random float weight quantized per channel, or FP8 values with
    random 128 x 128 block scales of different magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    if layout == "channel":
        weight, scale = fp8_weights.quantize_per_channel(w)
    else:
        weight = fp8_weights.to_fp8(w * 64)
        scale = torch.rand(block_scale_shape(n, k), generator=gen) * 0.03 + 0.001
    return weight.to(DEVICE), scale.to(DEVICE)


def rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_within(got, x, w, bias=None, relative=1e-5):
    """|got - exact| <= relative * sum_k |x_k w_nk| elementwise (exact: float64)."""
    x, w = x.cpu().double(), w.cpu().double()
    exact = x @ w.T + (bias.cpu().double() if bias is not None else 0)
    bound = relative * (x.abs() @ w.abs().T) + 1e-6
    error = (got.cpu().double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"


def quantized_rows(x, group=None):
    """x as the FP8 matmuls see it: quantized by the reference, back in float."""
    q, scale = fp8_weights.quantize_activation_groups(x, group)
    return q.float() * scale.repeat_interleave(group or x.shape[1], 1)[:, :x.shape[1]]
