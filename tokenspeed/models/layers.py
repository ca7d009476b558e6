"""Building blocks of the Llama family, written so that FX tracing keeps them readable.

``RMSNorm`` and ``Rotary`` are leaf modules for the tracer: each shows in the IR as one
call, and each is row-wise, which the narrowing pass relies on.
"""

import math

import torch
from torch import nn

from tokenspeed.models.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding of ``x[rows, heads, head_dim]`` at ``positions[rows]``."""

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
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


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
