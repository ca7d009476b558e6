"""FP8 weights: the layout the kernels read, its checks, and the torch reference.

A weight is ``float8_e4m3fn [N, K]`` (row-major, contiguous) with a float32 scale in one
of two layouts, told apart by ``scale.dim()``: one per output channel, ``[N]``
(per-tensor checkpoints are expanded to this at load), or one per 128 x 128 tile,
``[ceil(N/128), ceil(K/128)]`` (DeepSeek-style "block" checkpoints). The weight's value
is ``weight.float() * scale``, broadcast per row or per tile. Activations are quantized
per token (and, for block weights, per 128 columns) at run time, with ``FP8_MAX`` mapped
to each row's or group's largest magnitude.

This module is plain torch: the checks every FP8 kernel runs on its arguments, and the
reference (``dequantize`` and the quantizers) the Triton kernels are tested against and
that ``LLM(quantization="fp8")`` quantizes a 16-bit checkpoint with.
"""

import torch
import torch.nn.functional as F

from tokenspeed.ir.weights import FP8_MAX, FP8_TILE, quantize_per_channel, to_fp8  # noqa: F401 (the reference's)

FP8 = torch.float8_e4m3fn
BLOCK = FP8_TILE  # the rows and columns of a block scale's tile, and an activation group
MIN_AMAX = 1e-12  # an all-zero activation row still gets a finite, nonzero scale
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def block_scale_shape(n: int, k: int) -> tuple[int, int]:
    """The shape of a 128 x 128 block scale for a weight ``[n, k]``."""
    return -(-n // BLOCK), -(-k // BLOCK)


def check_weight(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a well-formed FP8 weight and its scale."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn [N, K]; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if not weight.is_contiguous():
        raise ValueError(f"an FP8 weight must be contiguous (row-major); got strides "
                         f"{weight.stride()} for shape {(n, k)}")
    if scale.dtype != torch.float32:
        raise ValueError(f"an FP8 weight's scale must be float32; got {scale.dtype}")
    if tuple(scale.shape) not in ((n,), block_scale_shape(n, k)):
        raise ValueError(f"an FP8 weight [{n}, {k}] needs a scale [{n}] (per channel) or "
                         f"{list(block_scale_shape(n, k))} (128 x 128 blocks); got "
                         f"{list(scale.shape)}")
    if not scale.is_contiguous():
        raise ValueError(f"an FP8 weight's scale must be contiguous; got strides "
                         f"{scale.stride()}")
    if scale.device != weight.device:
        raise ValueError(f"an FP8 weight's scale must be on its device {weight.device}; got "
                         f"{scale.device}")
    return n, k


def check_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None, gated: bool = False) -> tuple[int, int]:
    """(K, N) of a well-formed ``x [M, K] @ (weight * scale).T + bias``; ``gated``: of
    ``silu(gate) * up`` for x ``[M, 2K]`` (gate, up)."""
    n, k = check_weight(weight, scale)
    width = 2 * k if gated else k
    if x.dim() != 2 or x.shape[1] != width:
        need = f"[M, {width}] (gate, up)" if gated else f"[M, {width}]"
        raise ValueError(f"x must be {need} for an FP8 weight of {k} columns; got "
                         f"{tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x must be on the FP8 weight's device {weight.device}; got "
                         f"{x.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != weight.device):
        raise ValueError(f"bias must be [{n}] on {weight.device}; got {tuple(bias.shape)} on "
                         f"{bias.device}")
    return k, n


def dequantize(weight: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype``: each weight times its row's or its tile's scale (in fp32)."""
    n, k = check_weight(weight, scale)
    if scale.dim() == 1:
        return (weight.float() * scale[:, None]).to(dtype)
    tiles = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (weight.float() * tiles).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``float8_e4m3fn [M, K]``, ``float32 [M, 1]``): per-token dynamic scales, each row's
    largest magnitude (at least ``MIN_AMAX``) mapped to ``FP8_MAX``."""
    return quantize_activation_groups(x, None)


def quantize_activation_groups(x: torch.Tensor, group: int | None = BLOCK):
    """(``float8_e4m3fn [M, K]``, ``float32 [M, ceil(K / group)]``): a scale per row and
    ``group`` columns (the last group may be shorter; None: the whole row), as
    ``quantize_activations`` makes one per row."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations to quantize must be bfloat16, float16 or float32 "
                         f"[M, K]; got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    group = max(k, 1) if group is None else group
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    # times 1 / FP8_MAX, not divided by it: torch on CUDA divides by a scalar as a product
    # by its inverse, so a product is what every device and the kernel compute alike
    scale = padded.abs().amax(2).clamp(min=MIN_AMAX) * (1 / FP8_MAX)
    inverse = (1 / scale).repeat_interleave(group, 1)[:, :k]  # as the Triton kernel rounds
    return to_fp8(x.float() * inverse), scale
