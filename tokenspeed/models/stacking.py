"""Projections that read the same input, stacked into one matrix: one product instead of
two or three (``qkv_proj``, ``gate_up_proj``; a latent-attention layer's ``q_kv_a_proj``,
its query projection (or the query's low-rank down-projection) with the latent's). The
loader fills a stacked matrix's rows from its checkpoint parts, in index order.
"""

from tokenspeed.models.config import ModelConfig

STACKED = {  # checkpoint name part -> (our name part, slice index among the stacked parts)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
LATENT_STACKED = {  # DeepSeek's: ``q_proj`` (V2-Lite) or ``q_a_proj`` (V2, V3), then the latent's
    "q_proj": ("q_kv_a_proj", 0), "q_a_proj": ("q_kv_a_proj", 0), "kv_a_proj_with_mqa": ("q_kv_a_proj", 1),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
LINEAR_STACKED = {  # Qwen3.5's gated-DeltaNet input projections, as Qwen3-Next stores them
    **STACKED, "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
}
STACKED_LAYERS = frozenset(stacked for table in (STACKED, LATENT_STACKED) for stacked, _ in table.values())


def stacked_parts(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """The model's table: a checkpoint part -> (our stacked layer, its index there)."""
    if config.mla is not None:
        return LATENT_STACKED
    return LINEAR_STACKED if config.hybrid is not None and not config.hybrid.linear.by_key_head else STACKED


def stacked_layers(config: ModelConfig) -> frozenset[str]:
    """Our layers that the model's checkpoints fill from parts."""
    return frozenset(stacked for stacked, _ in stacked_parts(config).values())


def part_names(config: ModelConfig, stacked: str) -> list[str]:
    """The checkpoint parts of a stacked layer, in order."""
    if stacked == "q_kv_a_proj":
        return ["q_proj" if config.mla.q_lora_rank is None else "q_a_proj", "kv_a_proj_with_mqa"]
    return [part for part, (layer, _) in stacked_parts(config).items() if layer == stacked]


def stacked_sizes(config: ModelConfig, stacked: str, rows: int) -> list[int]:
    """Rows of each checkpoint part inside a stacked projection of ``rows`` rows (a gate and
    up projection's halves: DeepSeek's shared experts are narrower than its dense layers)."""
    c = config
    if stacked == "qkv_proj":   # a gated attention's query rows hold each head's query, then its gate
        gated = 2 if c.hybrid is not None else 1
        return [gated * c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2
    if stacked == "in_proj_qkvz":
        return [2 * c.hybrid.linear.key_dim + c.hybrid.linear.value_dim, c.hybrid.linear.value_dim]
    if stacked == "q_kv_a_proj":
        m = c.mla
        query = c.num_heads * c.head_dim if m.q_lora_rank is None else m.q_lora_rank
        return [query, m.kv_lora_rank + m.qk_rope_head_dim]
    return [rows // 2] * 2
