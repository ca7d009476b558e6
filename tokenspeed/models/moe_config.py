"""The mixture-of-experts settings of a config.json (Mixtral, Qwen3-MoE), checked as
``config.py`` checks the rest: each field that changes the computation is read, or the
config is refused naming it.

Which layers are sparse follows transformers: Mixtral's every layer; Qwen3-MoE's (and
Qwen3-Next's) layer i
unless it is in ``mlp_only_layers``, when ``num_experts > 0`` and ``(i + 1) %
decoder_sparse_step == 0``. The dense layers keep the plain MLP of ``intermediate_size``.
"""

import attrs

from tokenspeed.models.config_values import Accepted, invalid
from tokenspeed.models.hybrid_config import QWEN3_NEXT

MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN3_MOE, QWEN3_NEXT)
NORMALIZED_BY_DEFAULT = (MIXTRAL, QWEN3_NEXT)   # transformers' norm_topk_prob where a config has none
FIELDS = {"num_local_experts": Accepted(int, 0), "num_experts": Accepted(int, 0),
          "num_experts_per_tok": Accepted(int, 1), "moe_intermediate_size": Accepted(int, 1),
          "decoder_sparse_step": Accepted(int, 1), "norm_topk_prob": Accepted(bool)}


@attrs.frozen
class MoeConfig:
    """E experts of width ``intermediate_size`` each, ``top_k`` of them a token, their
    softmax probabilities renormalised over the top k where ``normalize_top_k``; only the
    ``sparse_layers`` have experts."""
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[int, ...]

    def __attrs_post_init__(self):
        if self.top_k > self.num_experts:
            raise ValueError(f"config field num_experts_per_tok={self.top_k} is not valid: expected "
                             f"at most the number of experts ({self.num_experts})")


def moe_config(hf: dict, arch: str) -> MoeConfig | None:
    """The settings of an architecture with experts (``None``: none, or no sparse layer)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    _check_values(hf)
    experts = _num_experts(hf)
    layers = _sparse_layers(hf, arch, experts)
    if not layers:
        return None
    width = hf["intermediate_size"] if arch == MIXTRAL else _required(hf, "moe_intermediate_size")
    return MoeConfig(num_experts=experts, top_k=_required(hf, "num_experts_per_tok"), intermediate_size=width,
                     normalize_top_k=arch == MIXTRAL or bool(hf.get("norm_topk_prob", arch in NORMALIZED_BY_DEFAULT)),
                     sparse_layers=layers)


def _check_values(hf: dict) -> None:
    for field, accepted in FIELDS.items():
        if hf.get(field) is not None and not accepted.admits(hf[field]):
            raise invalid(field, hf[field], accepted.describe())


def _required(hf: dict, field: str):
    if hf.get(field) is None:
        raise ValueError(f"config is missing required field {field} (a mixture of experts)")
    return hf[field]


def _num_experts(hf: dict) -> int:
    """transformers 5 writes ``num_local_experts`` for both; Qwen's own configs ``num_experts``."""
    found = hf.get("num_local_experts", hf.get("num_experts"))
    if found is None:
        raise ValueError("config is missing required field num_local_experts (or num_experts)")
    return found


def _sparse_layers(hf: dict, arch: str, experts: int) -> tuple[int, ...]:
    layers = hf["num_hidden_layers"]
    if arch == MIXTRAL and experts == 0:
        raise invalid("num_local_experts", experts, "at least 1 expert (Mixtral's every layer has experts)")
    if arch == MIXTRAL:
        return tuple(range(layers))
    dense, step = hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step") or 1
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise invalid("mlp_only_layers", dense, f"a list of layer indices in [0, {layers})")
    return tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
