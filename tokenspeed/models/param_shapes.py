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
