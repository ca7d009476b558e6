"""Weight-only int8 on the CPU, one scale per output channel: torch's kernel
(``aten._weight_int8pack_mm``) for the output head of ``quantization="int4"``.

The head is the largest matrix of a small model (the default model's is 113 MB in
float32, two thirds of an int4 step's bytes) and its weights are worth more bits than the
layers': int8 keeps it within 1/254 of each row's largest weight at a quarter of the
float32 bytes. The kernel computes in bfloat16 (its float32 path is ten times slower on
the 2-core CPU): the activations are rounded on the way in, and the logits come out at
bfloat16's precision, as a bfloat16 model's do (two tokens within a bfloat16 step of each
other tie, and the greedy choice takes the first). K must be a multiple of 16
(``ir/integer_weights.py``).
"""

import torch


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float32 [N, K]``: the kernel's reference."""
    return q.float() * scale.float()[:, None]


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype, computed in bfloat16 by torch's CPU kernel."""
    if x.device.type != "cpu":
        raise ValueError(f"int8 weights run on the CPU (torch's CPU kernel); x is on {x.device}")
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.aten._weight_int8pack_mm(rows, weight, scale).to(x.dtype)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias
