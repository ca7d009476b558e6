"""Which config fields set the shape of each checkpoint tensor.

A tensor whose shape differs from the model's is as often a wrong config field as a
wrong tensor (a head count edited by hand gives a ``k_proj`` of the wrong height); the
loader's error names the fields, with their values, so the reader can tell which.
"""

from tokenspeed.models.config import ModelConfig


def shape_origin(config: ModelConfig, name: str) -> str:
    """``name``: a Hugging Face tensor name (``model.layers.0.self_attn.k_proj.weight``)."""
    module, kind = name.split(".")[-2:]
    rows, columns = _dimensions(config, ".experts." in name).get(module, (None, None))
    if rows is None:
        return "shape not set by the config"
    return f"rows: {rows}" if kind == "bias" or columns is None else f"rows: {rows}; columns: {columns}"


def _dimensions(config: ModelConfig, expert: bool) -> dict[str, tuple[str, str | None]]:
    """``expert``: the dimensions of an expert's matrices (Qwen3-MoE's ``moe_intermediate_size``)."""
    if config.mla is not None:
        return _latent_dimensions(config)
    c = config
    hidden, ffn = f"hidden_size={c.hidden_size}", f"intermediate_size={c.intermediate_size}"
    if expert and c.moe is not None and c.moe.intermediate_size != c.intermediate_size:
        ffn = f"moe_intermediate_size={c.moe.intermediate_size}"
    heads = f"num_attention_heads={c.num_heads} x head_dim={c.head_dim}"
    kv_heads = f"num_key_value_heads={c.num_kv_heads} x head_dim={c.head_dim}"
    vocab, head_dim = f"vocab_size={c.vocab_size}", f"head_dim={c.head_dim}"
    experts = f"num_experts={c.moe.num_experts}" if c.moe is not None else None
    return {
        "q_proj": (heads, hidden), "k_proj": (kv_heads, hidden), "v_proj": (kv_heads, hidden),
        "o_proj": (hidden, heads), "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn), "embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden),
        "w1": (ffn, hidden), "w3": (ffn, hidden), "w2": (hidden, ffn), "gate": (experts, hidden),
        "q_norm": (head_dim, None), "k_norm": (head_dim, None), "input_layernorm": (hidden, None),
        "post_attention_layernorm": (hidden, None), "norm": (hidden, None),
    }


def _latent_dimensions(c: ModelConfig) -> dict[str, tuple[str, str | None]]:
    """DeepSeek's: latent attention's projections, the embeddings and norms (an MLP's
    width depends on whether it is a layer's, an expert's or the shared experts')."""
    m, hidden, vocab = c.mla, f"hidden_size={c.hidden_size}", f"vocab_size={c.vocab_size}"
    qk = f"num_attention_heads={c.num_heads} x (qk_nope_head_dim={m.qk_nope_head_dim} + " \
         f"qk_rope_head_dim={m.qk_rope_head_dim})"
    q_rank, kv_rank = f"q_lora_rank={m.q_lora_rank}", f"kv_lora_rank={m.kv_lora_rank}"
    return {
        "q_proj": (qk, hidden), "q_a_proj": (q_rank, hidden), "q_b_proj": (qk, q_rank), "q_a_layernorm": (q_rank, None),
        "kv_a_proj_with_mqa": (f"{kv_rank} + qk_rope_head_dim={m.qk_rope_head_dim}", hidden),
        "kv_a_layernorm": (kv_rank, None),
        "kv_b_proj": (f"num_attention_heads={c.num_heads} x (qk_nope_head_dim={m.qk_nope_head_dim} + "
                      f"v_head_dim={m.v_head_dim})", kv_rank),
        "o_proj": (hidden, f"num_attention_heads={c.num_heads} x v_head_dim={m.v_head_dim}"),
        "embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden), "input_layernorm": (hidden, None),
        "post_attention_layernorm": (hidden, None), "norm": (hidden, None),
    }
