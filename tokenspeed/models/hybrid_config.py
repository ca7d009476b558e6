"""The settings of a hybrid model (Qwen3-Next, Qwen3.5): gated-DeltaNet layers beside gated
full-attention layers, read from a config.json as ``config.py`` reads the rest: each field
that changes the computation is read, or the config is refused naming it.

Which layers are linear follows transformers: ``layer_types`` (``linear_attention`` or
``full_attention``), or, where a config has none, every ``full_attention_interval``-th layer
attends (default 4). Fields a config leaves out take transformers' defaults for the
architecture (a partial rotary factor of 0.25, renormalised top-k routing).
"""

import attrs

from tokenspeed.models.config_values import Accepted, invalid

QWEN3_NEXT, QWEN3_5 = "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"
HYBRID_ARCHITECTURES = (QWEN3_NEXT, QWEN3_5)
LINEAR, FULL = "linear_attention", "full_attention"
LINEAR_FIELDS = {"linear_num_key_heads": "num_key_heads", "linear_num_value_heads": "num_value_heads",
                 "linear_key_head_dim": "key_head_dim", "linear_value_head_dim": "value_head_dim",
                 "linear_conv_kernel_dim": "conv_kernel"}
POSITIVE = Accepted(int, 1)


@attrs.frozen
class GatedDeltaNetConfig:
    """The linear layers: ``num_value_heads`` heads of recurrent state, each reading key
    head ``j // (num_value_heads // num_key_heads)``; a depthwise convolution of
    ``conv_kernel`` taps over the concatenated q, k and v. ``by_key_head``: the input
    projection's rows grouped by key head (Qwen3-Next's ``in_proj_qkvz``: each key head's q,
    k, then its value heads' v and z), else q, k, v, then z (Qwen3.5's ``in_proj_qkv`` and
    ``in_proj_z``, stacked)."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[int, ...]
    by_key_head: bool = True

    def __attrs_post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise invalid("linear_num_value_heads", self.num_value_heads,
                          f"a multiple of linear_num_key_heads={self.num_key_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_index(self, layer: int) -> int:
        """``layer``'s row in the state pools (the linear layers in order)."""
        return self.layers.index(layer)


@attrs.frozen
class HybridConfig:
    """``rotary_dim``: the leading dimensions of an attention head that RoPE rotates;
    ``shared_expert_size``: the width of the sigmoid-gated shared expert beside the routed
    ones (0: none)."""
    linear: GatedDeltaNetConfig
    rotary_dim: int
    shared_expert_size: int


def layer_types(hf: dict) -> tuple[str, ...]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", 4)
        if not POSITIVE.admits(interval):
            raise invalid("full_attention_interval", interval, POSITIVE.describe())
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if not isinstance(types, list | tuple) or len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        raise invalid("layer_types", types, f"{n} of {LINEAR!r}, {FULL!r}")
    if FULL not in types:
        raise invalid("layer_types", types, f"at least one {FULL!r} layer (the cache's pages are theirs)")
    return tuple(types)


def hybrid_config(hf: dict, arch: str, head_dim: int, rope_parameters: dict) -> HybridConfig:
    types = layer_types(hf)
    values = {}
    for field, ours in LINEAR_FIELDS.items():
        if not POSITIVE.admits(hf.get(field)):
            raise invalid(field, hf.get(field), POSITIVE.describe())
        values[ours] = hf[field]
    linear = GatedDeltaNetConfig(**values, layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
                                 by_key_head=arch == QWEN3_NEXT)
    factor = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * factor) if isinstance(factor, int | float) else 0
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise invalid("partial_rotary_factor", factor, f"a fraction of head_dim={head_dim} that rotates an "
                                                       f"even number of dimensions")
    shared = hf.get("shared_expert_intermediate_size") or 0
    if not Accepted(int, 0).admits(shared):
        raise invalid("shared_expert_intermediate_size", shared, Accepted(int, 0).describe())
    return HybridConfig(linear, rotary_dim, shared)
