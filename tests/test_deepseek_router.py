"""DeepSeek's router against transformers' own gates on random inputs: the same experts
for every token, the same weights to 1e-6; and the config fields it refuses by name."""

import copy

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from tokenspeed.models.config import ModelConfig
from tokenspeed.models.deepseek_routing import DeepseekRouter

from deepseek_models import hf_config

GATES = {"v2_moe": transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter,
         "v3_moe": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter}
SETTINGS = {
    "v2 greedy": ("v2_moe", dict(topk_method="greedy")),
    "v2 group_limited_greedy": ("v2_moe", {}),
    "v3 noaux_tc": ("v3_moe", {}),
    "v3 noaux_tc unnormalised": ("v3_moe", dict(norm_topk_prob=False, routed_scaling_factor=1.0)),
    "v2 group_limited_greedy, 3 of 8 groups of 20": ("v2_moe", dict(n_routed_experts=160, n_group=8, topk_group=3,
                                                                     num_experts_per_tok=6)),
    "v3 noaux_tc, 3 of 8 groups of 8": ("v3_moe", dict(n_routed_experts=64, n_group=8, topk_group=3,
                                                       num_experts_per_tok=6)),
}


def routers(name: str, seed: int):
    variant, changes = SETTINGS[name]
    hf = hf_config(variant)
    for field, value in changes.items():
        setattr(hf, field, value)
    theirs = GATES[variant](hf)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=gen))
        if hasattr(theirs, "e_score_correction_bias"):
            theirs.e_score_correction_bias.copy_(0.3 * torch.randn(theirs.weight.shape[0], generator=gen))
    ours = DeepseekRouter(hf.hidden_size, ModelConfig.from_hf(hf.to_dict()).deepseek_moe)
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items()})
    return ours, theirs


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(SETTINGS)), seed=st.integers(0, 2**16), rows=st.integers(1, 40))
def test_each_token_gets_transformers_experts_and_weights(name, seed, rows):
    ours, theirs = routers(name, seed)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed + 1))
    weights, ids = ours(x)
    _, want_weights, want_ids = theirs(x)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=0, atol=1e-6)
    assert weights.dtype == torch.float32


def _config(variant: str, **changes) -> dict:
    hf = copy.deepcopy(hf_config(variant).to_dict())
    hf.update(changes)
    return hf


@pytest.mark.parametrize("variant, changes, message", [
    ("v2_moe", dict(norm_topk_prob=True), "norm_topk_prob=True"),
    ("v2_moe", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("v2_moe", dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    ("v3_moe", dict(topk_method="greedy"), "topk_method='greedy'"),
    ("v3_moe", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("v3_moe", dict(moe_layer_freq=2), "moe_layer_freq=2"),
    ("v3_moe", dict(n_group=3), "n_group=3"),
    ("v3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the 4 experts"),
    ("v3_moe", dict(n_group=8, topk_group=2), "groups of 1 expert"),
    ("v3_moe", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope_type='llama3'"),
    ("v2_moe", dict(rope_interleave=False), "rope_interleave=False"),
    ("v3_moe", dict(kv_lora_rank="32"), "kv_lora_rank='32'"),
    ("v3_moe", dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}),
     "unsupported config quantization_config"),
])
def test_a_field_that_would_change_the_result_is_refused_by_name(variant, changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf(_config(variant, **changes))


def test_yarn_scales_the_softmax_by_mscale_all_dim_squared():
    config = ModelConfig.from_hf(_config("v3_moe"))
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert config.mla.scale == pytest.approx((16 + 16) ** -0.5 * mscale ** 2)
    assert config.mla.yarn.attention_factor == pytest.approx(1.0)       # mscale == mscale_all_dim
    assert config.cache_row == (1, 1, 32 + 16)


def test_the_gate_stays_float32_in_a_bfloat16_model():
    from tokenspeed.models.loader import build
    model = build(ModelConfig.from_hf(_config("v3_moe")), dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["v2_moe", "v3_moe"])
def test_absent_routing_fields_take_transformers_defaults(variant):
    """A config.json without the routing fields reads as transformers' config class fills them."""
    full = hf_config(variant).__class__(num_experts_per_tok=6).to_dict()
    kept = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_experts_per_tok", "n_group", "topk_group")
    sparse = {k: v for k, v in full.items() if k in kept and v is not None}
    assert ModelConfig.from_hf(sparse).deepseek_moe == ModelConfig.from_hf(full).deepseek_moe
