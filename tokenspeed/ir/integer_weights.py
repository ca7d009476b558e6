"""The quantizers of ``quantization="int4"`` (the CPU's weight-only integers): int4 with a
scale and zero per 32 inputs for the layers (``INT4``), int8 with a scale per output channel
for the head (``INT8``). They run once, at load (models); the kernels that read the result,
and their references, are the backend's (``backends/kernels/cpu_int4.py``, ``cpu_int8.py``).

torch's CPU kernels set the shapes: the int4 one packs N in tiles of 16 and K in whole
groups; the int8 one returns wrong sums unless K is a multiple of 16 (torch 2.13: K 8, 24
and 40 gave errors of 10^12 or NaN, K 100 crashed the process). Scales and zeros are
bfloat16, as the kernels read them, and each quant is rounded against the rounded scale.
"""

import torch

from tokenspeed.ir.weights import INT4_GROUP

INT4_N_MULTIPLE = 16
INT8_K_MULTIPLE = 16


def int4_fits(out_features: int, in_features: int) -> bool:
    return in_features > 0 and in_features % INT4_GROUP == 0 and out_features % INT4_N_MULTIPLE == 0


def int8_fits(in_features: int) -> bool:
    return in_features > 0 and in_features % INT8_K_MULTIPLE == 0


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``int32 [N, K]`` in 0..15, ``bfloat16 [K / 32, N, 2]`` scales and zeros) of a float
    weight, dequantized as ``(q - 8) * scale + zero``: each group of 32 maps its smallest
    value to 0 and its largest to 15, so each weight comes back within half a scale, plus
    the bfloat16 rounding of its zero (``|zero| / 256``: a group far from 0 for its range
    keeps bfloat16's precision, as a bfloat16 weight would). A group of one value ``c`` gets
    zero 0 and the scale that puts ``c`` at quant 15 (c > 0) or 0 (c < 0), so it comes back
    within bfloat16's rounding of ``c``."""
    n, k = w.shape
    if not int4_fits(n, k):
        raise ValueError(f"an int4 weight needs K a multiple of {INT4_GROUP} and N of {INT4_N_MULTIPLE}; "
                         f"got [N={n}, K={k}]")
    groups = w.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(2), groups.amax(2)
    flat = high == low
    lone = torch.where(low > 0, low / 7, torch.where(low < 0, -low / 8, torch.ones_like(low)))
    scale = torch.where(flat, lone, (high - low) / 15).bfloat16()
    zero = torch.where(flat, torch.zeros_like(low), low + 8 * scale.float()).bfloat16()
    start = zero.float() - 8 * scale.float()
    q = torch.round((groups - start[..., None]) / scale.float()[..., None]).clamp(0, 15)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
    return q.reshape(n, k).to(torch.int32), scales_zeros


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``int32 [N, K]`` quants in torch's packed CPU layout, ``uint8 [N, K / 2]``."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``int8 [N, K]``, ``bfloat16 [N]`` scales) of a float weight: each row's largest
    magnitude maps to 127 (an all-zero row: scale 1)."""
    if not int8_fits(w.shape[1]):
        raise ValueError(f"an int8 weight needs K a multiple of {INT8_K_MULTIPLE}; got [N={w.shape[0]}, "
                         f"K={w.shape[1]}]")
    w = w.detach().float()
    amax = w.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).bfloat16()
    return torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8), scale
