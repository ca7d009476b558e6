"""What a mixture of experts' decode step must read, and what its cache holds: the floor
beside ``moe_decode``'s times, and the latent cache against its multi-head equivalent.

A step reads every weight but the routed experts whole; of those, only the experts some
token of the batch picks. The routing of a compiled run is not read back, so the floor
takes its expectation for uniform routing (random weights route near uniformly): a layer
of E experts, k a token, has E * (1 - (1 - k/E) ** batch) of them touched.
"""

import attrs

from benchmarks import common

ROUTING = "uniform expectation"   # how the floor counts the touched experts (the JSON says so)


@attrs.frozen
class Routing:
    """A sparse layer's routed experts and how many of them a token takes."""
    experts: int
    top_k: int

    def touched_fraction(self, tokens: int) -> float:
        """Expected share of a layer's experts that ``tokens`` tokens, each picking ``top_k``
        distinct experts uniformly, touch at least once."""
        return 1.0 - (1.0 - self.top_k / self.experts) ** tokens


def is_mixture(config) -> bool:
    return config.moe is not None or config.deepseek_moe is not None


def routing_of(config) -> Routing:
    """The routing of a Mixtral / Qwen3-MoE (``moe``) or DeepSeek (``deepseek_moe``) config."""
    if config.moe is not None:
        return Routing(config.moe.num_experts, config.moe.top_k)
    if config.deepseek_moe is not None:
        return Routing(config.deepseek_moe.n_routed_experts, config.deepseek_moe.num_experts_per_tok)
    raise ValueError(f"{config.architecture} has no routed experts: the MoE benchmark measures mixtures only")


def routed_bytes(model) -> int:
    """Bytes of every sparse layer's routed experts (the stacked ``experts.w13`` and ``w2``);
    shared experts are dense weights, read by every step."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if name.endswith((".experts.w13", ".experts.w2")))


def step_bytes(model, batch: int, context: int) -> float:
    """A decode step's floor in bytes: the dense weights (attention, shared experts, routers,
    norms, head), the routed experts ``batch`` tokens are expected to touch, and the cache of
    ``batch`` sequences of ``context`` tokens."""
    routed = routed_bytes(model)
    element = next(model.parameters()).element_size()
    touched = routed * routing_of(model.config).touched_fraction(batch)
    return common.weight_bytes(model) - routed + touched + common.kv_bytes(model.config, batch, context, element)


def kv_bytes_per_token(config, element_size: int) -> int:
    """Cache bytes one token holds over all layers (a latent row for MLA, keys and values else)."""
    return common.kv_bytes(config, batch=1, context=1, element_size=element_size)


def multi_head_kv_bytes_per_token(config, element_size: int) -> int:
    """The same attention's cache with a key and a value per head, none shared: heads x
    (qk_head_dim + v_head_dim) x layers x dtype bytes."""
    if config.mla is not None:
        per_head = config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim + config.mla.v_head_dim
    else:
        per_head = 2 * config.head_dim
    return config.num_heads * per_head * config.num_layers * element_size


def sequences_that_fit(bytes_per_token: int, tokens: int, memory_bytes: int) -> int:
    """Whole sequences of ``tokens`` tokens whose cache fits in ``memory_bytes``."""
    return memory_bytes // (bytes_per_token * tokens)
