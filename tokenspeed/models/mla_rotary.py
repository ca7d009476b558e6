"""DeepSeek's rotary embedding of the rope part of queries and keys: plain or YaRN
frequencies, cos and sin scaled by YaRN's attention factor, and pairs of adjacent
elements rotated together (``rope_interleave``).

Interleaved pairs are gathered into halves first (evens, then odds) and rotated as halves
(``ir.rope``), as transformers' DeepseekV3 computes them. Its DeepseekV2 leaves each pair
in place (a complex product): the values are the same, in another order, and queries and
keys share that order, so their products, all attention reads, are unchanged.
"""

import math

import torch

from tokenspeed.ir.rope import apply_rotary, cos_sin_table
from tokenspeed.models.deepseek_config import MlaConfig, Yarn
from tokenspeed.models.layers import KeptFrequencies


class MlaRotary(KeptFrequencies):
    """Rotates ``x[rows, heads, rope]`` at ``positions[rows]``; a tracer leaf, row-wise."""
    ir_leaf = "mla_rotary"

    def __init__(self, mla: MlaConfig, theta: float):
        super().__init__()
        self.rope = (mla.qk_rope_head_dim, theta, mla.yarn)
        self.interleaved = mla.rope_interleave
        self.attention_factor = mla.yarn.attention_factor if mla.yarn else 1.0
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return mla_inv_freq(*self.rope)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of the ``cos_sin`` table (``ir.rope``) at ``positions``, YaRN's factor in."""
        return cos_sin_table(self.inv_freq, positions) * self.attention_factor

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, self.cos_sin(positions))


def mla_inv_freq(dim: int, theta: float, yarn: Yarn | None) -> torch.Tensor:
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    return 1.0 / base if yarn is None else _yarn_inv_freq(base, dim, theta, yarn)


def _yarn_inv_freq(base: torch.Tensor, dim: int, theta: float, y: Yarn) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``: interpolated frequencies below the
    correction range, extrapolated above it, a linear ramp between."""
    def correction_dim(rotations):
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (y.factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation
