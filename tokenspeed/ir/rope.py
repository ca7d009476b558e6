"""Rotary embedding math, in one place: the models' rotary, the fusion pass's table and
the reference kernels all build and apply it here, so no two paths round differently.

A ``cos_sin`` table row is ``cat(cos(p * inv_freq), sin(p * inv_freq))`` in float32 for
position ``p``; it is cast to the rotated tensor's dtype before use, as Hugging Face does.
"""

import torch


def cos_sin_table(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[len(positions), head_dim]`` float32 rows of ``cat(cos, sin)``."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[rows, heads, head_dim]`` by its rows' ``cos_sin`` (rotate-half convention):
    Hugging Face's ``x * cos + rotate_half(x) * sin`` by halves, the same products and sums
    (a negated product is exact) in fewer, smaller ops."""
    cos_sin = cos_sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
