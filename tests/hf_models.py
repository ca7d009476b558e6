"""Tiny random-weight Hugging Face models and their greedy reference continuations.

Not a test module: helpers shared by the parity, loader and error tests.

Every variant is built once per process (``functools.lru_cache``), saved with
``save_pretrained`` into its own ``tempfile.mkdtemp`` directory (removed at exit), and
its references come from ``model.generate(..., do_sample=False)`` one prompt at a time,
without padding. All weights (norms and biases included) are re-drawn from a fixed
seed with a scale that makes logits decisive, and every reference step's top-1/top-2
logit gap is checked, so float-rounding differences cannot flip a greedy token.
"""

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

VOCAB = 384
MAX_POS = 256
EOS = 2
MIN_GAP = 1e-3     # smallest top-1/top-2 logit gap accepted in a reference step

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               max_position_embeddings=MAX_POS, bos_token_id=1, eos_token_id=EOS,
               pad_token_id=0, tie_word_embeddings=False)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name -> (config class, model class, extra config kwargs)
VARIANTS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(rope_parameters=dict(LLAMA3_ROPE))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_parameters={"rope_type": "default", "rope_theta": 2000.0})),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 3000.0})),
    "tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
             dict(tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "head_dim": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                 dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # sliding windows several times shorter than the long prompts: every layer, and mixed
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "qwen3_window": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                     dict(head_dim=16, use_sliding_window=True, sliding_window=12,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 3000.0})),
    # mixtures of experts: every layer sparse (Mixtral, windowed); a dense layer among sparse ones
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                       norm_topk_prob=True, mlp_only_layers=[1],
                       rope_parameters={"rope_type": "default", "rope_theta": 3000.0})),
    # hybrid: gated-DeltaNet layers beside a gated attention layer; experts with a shared one,
    # a dense layer among them; partial rotary
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=40, mlp_only_layers=[2],
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 3000.0,
                                         "partial_rotary_factor": 0.5})),
}
if hasattr(transformers, "Qwen3_5ForCausalLM"):   # transformers >= 5.2: dense MLPs, separate linear projections
    VARIANTS["qwen3_5"] = (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                           dict(num_hidden_layers=3, head_dim=16,
                                layer_types=["linear_attention", "full_attention", "linear_attention"],
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                rope_parameters={"rope_type": "default", "rope_theta": 3000.0,
                                                 "partial_rotary_factor": 0.5}))

# weight seeds, chosen so every reference used by the tests has a clear top-1 token
SEEDS = {"llama": 9, "llama3_rope": 9, "qwen2": 11, "qwen3": 9, "tied": 7, "head_dim": 9, "mistral": 9,
         "qwen3_window": 9, "mixtral": 9, "qwen3_moe": 9, "qwen3_next": 3, "qwen3_5": 9}

_DIRS: list[str] = []


@atexit.register
def _cleanup() -> None:
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)


def new_tmpdir(prefix: str = "ts_hf_") -> Path:
    """A fresh directory removed when the process exits."""
    d = tempfile.mkdtemp(prefix=prefix)
    _DIRS.append(d)
    return Path(d)


def hf_config(variant: str):
    config_cls, _, extra = VARIANTS[variant]
    return config_cls(**{**_COMMON, **extra})


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    biases ~ N(0, 0.1^2) (never zero), norm weights ~ 1 + N(0, 0.2^2) (never all ones)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


@functools.lru_cache(maxsize=None)
def hf_model(variant: str):
    """(HF model in eval mode, checkpoint directory) for ``variant``; built once."""
    _, model_cls, _ = VARIANTS[variant]
    torch.manual_seed(1234)
    model = model_cls(hf_config(variant)).to(torch.float32).eval()
    randomize(model, seed=SEEDS[variant])
    if variant == "qwen2":
        assert all(model.model.layers[0].self_attn.q_proj.bias != 0)
    if variant == "qwen3":
        assert not torch.all(model.model.layers[0].self_attn.q_norm.weight == 1)
    if variant == "qwen3_next":   # zero-centred: 1 + N(0, 0.2^2) here is a scale of 2 + N(0, 0.2^2)
        assert model.model.layers[0].linear_attn.conv1d.weight.shape[1] == 1
    if variant == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    path = new_tmpdir(f"ts_hf_{variant}_")
    model.save_pretrained(path)
    return model, path


def checkpoint(variant: str) -> Path:
    return hf_model(variant)[1]


def copy_checkpoint(variant: str) -> Path:
    """A private, editable copy of a variant's checkpoint directory."""
    dst = new_tmpdir(f"ts_hf_{variant}_copy_")
    shutil.copytree(checkpoint(variant), dst, dirs_exist_ok=True)
    return dst


def edit_config(path: Path, **changes) -> dict:
    """Rewrite ``config.json``: keys set to ``None`` in ``changes`` are removed."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (Path(path) / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


_NO_EOS = object()


@functools.lru_cache(maxsize=None)
def _reference_one(variant: str, prompt: tuple[int, ...], max_new_tokens: int, eos) -> tuple[int, ...]:
    model, _ = hf_model(variant)
    gen_cfg = model.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = None if eos is _NO_EOS else list(eos) if isinstance(eos, tuple) else eos
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
    finally:
        gen_cfg.eos_token_id = saved
    new = out.sequences[0, len(prompt):].tolist()
    assert len(new) == len(out.logits)
    for step, logits in enumerate(out.logits):
        top2 = logits[0].float().topk(2).values
        gap = float(top2[0] - top2[1])
        if gap < MIN_GAP:
            raise AssertionError(f"{variant}: ambiguous reference at step {step} of prompt "
                                 f"{prompt[:8]}... (top-2 gap {gap:.2e}); change the seed")
    return tuple(new)


def reference(variant: str, prompts, max_new_tokens: int, eos=EOS) -> list[tuple[int, ...]]:
    """HF greedy continuations (new tokens only), stopping after ``eos`` like HF does.
    ``eos=None`` disables the end-of-sequence stop (pure max_new_tokens)."""
    key = _NO_EOS if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else eos
    return [_reference_one(variant, tuple(int(t) for t in p), max_new_tokens, key) for p in prompts]


def make_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Deterministic random prompts of the given lengths; ids in [3, vocab), so never
    the pad (0), bos (1) or eos (2) token."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
