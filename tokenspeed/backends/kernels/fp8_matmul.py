"""FP8 linear layers for prefill and batches (M > 16): the activations quantized per
token, then the product on the FP8 tensor cores.

A per-channel weight goes to ``torch._scaled_mm`` with row-wise scales (``scale_a``
``[M, 1]``, one a token; ``scale_b`` ``[1, N]``, one an output channel), which cuBLAS
(or, on builds older than CUDA 12.9, torch's CUTLASS kernel) runs on Hopper's FP8 tensor
cores; ``use_fast_accum`` stays off, so the FP8 partial sums are promoted to fp32 as the
block kernel promotes them. What torch 2.11-2.14 accept on CUDA, and so what ``linear``
checks on every device (the CPU accepts more): FP8 operands, the first row-major and the
second column-major (the weight ``[N, K]`` transposed, as stored); K and N multiples of
16; float32 scales, contiguous; bfloat16 and float16 outputs (a float32 one only where
row-wise scaling runs through cuBLAS, CUDA 12.9 or later; elsewhere torch refuses it by
name); a fused bias only of the output's 16-bit dtype, never with a float32 output, which
gets its bias added after. A weight whose K or N is not a multiple of 16 is refused with
both numbers: padding it would copy the weight at every call.

A 128 x 128 block-scaled weight goes to ``triton_fp8_block_matmul``. ``norm_linear``
quantizes the output of a layer's RMSNorm (and residual add) in the norm's own kernel.
"""

import torch

from tokenspeed.backends.kernels import triton_fp8_block_matmul
from tokenspeed.backends.kernels.fp8_weights import check_fp8_linear
from tokenspeed.backends.kernels.triton_fp8_quantize import quantize_activations, quantize_normed

ALIGNMENT = 16  # of K and N, for torch._scaled_mm


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequantize(weight, scale).T (+ bias)`` as ``[M, N]`` in x's dtype; the
    scale's layout (``[N]`` or 128 x 128 blocks) picks the kernel. ``gated``: x is
    ``[M, 2K]`` (gate, up) and the input silu(gate) * up, computed as x is quantized."""
    if scale.dim() == 2:
        return triton_fp8_block_matmul.linear(x, weight, scale, bias, gated=gated)
    return scaled_mm(x, weight, scale, bias, gated)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The per-channel product: x quantized per token, then ``torch._scaled_mm``."""
    n = _check_channel_scaled(x, weight, scale, bias, gated)
    if x.shape[0] == 0:
        return torch.zeros((0, n), dtype=x.dtype, device=x.device)
    xq, xs = quantize_activations(x, None, gated)
    return _product(xq, xs, weight, scale, bias, x.dtype)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """(rms_norm(x + residual) * norm_weight @ dequantize(weight, scale).T (+ bias), the sum
    x + residual or None) for a per-channel weight: the norm, the residual add and the
    activations' quantization in one kernel, then ``torch._scaled_mm``."""
    n = _check_channel_scaled(x, weight, scale, bias, False)
    if x.shape[0] == 0:
        return torch.zeros((0, n), dtype=x.dtype, device=x.device), None if residual is None else x + residual
    xq, xs, total = quantize_normed(x, residual, norm_weight, eps)
    return _product(xq, xs, weight, scale, bias, x.dtype), total


def _check_channel_scaled(x, weight, scale, bias, gated) -> int:
    """N, once ``torch._scaled_mm`` can take the operands (see the module's docstring)."""
    k, n = check_fp8_linear(x, weight, scale, bias, gated)
    if scale.dim() != 1:
        raise ValueError(f"torch._scaled_mm takes a per-channel scale [{n}]; got "
                         f"{list(scale.shape)}")
    if k % ALIGNMENT or n % ALIGNMENT:
        raise ValueError(f"torch._scaled_mm needs K and N multiples of {ALIGNMENT}; got "
                         f"K={k}, N={n}")
    return n


def _product(xq, xs, weight, scale, bias, dtype) -> torch.Tensor:
    """``torch._scaled_mm`` of quantized rows and the weight, a 16-bit bias fused."""
    n = weight.shape[0]
    fused = bias is not None and dtype != torch.float32
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, n),
                           bias=bias.to(dtype) if fused else None, out_dtype=dtype)
    return out if bias is None or fused else out + bias.to(dtype)
