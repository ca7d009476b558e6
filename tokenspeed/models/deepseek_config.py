"""DeepSeek-V2/V3 config fields: multi-head latent attention, its rotary (plain or YaRN,
interleaved pairs or halves) and the routed experts, read as transformers 5 applies them.

Where transformers' DeepSeek ignores a field that DeepSeek's own code reads (V2's
``scoring_func`` and ``norm_topk_prob``, ``moe_layer_freq``), a value that would change
the result under either reading is refused by name: the checkpoint is ambiguous.
"""

import functools
import math

import attrs

DEEPSEEK_V2, DEEPSEEK_V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
TOPK_METHODS = {DEEPSEEK_V2: ("greedy", "group_limited_greedy"), DEEPSEEK_V3: ("noaux_tc",)}
SCORING = {DEEPSEEK_V2: "softmax", DEEPSEEK_V3: "sigmoid"}
ROPE_TYPES = ("default", "yarn")
MOE_DEFAULTS = {   # transformers' DeepseekV2Config / DeepseekV3Config (None: no default, required)
    DEEPSEEK_V2: dict(n_routed_experts=64, num_experts_per_tok=None, moe_intermediate_size=1407, n_shared_experts=2,
                      first_k_dense_replace=0, routed_scaling_factor=1.0, n_group=None, topk_group=None),
    DEEPSEEK_V3: dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                      first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8, topk_group=4),
}
RMS_EPS = 1e-6   # transformers builds q_a_layernorm and kv_a_layernorm with the default eps


@attrs.frozen
class Yarn:
    """YaRN frequency scaling (the fields transformers' ``_compute_yarn_parameters`` reads)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0     # multiplies cos and sin of every angle


@attrs.frozen
class MlaConfig:
    """A layer's latent attention: queries through ``q_lora_rank`` (None: one projection),
    keys and values through the cached ``kv_lora_rank`` latent, the rotary part of the key
    (``qk_rope_head_dim``) shared by every head."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool    # rotary pairs are adjacent elements (DeepSeek's layout)
    scale: float             # the softmax scale: qk_head_dim ** -0.5, times YaRN's mscale_all_dim squared
    yarn: Yarn | None = None

    @property
    def cache_values(self) -> int:
        """Values one token holds in one layer's cache: its latent and its rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@attrs.frozen
class DeepseekMoe:
    """Which layers are mixtures (``first_k_dense_replace`` on) and how tokens are routed."""
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    topk_method: str          # greedy | group_limited_greedy (softmax) | noaux_tc (sigmoid, biased)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"unsupported config {field}={value!r}: {why}")


def mla_config(hf: dict, arch: str, rope: dict) -> MlaConfig:
    """``rope``: the rope settings (``rope_parameters`` or ``rope_scaling``).
    ``num_key_value_heads`` means nothing here: every head's key and value come from the
    one latent (transformers' own default of 128 for a 4-head model changes nothing)."""
    if arch == DEEPSEEK_V2 and hf.get("rope_interleave") is False:
        raise _unsupported("rope_interleave", False, "transformers' DeepseekV2 always rotates interleaved pairs")
    nope, rot = _size(hf, "qk_nope_head_dim", 128), _size(hf, "qk_rope_head_dim", 64)
    yarn = yarn_scaling(rope, hf)
    return MlaConfig(q_lora_rank=_optional_size(hf, "q_lora_rank", 1536), kv_lora_rank=_size(hf, "kv_lora_rank", 512),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=_size(hf, "v_head_dim", 128),
                     attention_bias=bool(hf.get("attention_bias", False)),
                     rope_interleave=hf.get("rope_interleave", True) is not False,
                     scale=(nope + rot) ** -0.5 * _mscale_all_dim(rope, yarn) ** 2, yarn=yarn)


def _size(hf: dict, field: str, default: int) -> int:
    value = hf.get(field, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config field {field}={value!r} is not valid: expected an integer >= 1")
    return value


def _optional_size(hf: dict, field: str, default: int) -> int | None:
    return None if field in hf and hf[field] is None else _size(hf, field, default)


def rope_type(rope: dict) -> str:
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported config rope_type={kind!r} (rope_parameters or rope_scaling); "
                         f"DeepSeek supports: {', '.join(ROPE_TYPES)}")
    return kind


def yarn_scaling(rope: dict, hf: dict) -> Yarn | None:
    """As transformers: ``factor`` defaults to max_position_embeddings over the original
    length; the cos/sin factor is ``attention_factor``, else mscale over mscale_all_dim."""
    if rope_type(rope) == "default":
        return None
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_type='yarn' is missing original_max_position_embeddings in rope_parameters")
    factor = rope.get("factor") or hf.get("max_position_embeddings", 4096) / original
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = _mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim else _mscale(factor)
    return Yarn(float(factor), original, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                bool(rope.get("truncate", True)), float(attention))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mscale_all_dim(rope: dict, yarn: Yarn | None) -> float:
    """The softmax scale's YaRN factor (transformers' ``yarn_apply_mscale``)."""
    if yarn is None or not rope.get("mscale_all_dim"):
        return 1.0
    return _mscale(yarn.factor, rope["mscale_all_dim"])


def deepseek_moe_config(hf: dict, arch: str) -> DeepseekMoe:
    """Absent fields take transformers' defaults for ``arch`` (``MOE_DEFAULTS``)."""
    method = _topk_method(hf, arch)
    _check_v2_routing(hf, arch)
    if hf.get("moe_layer_freq", 1) != 1:
        raise _unsupported("moe_layer_freq", hf["moe_layer_freq"], "transformers makes every layer from "
                                                                  "first_k_dense_replace on a mixture (1 only)")
    field = functools.partial(_moe_field, hf, arch)
    n_experts = _size(hf, "n_routed_experts", field("n_routed_experts"))
    n_group, topk_group = _groups(hf, arch, method, n_experts)
    k = _size(hf, "num_experts_per_tok", field("num_experts_per_tok"))
    if (field("first_k_dense_replace") or 0) < hf.get("num_hidden_layers", 0):   # a layer routes
        _check_kept_experts(method, n_experts // n_group, topk_group, k)
    return DeepseekMoe(n_routed_experts=n_experts, num_experts_per_tok=k,
                       moe_intermediate_size=_size(hf, "moe_intermediate_size", field("moe_intermediate_size")),
                       n_shared_experts=field("n_shared_experts") or 0,
                       first_k_dense_replace=field("first_k_dense_replace") or 0, topk_method=method,
                       n_group=n_group, topk_group=topk_group,
                       norm_topk_prob=arch == DEEPSEEK_V3 and bool(hf.get("norm_topk_prob", True)),
                       routed_scaling_factor=float(field("routed_scaling_factor")))


def _moe_field(hf: dict, arch: str, name: str):
    return hf[name] if name in hf else MOE_DEFAULTS[arch][name]


def _groups(hf: dict, arch: str, method: str, n_experts: int) -> tuple[int, int]:
    """(n_group, topk_group): one group of every expert for plain top-k."""
    if method == "greedy":
        return 1, 1
    n_group = _size(hf, "n_group", _moe_field(hf, arch, "n_group"))
    topk_group = _size(hf, "topk_group", _moe_field(hf, arch, "topk_group"))
    if n_experts % n_group or topk_group > n_group:
        raise ValueError(f"config n_group={n_group}, topk_group={topk_group} do not fit n_routed_experts="
                         f"{n_experts}: expected a divisor of the experts and topk_group <= n_group")
    return n_group, topk_group


def _check_kept_experts(method: str, per_group: int, topk_group: int, k: int) -> None:
    """transformers would fail at the first token (a top-k past its input) for these."""
    if k > per_group * topk_group:
        raise ValueError(f"config num_experts_per_tok={k} exceeds the {per_group * topk_group} experts of the "
                         f"topk_group groups that {method} keeps")
    if method == "noaux_tc" and per_group < 2:
        raise ValueError(f"config n_group makes groups of {per_group} expert: noaux_tc ranks a group by its "
                         f"two best experts (at least 2 a group)")


def _topk_method(hf: dict, arch: str) -> str:
    """V2 reads ``topk_method``; V3 always routes by noaux_tc (and refuses another name)."""
    allowed = TOPK_METHODS[arch]
    method = hf.get("topk_method") or allowed[0]
    if method not in allowed:
        raise _unsupported("topk_method", method, f"{arch} routes by {', '.join(allowed)}")
    scoring = hf.get("scoring_func")
    if scoring is not None and scoring != SCORING[arch]:
        raise _unsupported("scoring_func", scoring, f"{arch} scores experts by {SCORING[arch]}")
    return method


def _check_v2_routing(hf: dict, arch: str) -> None:
    """DeepSeek's V2 code normalises the top-k weights when ``norm_topk_prob`` is set;
    transformers' does not: refused rather than guessed."""
    if arch == DEEPSEEK_V2 and hf.get("norm_topk_prob"):
        raise _unsupported("norm_topk_prob", hf["norm_topk_prob"], "transformers' DeepseekV2 never normalises "
                                                                  "the top-k weights (false only)")
