"""The torch reference of the GGUF kernels: ``gguf``'s own dequantization, then the float
op. The oracle the Triton kernels are tested against, and what a CPU would compute from the
same bytes (the CPU's own kernels are ``cpu_blocks``)."""

import gguf
import numpy as np
import torch

from tokenspeed.backends.kernels import reference
from tokenspeed.backends.kernels.gguf_blocks import BlockFormat, check_weight
from tokenspeed.ir.weights import scatter_scales


def dequantize(weight: torch.Tensor, fmt: BlockFormat, dtype=torch.float32) -> torch.Tensor:
    """``uint8 [N, row_bytes]`` -> ``[N, K]`` in ``dtype``, on ``weight``'s device (Q8_0_G8:
    as the Q8_0 blocks it holds)."""
    check_weight(weight, fmt)
    blocks = scatter_scales(weight) if fmt.gathered else weight
    values = gguf.quants.dequantize(blocks.cpu().numpy(), fmt.qtype)
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).to(weight.device, dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat,
           bias: torch.Tensor = None) -> torch.Tensor:
    """In fp32, rounded to x's dtype, as the kernels accumulate."""
    w = dequantize(weight, fmt)
    b = bias.float() if bias is not None else None
    return torch.nn.functional.linear(x.float(), w, b).to(x.dtype)


def embedding(ids: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat,
              dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` names, each dequantized alone (a table is megabytes; a step reads a
    few of its rows)."""
    if ids.numel() == 0:   # gguf's dequantization cannot reshape no blocks
        return torch.empty(*ids.shape, fmt.features(weight.shape[1]), dtype=dtype, device=weight.device)
    rows = dequantize(weight[ids.reshape(-1).to(weight.device)], fmt)
    return rows.view(*ids.shape, rows.shape[-1]).to(dtype)


def norm_linear(x, residual, norm_weight, eps, weight, fmt: BlockFormat, bias=None) -> list:
    """[out] without a residual, [out, x + residual] with one: ``reference.norm_linear``'s."""
    if residual is None:
        return [linear(reference.rms_norm(x, norm_weight, eps), weight, fmt, bias)]
    normed, total = reference.add_rms_norm(x, residual, norm_weight, eps)
    return [linear(normed, weight, fmt, bias), total]
