"""The model configuration tokenspeed understands, read from a Hugging Face config.json.

Strict: every config field that changes the computation is either implemented here or
rejected with a ValueError naming the field and its value. A checkpoint the engine
cannot honour fails at load instead of generating wrong tokens.
"""

import attrs

from tokenspeed.ir.cache_groups import CacheGroup, cache_groups
from tokenspeed.models.config_values import Accepted, check_values, invalid
from tokenspeed.models.deepseek_config import (DEEPSEEK_V2, DEEPSEEK_V3, DeepseekMoe, MlaConfig, mla_config,
                                               deepseek_moe_config)
from tokenspeed.models.fp8_scheme import fp8_scheme
from tokenspeed.models.hybrid_config import HYBRID_ARCHITECTURES, QWEN3_5, QWEN3_NEXT, HybridConfig, hybrid_config
from tokenspeed.models.moe_config import MIXTRAL, MOE_ARCHITECTURES, QWEN3_MOE, MoeConfig, moe_config

DEEPSEEK = (DEEPSEEK_V2, DEEPSEEK_V3)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           MIXTRAL, QWEN3_MOE, *DEEPSEEK, QWEN3_NEXT, QWEN3_5)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE,
               "deepseek_v2": DEEPSEEK_V2, "deepseek_v3": DEEPSEEK_V3, "qwen3_next": QWEN3_NEXT,
               "qwen3_5_text": QWEN3_5}
LAYER_TYPES = ("full_attention", "sliding_attention")
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", QWEN3_MOE)
QK_NORM = ("Qwen3ForCausalLM", QWEN3_MOE, *HYBRID_ARCHITECTURES)
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # transformers runs both as torch's SiLU
SUPPORTED_ROPE_TYPES = ("default", "llama3")
ORIGINAL = "original_max_position_embeddings"


@attrs.frozen
class RopeScaling:
    """Llama 3 frequency scaling; ``None`` in ModelConfig means plain RoPE."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    num_kv_shared_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    layer_windows: tuple[int, ...] = ()   # each layer's sliding window, 0 for none; () for none at all
    moe: MoeConfig | None = None          # the experts of a mixture of experts' sparse layers
    mla: MlaConfig | None = None          # DeepSeek's latent attention (None: keys and values per head)
    deepseek_moe: DeepseekMoe | None = None
    hybrid: HybridConfig | None = None    # gated-DeltaNet layers beside gated attention (Qwen3-Next)

    def __attrs_post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in "
                             f"[0, num_hidden_layers={self.num_layers})")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        past = [i for i in self.eos_token_ids if i >= self.vocab_size]   # masked by min_tokens: a bad index
        if past:
            raise ValueError(f"eos_token_id={past if len(past) > 1 else past[0]} lies past the vocabulary "
                             f"(vocab_size={self.vocab_size}): no token the model scores")

    @property
    def cache_row(self) -> tuple[int, int, int]:
        """One token's cache in one layer as (parts, heads, values per head): a key and a
        value per KV head, or one latent row (latent + rotary key) with no heads."""
        if self.mla is not None:
            return 1, 1, self.mla.cache_values
        return 2, self.num_kv_heads, self.head_dim

    @property
    def cache_groups(self) -> tuple[CacheGroup, ...]:
        """The layers whose caches keep the same positions, grouped (``cache_groups``)."""
        if self.hybrid is not None:   # the attention layers' caches only, in one group (no windows)
            return (CacheGroup(0, self.attention_layers),)
        owners = {layer for layer in range(self.num_layers) if self.kv_source_layer(layer) == layer}
        return cache_groups({layer: self.retention_of(layer) for layer in owners}, self.num_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over a cache (a hybrid model's others are recurrent)."""
        linear = self.hybrid.linear.layers if self.hybrid is not None else ()
        return tuple(layer for layer in range(self.num_layers) if layer not in linear)

    def retention_of(self, layer: int) -> int:
        """Positions behind a row that some reader of ``layer``'s cache reads (0: all): a
        full-attention layer reading a windowed layer's cache keeps it whole."""
        source = self.kv_source_layer(layer)
        windows = [self.window_of(r) for r in range(self.num_layers) if self.kv_source_layer(r) == source]
        return 0 if 0 in windows else max(windows)

    def window_of(self, layer: int) -> int:
        """The sliding window of ``layer``'s attention (0: the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_source_layer(self, layer: int) -> int:
        """The layer whose cache ``layer`` reads: itself, or the last non-shared layer."""
        last_writer = self.num_layers - self.num_kv_shared_layers - 1
        return min(layer, last_writer)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Raises ValueError naming the field for anything missing or not supported."""
        arch = architecture(hf)
        check_supported(hf)
        heads = hf["num_attention_heads"]
        if arch in DEEPSEEK:
            return _deepseek(cls, hf, arch)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf),
            max_position_embeddings=_max_positions(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
            qk_norm=arch in QK_NORM, rope_scaling=_rope_scaling(hf),
            num_kv_shared_layers=hf.get("num_kv_shared_layers", 0), eos_token_ids=eos_ids(hf),
            layer_windows=layer_windows(hf, arch), moe=moe_config(hf, arch),
            hybrid=hybrid_config(hf, arch, head_dim, _rope_parameters(hf)) if arch in HYBRID_ARCHITECTURES else None)


def _deepseek(cls, hf: dict, arch: str) -> ModelConfig:
    """Latent attention: ``head_dim`` is the query/key head (nope + rope), as transformers'
    ``qk_head_dim``; the rotary's settings live in ``mla`` (YaRN among them)."""
    if hf.get("quantization_config"):
        raise _unsupported("quantization_config", hf["quantization_config"], "DeepSeek loads 16-bit and "
                           "float32 weights only (the latent attention reads kv_b_proj's weight as stored)")
    mla = mla_config(hf, arch, _rope_parameters(hf))
    return cls(
        architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_attention_heads"],
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf), max_position_embeddings=_max_positions(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_token_ids=eos_ids(hf),
        mla=mla, deepseek_moe=deepseek_moe_config(hf, arch))


def architecture(hf: dict) -> str:
    """``architectures[0]`` (a plain string is one name), else the one ``model_type`` names."""
    names = hf.get("architectures")
    names = [names] if isinstance(names, str) else names or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"config field architectures={hf['architectures']!r} is not valid: expected a "
                         f"list of class names")
    arch = names[0] if names else MODEL_TYPES.get(hf.get("model_type"))
    if arch in SUPPORTED_ARCHITECTURES:
        return arch
    found = repr(arch) if arch else f"(none given, model_type={hf.get('model_type')!r})"
    raise ValueError(f"unsupported architecture {found}; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)} (or model_type {', '.join(MODEL_TYPES)})")


def check_supported(hf: dict) -> None:
    """Every field tokenspeed does not implement, rejected when it would change the result."""
    missing = [f for f in REQUIRED_FIELDS if hf.get(f) is None]
    if missing:
        raise ValueError(f"config is missing required field(s) {', '.join(missing)}")
    for check in (check_values, _check_activation, _check_biases, _check_rope, _check_quantization):
        check(hf)


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"unsupported config {field}={value!r}: {why}")


def _check_activation(hf: dict) -> None:
    for field in ("hidden_act", "hidden_activation"):
        if hf.get(field) is not None and hf[field] not in SUPPORTED_ACTIVATIONS:
            raise _unsupported(field, hf[field], "tokenspeed's MLP is SiLU-gated (silu only)")


def _check_biases(hf: dict) -> None:
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias", hf["mlp_bias"], "the MLP projections have no bias")


def _check_rope(hf: dict) -> None:
    params = _rope_parameters(hf)
    for factor in (hf.get("partial_rotary_factor"), params.get("partial_rotary_factor")):
        if factor is not None and factor != 1 and architecture(hf) not in HYBRID_ARCHITECTURES:
            raise _unsupported("partial_rotary_factor", factor, "RoPE rotates the whole head (1.0 only)")
    kind = _rope_type(params)
    if architecture(hf) in DEEPSEEK:
        return   # DeepSeek's own rope types: deepseek_config.rope_type
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported config rope_type={kind!r} (rope_parameters or rope_scaling); "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def layer_windows(hf: dict, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers reads the config: Qwen windows the
    ``layer_types`` marked ``sliding_attention`` (derived from ``max_window_layers`` when
    absent) if ``use_sliding_window``; Mistral windows every layer, unless ``layer_types``
    says otherwise: transformers' ``AutoConfig`` reads such a config as Ministral, whose
    layers follow ``layer_types`` (as vLLM's Mistral does). () when none binds: a window
    that spans every position the model takes changes nothing. Llama has no sliding
    window in transformers, so one there is refused rather than guessed. Mixtral and
    Qwen3-MoE window every layer by ``sliding_window`` alone (their attention reads no
    ``layer_types`` nor ``max_window_layers``)."""
    window, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    if arch in HYBRID_ARCHITECTURES:   # layer_types names linear and full layers (hybrid_config)
        if window is not None or hf.get("use_sliding_window"):
            raise _unsupported("sliding_window", window, f"{arch}'s attention has no sliding window")
        return ()
    if arch in QWEN and not hf.get("use_sliding_window"):
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise _unsupported("sliding_window", window, "a window is a number of positions >= 1")
    types = None if arch in MOE_ARCHITECTURES else hf.get("layer_types")
    if types is None:
        first = (hf.get("max_window_layers") or 0) if arch in QWEN and arch not in MOE_ARCHITECTURES else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise _unsupported("layer_types", types, f"expected {n} of {', '.join(LAYER_TYPES)}")
    if window is None or window >= _max_positions(hf):
        return ()
    if arch == "LlamaForCausalLM":
        raise _unsupported("sliding_window", window, "Llama attention has no sliding window (a "
                                                     "Mistral checkpoint is MistralForCausalLM)")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _check_quantization(hf: dict) -> None:
    """FP8 checkpoints load (``fp8_scheme``), but for a mixture of experts, whose experts
    have no FP8 kernel; any other quantization is refused."""
    if hf.get("quantization_config") and architecture(hf) in MOE_ARCHITECTURES:
        raise _unsupported("quantization_config", hf["quantization_config"],
                           f"{architecture(hf)} loads unquantized weights only (no FP8 experts)")
    if hf.get("quantization_config"):
        fp8_scheme(hf["quantization_config"])


def _max_positions(hf: dict) -> int:
    return hf.get("max_position_embeddings") or 4096


def eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def _rope_parameters(hf: dict) -> dict:
    """transformers 5 moved rope settings into ``rope_parameters``; older configs use
    ``rope_theta`` and ``rope_scaling`` at the top level. Settings per layer type (a dict
    of dicts) are rejected: every layer here rotates the same way."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise _unsupported("rope_parameters", params, f"per-layer-type settings {nested}")
    return params


def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type")) or "default"


def _rope_theta(hf: dict) -> float:
    return float(_rope_parameters(hf).get("rope_theta") or hf.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict) -> RopeScaling | None:
    """Llama 3 scaling; the pretraining length comes from where transformers reads it (a
    top-level ``original_max_position_embeddings`` first, then max_position_embeddings)."""
    params = _rope_parameters(hf)
    if _rope_type(params) == "default":
        return None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_type='llama3' is missing {', '.join(missing)} in rope_parameters")
    given = [v for v in (hf.get(ORIGINAL), params.get(ORIGINAL)) if v is not None]
    original = given[0] if given else _max_positions(hf)
    scaling = RopeScaling(factor=params["factor"], low_freq_factor=params["low_freq_factor"],
                          high_freq_factor=params["high_freq_factor"],
                          original_max_position_embeddings=original)
    _check_llama3(scaling)
    return scaling


def _check_llama3(scaling: RopeScaling) -> None:
    """transformers only warns of these; here each would be NaN rotations or a wrong band."""
    for field, accepted in (("factor", Accepted(float, 1)), ("low_freq_factor", Accepted(float, 0, False)),
                            ("high_freq_factor", Accepted(float, 0, False)),
                            ("original_max_position_embeddings", Accepted(int, 1))):
        if not accepted.admits(getattr(scaling, field)):
            raise invalid(f"rope_parameters.{field}", getattr(scaling, field), accepted.describe())
    if scaling.low_freq_factor >= scaling.high_freq_factor:
        raise invalid("rope_parameters.low_freq_factor", scaling.low_freq_factor,
                      f"a factor below high_freq_factor={scaling.high_freq_factor}")
