"""Tiny random DeepSeek-V2/V3 models saved with transformers, and their greedy references.

Not a test module: shared by the DeepSeek tests. As ``hf_models`` does for the Llama
family: built once per process, weights re-drawn so that logits are decisive, every
reference step's top-1/top-2 gap checked. ``*_dense`` variants have no mixture layer
(``first_k_dense_replace`` = the layer count), so they run without ``tokenspeed::moe``.
"""

import functools

import torch
import transformers

from hf_models import EOS, MAX_POS, MIN_GAP, VOCAB, new_tmpdir, randomize

LAYERS = 3
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}

V2 = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
V3 = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
VARIANTS = {
    "v2_dense": (*V2, dict(q_lora_rank=None, first_k_dense_replace=LAYERS,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "v2_biased_dense": (*V2, dict(q_lora_rank=None, first_k_dense_replace=LAYERS, attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "v3_dense": (*V3, dict(q_lora_rank=24, first_k_dense_replace=LAYERS, rope_parameters=dict(YARN))),
    "v3_halves_dense": (*V3, dict(q_lora_rank=24, first_k_dense_replace=LAYERS, rope_interleave=False,
                                  attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "v2_moe": (*V2, dict(q_lora_rank=None, first_k_dense_replace=1, topk_method="group_limited_greedy",
                         n_group=4, topk_group=2, routed_scaling_factor=1.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "v3_moe": (*V3, dict(q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, rope_parameters=dict(YARN))),
}
SEED = 9


def hf_config(variant: str):
    config_cls, _, extra = VARIANTS[variant]
    return config_cls(**{**_COMMON, **extra})


@functools.lru_cache(maxsize=None)
def hf_model(variant: str):
    """(HF model in eval mode, checkpoint directory); the V3 gates' score-correction
    biases drawn too (a buffer ``randomize`` leaves at zero)."""
    _, model_cls, _ = VARIANTS[variant]
    torch.manual_seed(1234)
    model = randomize(model_cls(hf_config(variant)).to(torch.float32).eval(), seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    path = new_tmpdir(f"ts_hf_{variant}_")
    model.save_pretrained(path)
    return model, path


def checkpoint(variant: str):
    return hf_model(variant)[1]


@functools.lru_cache(maxsize=None)
def _reference_one(variant: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model, _ = hf_model(variant)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    for step, logits in enumerate(out.logits):
        top2 = logits[0].float().topk(2).values
        if float(top2[0] - top2[1]) < MIN_GAP:
            raise AssertionError(f"{variant}: ambiguous reference at step {step}; change the seed")
    return tuple(out.sequences[0, len(prompt):].tolist())


def reference(variant: str, prompts, max_new_tokens: int) -> list[tuple[int, ...]]:
    return [_reference_one(variant, tuple(int(t) for t in p), max_new_tokens) for p in prompts]
