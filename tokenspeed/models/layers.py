"""Building blocks of the decoder models (the Llama family, the mixtures, DeepSeek), written
so that FX tracing keeps them readable: a model is a ``CausalLM`` over a ``DecoderStack`` of
pre-norm ``DecoderLayer``s, each with its own attention and MLP.

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


class KeptFrequencies(nn.Module):
    """A rotary's ``inv_freq`` buffer (built by ``frequencies()``), which stays float32
    whatever dtype the model is cast to (as in HF).

    A cast or move that leaves it on its device (``ts.LLM`` calls ``model.to`` with its
    device and dtype) keeps the very tensor: captured prefill graphs read it by address,
    and replacing it would free memory every graph of an earlier engine over the same model
    still reads. A move to another device (or ``to_empty`` from meta) rebuilds it there."""

    def frequencies(self) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        before = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.device == before.device and before.dtype == torch.float32:
            self.inv_freq = before
        else:
            self.inv_freq = self.frequencies().to(self.inv_freq.device)
        return self


class Rotary(KeptFrequencies):
    """Rotary position embedding of ``x[rows, heads, head_dim]`` at ``positions[rows]``
    (passes read ``inv_freq`` to build the fused ops' table)."""
    ir_leaf = "rotary"
    interleaved = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rope = (config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return rope_inv_freq(*self.rope)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows of the ``cos_sin`` table (``ir.rope``) at ``positions``."""
        return cos_sin_table(self.inv_freq, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos_sin(positions))


class DecoderLayer(nn.Module):
    """A pre-norm block: attention, then the MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, h, positions, kv_cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), positions, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """The token embedding, the decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, kv_cache, meta):
        h = self.embed_tokens(meta.input_ids)
        for layer in self.layers:
            h = layer(h, meta.positions, kv_cache, meta)
        return self.norm(h)


class CausalLM(nn.Module):
    """A decoder stack (``model``) and its head; returns the logits of the sampled rows
    (``meta.sample_rows``) only."""

    def __init__(self, config: ModelConfig, model: DecoderStack):
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        h = self.model(kv_cache, meta)
        return self.lm_head(h.index_select(0, meta.sample_rows))


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
