"""Building blocks of the Llama family, written so that FX tracing keeps them readable.

``RMSNorm`` and ``Rotary`` are leaf modules for the tracer (``ir_leaf``): each shows in
the IR as one call that passes recognise by that name, and each is row-wise, which the
narrowing pass relies on.
"""

import math

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.ir.rope import apply_rotary, cos_sin_table
from tokenspeed.models.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """``weight * normalised(x)``: what ``tokenspeed::rms_norm`` computes (passes read
    ``weight`` and ``eps``)."""
    ir_leaf = "rms_norm"

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding of ``x[rows, heads, head_dim]`` at ``positions[rows]``
    (passes read ``inv_freq`` to build the fused ops' table)."""
    ir_leaf = "rotary"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rope = (config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", rope_inv_freq(*self.rope), persistent=False)

    def _apply(self, fn, recurse=True):
        """Frequencies stay float32 whatever dtype the model is cast to (as in HF).

        A cast or move that leaves them on their device (``ts.LLM`` calls ``model.to``
        with its device and dtype) keeps the very tensor: captured prefill graphs read it
        by address, and replacing it would free memory every graph of an earlier engine
        over the same model still reads. A move to another device (or ``to_empty`` from
        meta) rebuilds them there."""
        before = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.device == before.device and before.dtype == torch.float32:
            self.inv_freq = before
        else:
            self.inv_freq = rope_inv_freq(*self.rope).to(self.inv_freq.device)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos_sin_table(self.inv_freq, positions))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv_freq if scaling is None else _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling, as transformers computes it."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
