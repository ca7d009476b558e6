"""Weight-only int4 on the CPU (``quantization="int4"``): torch's own int4 kernel.

A decode step on the CPU streams every weight once, so its time is the bytes read: a
float32 weight is 8 times the bytes of an int4 one. torch ships a CPU kernel for 4-bit
weights with one scale and zero per group of K (``aten._weight_int4pack_mm_for_cpu``,
gpt-fast's and torchao's CPU path), computing in bfloat16: the activations are rounded to
bfloat16 on the way in and the result, bfloat16, widened on the way out (with float32 or
float16 activations it takes a path 20-30 times slower). The weight is ``uint8 [N, K / 2]`` in
torch's packed layout, its scales and zeros ``bfloat16 [K / 32, N, 2]``
(``ir/integer_weights.py``). On the 2-core CPU the default model's 210 layer matrices
take 5.2 ms for a row this way against 16.9 in float32, but 386 ms against 225 for 256
rows: its time grows with each row, so prefill is slower (docs/PERFORMANCE.md).
"""

import torch

from tokenspeed.ir.weights import INT4_GROUP


def dequantize(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """``float32 [N, K]`` of unpacked quants ``int32 [N, K]``: the kernel's reference."""
    n, k = q.shape
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)
    groups = (q.float() - 8).reshape(n, k // INT4_GROUP, INT4_GROUP)
    return (groups * scale[..., None] + zero[..., None]).reshape(n, k)


def linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype, computed in bfloat16 by torch's CPU kernel."""
    if x.device.type != "cpu":
        raise ValueError(f"int4 weights run on the CPU (torch's CPU kernel); x is on {x.device}")
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()   # the kernel needs dense rows
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_zeros)
    out = out.to(x.dtype).view(*x.shape[:-1], packed.shape[0])
    return out if bias is None else out + bias
