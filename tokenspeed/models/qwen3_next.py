"""Qwen3-Next and Qwen3.5 (text) for tracing: gated-DeltaNet layers (a short causal convolution, then the gated
delta rule over a recurrent state per request) beside gated full-attention layers, each
followed by a mixture of experts with a sigmoid-gated shared expert (or a dense MLP: every
layer of Qwen3.5). Qwen3.5's separate input projections (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``) are stacked as Qwen3-Next stores its own, in their order.

Parameter names follow Hugging Face, with the stacking of ``models.stacking`` (the
attention's q, k and v; gate and up projections). The checkpoint's zero-centred RMSNorm
weights (``x * (1 + w)``) are stored here as ``1 + w`` (``Qwen3NextForCausalLM.loaded``),
so every norm is the plain ``tokenspeed::rms_norm``. The recurrent states live in the
model's state pools (``models.state_pools``), read and written by the recurrent ops at the
rows' ``state_slots``, as attention reads and writes pages at their ``slot_mapping``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.ir.rope import apply_rotary, cos_sin_table
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.layers import CausalLM, DecoderLayer, DecoderStack, KeptFrequencies, RMSNorm, rope_inv_freq
from tokenspeed.models.kv_scales import layer_scales, unit_scales
from tokenspeed.models.llama import MLP, Attention, mlp
from tokenspeed.models.moe import SparseMoeBlock
from tokenspeed.models.state_pools import StatePools

ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                "model.norm.weight")


class PartialRotary(KeptFrequencies):
    """RoPE over the first ``rotary_dim`` dimensions of each head, the rest passed through
    (transformers' partial rotary). Not the ``rotary`` leaf the fusion passes read, which
    rotates whole heads: it traces as the plain ops it is."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rotary_dim = config.hybrid.rotary_dim
        self.rope = (self.rotary_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return rope_inv_freq(*self.rope)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rotated, passed = x.split([self.rotary_dim, x.shape[-1] - self.rotary_dim], dim=-1)
        return torch.cat([apply_rotary(rotated, cos_sin_table(self.inv_freq, positions)), passed], dim=-1)


class GatedAttention(Attention):
    """Llama's attention with q_proj twice as wide: each head's query, then its output
    gate, ``o_proj(attention * sigmoid(gate))``; q and k normed per head, partially rotated."""

    def __init__(self, config: ModelConfig, layer: int, groups, kv_scales: torch.Tensor):
        super().__init__(config, layer, groups, kv_scales)
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.rotary = PartialRotary(config)

    def forward(self, h, positions, kv_cache, meta):
        query_gate, k, v = self.qkv_proj(h).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = query_gate.view(-1, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        self._write_kv(k, v, positions, kv_cache, meta)
        q = self.rotary(self.q_norm(q), positions)
        o = ops.attention(q, kv_cache, self.row, meta.block_tables, meta.row_request, positions, self.scale,
                          self.window, **layer_scales(self.kv_scales, self.kv_layer))
        o = o.view(-1, self.q_size) * torch.sigmoid(gate.reshape(-1, self.q_size))
        return self.o_proj(o)


class ConvWeight(nn.Module):
    """The depthwise convolution's ``weight [D, 1, W]``, as the checkpoint's ``conv1d``."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class GatedDeltaNet(nn.Module):
    """transformers' ``Qwen3NextGatedDeltaNet`` (and ``Qwen3_5GatedDeltaNet``) over the
    engine's rows: the projections (``GatedDeltaNetConfig.by_key_head`` says their layout), ``tokenspeed::causal_conv_silu`` over q, k, v, ``tokenspeed::gated_delta_rule``,
    the output normed per value head and gated by ``silu(z)``, then ``out_proj``."""

    def __init__(self, config: ModelConfig, layer: int, pools: StatePools):
        super().__init__()
        lin = config.hybrid.linear
        self.lin, self.state_layer = lin, lin.state_index(layer)
        object.__setattr__(self, "pools", pools)   # the model's, not a submodule of each layer
        per_key = lin.num_value_heads // lin.num_key_heads
        self.qkvz_split = [lin.key_head_dim, lin.key_head_dim, per_key * lin.value_head_dim,
                           per_key * lin.value_head_dim]
        self.in_proj_qkvz = nn.Linear(config.hidden_size, 2 * lin.key_dim + 2 * lin.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(config.hidden_size, 2 * lin.num_value_heads, bias=False)
        self.conv1d = ConvWeight(lin.conv_dim, lin.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(lin.num_value_heads))
        self.norm = RMSNorm(lin.value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(lin.value_dim, config.hidden_size, bias=False)

    def forward(self, h, positions, kv_cache, meta):
        lin = self.lin
        mixed, z, b, a = self._projected(h)
        mixed = ops.causal_conv_silu(mixed, self.conv1d.weight[:, 0], self.pools.conv, self.state_layer,
                                     meta.state_slots, meta.row_request, positions)
        q, k, v = mixed.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        beta = b.reshape(-1, lin.num_value_heads).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(-1, lin.num_value_heads).float() + self.dt_bias)
        o = ops.gated_delta_rule(q.reshape(-1, lin.num_key_heads, lin.key_head_dim),
                                 k.reshape(-1, lin.num_key_heads, lin.key_head_dim),
                                 v.reshape(-1, lin.num_value_heads, lin.value_head_dim), g, beta,
                                 self.pools.recurrent, self.state_layer, meta.state_slots, meta.row_request,
                                 positions)
        gated = self.norm(o).float() * F.silu(z.reshape(-1, lin.num_value_heads, lin.value_head_dim).float())
        return self.out_proj(gated.type_as(h).reshape(-1, lin.value_dim))

    def _projected(self, h):
        """(q, k, v concatenated for the convolution, z, b, a) from the stacked projections,
        grouped by key head (Qwen3-Next) or laid out whole (Qwen3.5)."""
        lin = self.lin
        if not lin.by_key_head:
            qkv, z = self.in_proj_qkvz(h).split([2 * lin.key_dim + lin.value_dim, lin.value_dim], dim=-1)
            b, a = self.in_proj_ba(h).chunk(2, dim=-1)
            return qkv, z, b, a
        q, k, v, z = self.in_proj_qkvz(h).view(-1, lin.num_key_heads, sum(self.qkvz_split)).split(
            self.qkvz_split, dim=-1)
        b, a = self.in_proj_ba(h).view(-1, lin.num_key_heads, 2 * lin.num_value_heads // lin.num_key_heads).chunk(
            2, dim=-1)
        return torch.cat([q.reshape(-1, lin.key_dim), k.reshape(-1, lin.key_dim), v.reshape(-1, lin.value_dim)],
                         -1), z, b, a


class SharedExpertMoe(SparseMoeBlock):
    """The routed experts plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``,
    as transformers' ``Qwen3NextSparseMoeBlock``."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.moe, config.hidden_size)
        self.shared_expert = MLP(config.hidden_size, config.hybrid.shared_expert_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x):
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(DecoderLayer):
    """A pre-norm block whose token mixer is ``linear_attn`` (gated DeltaNet) or
    ``self_attn``, as the checkpoint names them."""

    def __init__(self, config: ModelConfig, layer: int, groups, kv_scales, pools: StatePools):
        linear = layer in config.hybrid.linear.layers
        mixer = GatedDeltaNet(config, layer, pools) if linear else GatedAttention(config, layer, groups, kv_scales)
        sparse = config.moe is not None and layer in config.moe.sparse_layers
        super().__init__(config, mixer, SharedExpertMoe(config) if sparse and config.hybrid.shared_expert_size
                         else mlp(config, layer))
        if linear:
            self.linear_attn = self.self_attn
            del self.self_attn

    def forward(self, h, positions, kv_cache, meta):
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        h = h + mixer(self.input_layernorm(h), positions, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextForCausalLM(CausalLM):
    """Returns the logits of the sampled rows (``meta.sample_rows``) only. The state pools
    hold one slot (the null slot) until ``state_pools.allocate`` sizes them for an engine."""

    def __init__(self, config: ModelConfig):
        groups, kv_scales, pools = config.cache_groups, unit_scales(config.num_layers), StatePools(config.hybrid.linear)
        stack = DecoderStack(config, (HybridDecoderLayer(config, i, groups, kv_scales, pools)
                                      for i in range(config.num_layers)))
        super().__init__(config, stack)
        self.model.state_pools, self.model.kv_scales = pools, kv_scales

    @staticmethod
    def loaded(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model holds it: zero-centred norm weights as ``1 + w``."""
        return tensor.float() + 1.0 if name.endswith(ZERO_CENTRED) else tensor
