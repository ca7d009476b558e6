"""One Llama-family definition (Llama 2/3, Qwen2, Qwen3, KV-shared variant) for tracing.

Parameter names follow Hugging Face, except that projections reading the same input are
stacked (``qkv_proj``, ``gate_up_proj``): one matrix product instead of three or two. The
loader maps checkpoint tensors into their slices (``models.stacking``).
Every per-step tensor comes in through ``meta`` (a descriptor); attention and cache
writes are the ``tokenspeed::`` custom ops, so the traced graph names what it reads. The
scales of an FP8 cache (``kv_scales``) enter the graph as the ops' constants when traced.
"""

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.ir.cache_groups import CacheGroup, cache_slot
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.kv_scales import layer_scales, unit_scales
from tokenspeed.models.layers import CausalLM, DecoderLayer, DecoderStack, RMSNorm, Rotary
from tokenspeed.models.moe import SparseMoeBlock


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, groups: tuple[CacheGroup, ...],
                 kv_scales: torch.Tensor):
        """``groups``: the model's cache groups (``config.cache_groups``, computed once);
        ``kv_scales``: the model's (``models.kv_scales``), read when traced."""
        super().__init__()
        self.kv_scales = kv_scales
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.layer, self.kv_layer = layer, c.kv_source_layer(layer)
        self.writes_kv = self.layer == self.kv_layer
        self.num_groups, (self.group, self.row) = len(groups), cache_slot(groups, self.kv_layer)
        self.scale = c.head_dim ** -0.5
        self.window = c.window_of(layer)
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.writes_kv:
            self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        else:
            self.q_proj = nn.Linear(c.hidden_size, self.q_size, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if self.writes_kv else None
        self.qk_norm = c.qk_norm
        self.rotary = Rotary(c)

    def forward(self, h, positions, kv_cache, meta):
        if self.writes_kv:
            q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            self._write_kv(k, v, positions, kv_cache, meta)
        else:
            q = self.q_proj(h)
        q = q.view(-1, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = self.rotary(q, positions)
        o = ops.attention(q, kv_cache, self.row, self._of_group(meta.block_tables), meta.row_request,
                          positions, self.scale, self.window, **layer_scales(self.kv_scales, self.kv_layer))
        return self.o_proj(o.view(-1, self.num_heads * self.head_dim))

    def _write_kv(self, k, v, positions, kv_cache, meta):
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        ops.write_kv(self.rotary(k, positions), v, kv_cache, self.row, self._of_group(meta.slot_mapping),
                     **layer_scales(self.kv_scales, self.kv_layer))

    def _of_group(self, field):
        """This layer's group's block tables or write locations: with several groups the
        metadata stacks them on dim 1 (``plan_extend``, ``refresh_decode``)."""
        return field if self.num_groups == 1 else field[:, self.group]


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


def mlp(config: ModelConfig, layer: int) -> nn.Module:
    """A mixture of experts' sparse layers route to experts; every other layer is dense."""
    if config.moe is not None and layer in config.moe.sparse_layers:
        return SparseMoeBlock(config.moe, config.hidden_size)
    return MLP(config.hidden_size, config.intermediate_size)


class LlamaModel(DecoderStack):
    def __init__(self, config: ModelConfig):
        groups, kv_scales = config.cache_groups, unit_scales(config.num_layers)
        super().__init__(config, (DecoderLayer(config, Attention(config, i, groups, kv_scales), mlp(config, i))
                                  for i in range(config.num_layers)))
        self.kv_scales = kv_scales


class LlamaForCausalLM(CausalLM):
    """Returns the logits of the sampled rows (``meta.sample_rows``) only."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, LlamaModel(config))
