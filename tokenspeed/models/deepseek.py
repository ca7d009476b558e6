"""DeepSeek-V2/V3 for tracing: multi-head latent attention (MLA) over a latent cache,
dense MLP layers up to ``first_k_dense_replace``, mixtures of experts after.

Parameter names follow Hugging Face, except that projections reading the same input are
stacked (``models.stacking``): the dense MLPs' gate and up projections (Llama's ``MLP``: one
product, the activation fused into the down projection's GEMV), and the query's projection
(or its low-rank down-projection) with the latent's (``q_kv_a_proj``: one product, into
which a decode step's fusion passes fold the layer's input norm). A layer caches, per
token, its normed latent and its rotated rope key
(``tokenspeed::write_latent``); ``tokenspeed::mla_attention`` reads them with the layer's
``kv_b_proj`` weight (the CPU reference expands a prompt's runs and absorbs lone rows; the
Triton kernels absorb every row: see ``backends.kernels.mla_reference`` and
``triton_mla``). Routing is model code (``deepseek_routing``); the routed experts are one
``tokenspeed::moe`` call over the stacked expert weights.
"""

from torch import nn

from tokenspeed.ir import ops
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.deepseek_config import RMS_EPS
from tokenspeed.models.deepseek_routing import DeepseekRouter
from tokenspeed.models.layers import CausalLM, DecoderLayer, DecoderStack, RMSNorm
from tokenspeed.models.llama import MLP
from tokenspeed.models.mla_rotary import MlaRotary
from tokenspeed.models.moe import Experts
from tokenspeed.models.stacking import stacked_sizes


class MlaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        m, hidden = config.mla, config.hidden_size
        self.layer, self.num_heads, self.m = layer, config.num_heads, m
        q_out = config.num_heads * config.head_dim
        self.sizes = stacked_sizes(config, "q_kv_a_proj", 0)     # the query's rows, the latent's
        # a full-rank query projection has no bias whatever attention_bias says (transformers'):
        # with a biased latent projection beside it, the two stay apart
        self.stacked = m.q_lora_rank is not None or not m.attention_bias
        if self.stacked:
            self.q_kv_a_proj = nn.Linear(hidden, sum(self.sizes), bias=m.attention_bias)
        else:
            self.q_proj = nn.Linear(hidden, self.sizes[0], bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, self.sizes[1], bias=True)
        if m.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, RMS_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, RMS_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, config.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(config.num_heads * m.v_head_dim, hidden, bias=m.attention_bias)
        self.rotary = MlaRotary(m, config.rope_theta)

    def forward(self, h, positions, kv_cache, meta):
        m = self.m
        q, kv = self.q_kv_a_proj(h).split(self.sizes, dim=-1) if self.stacked else \
            (self.q_proj(h), self.kv_a_proj_with_mqa(h))
        latent, k_rope = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_rope = self.rotary(k_rope.view(-1, 1, m.qk_rope_head_dim), positions)
        ops.write_latent(self.kv_a_layernorm(latent), k_rope.view(-1, m.qk_rope_head_dim), kv_cache, self.layer,
                         meta.slot_mapping)
        q = q if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(-1, self.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        o = ops.mla_attention(q_nope, self.rotary(q_rope, positions), kv_cache, self.layer, meta.block_tables,
                              meta.row_request, positions, self.kv_b_proj.weight, m.scale)
        return self.o_proj(o.reshape(-1, self.num_heads * m.v_head_dim))


class DeepseekMoeLayer(nn.Module):
    """Routed experts (``tokenspeed::moe``) plus the shared experts, one dense MLP of
    ``n_shared_experts`` experts' width that every token passes."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.deepseek_moe
        self.gate = DeepseekRouter(config.hidden_size, moe)
        self.experts = Experts(moe.n_routed_experts, moe.moe_intermediate_size, config.hidden_size)
        shared = moe.moe_intermediate_size * moe.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None

    def forward(self, x):
        weights, ids = self.gate(x)
        out = ops.moe(x, self.experts.w13, self.experts.w2, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def deepseek_layer(config: ModelConfig, layer: int) -> DecoderLayer:
    """Latent attention, then a mixture of experts or (the first layers) a dense MLP."""
    mlp = DeepseekMoeLayer(config) if config.deepseek_moe.is_moe_layer(layer) else \
        MLP(config.hidden_size, config.intermediate_size)
    return DecoderLayer(config, MlaAttention(config, layer), mlp)


class DeepseekForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the config says which): returns
    the logits of the sampled rows (``meta.sample_rows``) only."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, DecoderStack(config, (deepseek_layer(config, i) for i in range(config.num_layers))))
