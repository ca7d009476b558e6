"""Weight-only int4 on the CPU (``quantization="int4"``): torch's own int4 kernel.

A decode step on the CPU streams every weight once, so its time is the bytes read: a
float32 weight is 8 times the bytes of an int4 one. torch ships a CPU kernel for 4-bit
weights with one scale and zero per group of K (``aten._weight_int4pack_mm_for_cpu``,
gpt-fast's and torchao's CPU path), computing in bfloat16: the activations are rounded to
bfloat16 on the way in and the result widened on the way out. Its dequantization is
``(q - 8) * scale + zero`` for ``q`` in 0..15; the weight is packed in torch's layout
(``uint8 [N, K / 2]``) and the scales and zeros are ``bfloat16 [K / 32, N, 2]``. On the
2-core CPU the default model's layers take 5.2 ms a token this way against 16.9 in float32
(docs/PERFORMANCE.md).
"""

import torch

from tokenspeed.ir.weights import INT4_GROUP

N_MULTIPLE = 16   # torch's packing takes output features in whole tiles of 16


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape packs: whole groups of K, whole tiles of N."""
    return in_features > 0 and in_features % INT4_GROUP == 0 and out_features % N_MULTIPLE == 0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``int32 [N, K]`` in 0..15, ``bfloat16 [K / 32, N, 2]`` scales and zeros) of a float
    weight: each group of 32 maps its smallest value to 0 and its largest to 15 (a group of
    one value: scale 1). The quants are rounded against the bfloat16 scale and zero the
    kernel reads, so each lies within half a scale of the weight it stands for."""
    n, k = w.shape
    if not fits(n, k):
        raise ValueError(f"an int4 weight needs K a multiple of {INT4_GROUP} and N of {N_MULTIPLE}; "
                         f"got [N={n}, K={k}]")
    groups = w.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(2), groups.amax(2)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(low)).bfloat16()
    zero = (low + 8 * scale.float()).bfloat16()
    start = zero.float() - 8 * scale.float()
    q = torch.round((groups - start[..., None]) / scale.float()[..., None]).clamp(0, 15)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
    return q.reshape(n, k).to(torch.int32), scales_zeros


def pack(q: torch.Tensor) -> torch.Tensor:
    """``int32 [N, K]`` quants in torch's packed CPU layout, ``uint8 [N, K / 2]``."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def dequantize(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """``float32 [N, K]`` of ``quantize``'s output: the kernel's reference."""
    n, k = q.shape
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)
    groups = (q.float() - 8).reshape(n, k // INT4_GROUP, INT4_GROUP)
    return (groups * scale[..., None] + zero[..., None]).reshape(n, k)


def linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype, computed in bfloat16 by torch's CPU kernel."""
    if x.device.type != "cpu":
        raise ValueError(f"int4 weights run on the CPU (torch's CPU kernel); x is on {x.device}")
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_zeros)
    out = out.to(x.dtype).view(*x.shape[:-1], packed.shape[0])
    return out if bias is None else out + bias
