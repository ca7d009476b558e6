"""The model configuration tokenspeed understands, read from a Hugging Face config.json."""

import attrs

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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

    def __attrs_post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in "
                             f"[0, num_hidden_layers={self.num_layers})")

    def kv_source_layer(self, layer: int) -> int:
        """The layer whose cache ``layer`` reads: itself, or the last non-shared layer."""
        last_writer = self.num_layers - self.num_kv_shared_layers - 1
        return min(layer, last_writer)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        arch = (hf.get("architectures") or ["<none>"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = hf["num_attention_heads"]
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM", rope_scaling=_rope_scaling(hf),
            num_kv_shared_layers=hf.get("num_kv_shared_layers", 0), eos_token_ids=eos_ids(hf))


def eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def _rope_parameters(hf: dict) -> dict:
    """transformers 5 moved rope settings into ``rope_parameters``; older configs use
    ``rope_theta`` and ``rope_scaling`` at the top level."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: dict) -> float:
    return float(_rope_parameters(hf).get("rope_theta") or hf.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict) -> RopeScaling | None:
    params = _rope_parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, llama3")
    return RopeScaling(factor=params["factor"], low_freq_factor=params["low_freq_factor"],
                       high_freq_factor=params["high_freq_factor"],
                       original_max_position_embeddings=params["original_max_position_embeddings"])
