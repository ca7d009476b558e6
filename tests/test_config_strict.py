"""A config the engine cannot honour is refused at load, naming the field and its value.

Configs are transformers' own ``to_dict()`` of small Llama / Qwen2 / Qwen3 configs, with
one field changed, so the accepted baseline is what transformers really writes.
"""

import re

import pytest
import torch
import transformers

import tokenspeed as ts
from tokenspeed.models.config import REQUIRED_FIELDS, ModelConfig, RopeScaling

from hf_models import copy_checkpoint, edit_config, make_prompts, new_tmpdir, randomize

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIG_CLASSES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_dict(model_type="llama", /, **changes) -> dict:
    """transformers' config.json content for a small model, ``changes`` applied."""
    cfg = CONFIG_CLASSES[model_type](**SMALL).to_dict()
    cfg["architectures"] = [ARCHITECTURES[model_type]]
    return {**cfg, **changes}


def raises(*fragments):
    """pytest.raises(ValueError) whose message contains every fragment (literally)."""
    return pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(str(f))})"
                                                            for f in fragments))


# (model type, changed fields, field the error names, value it names)
REJECTED = [
    ("llama", {"hidden_act": "gelu"}, "hidden_act", "gelu"),
    ("llama", {"hidden_act": "relu"}, "hidden_act", "relu"),
    ("qwen2", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act", "gelu_pytorch_tanh"),
    ("llama", {"hidden_activation": "gelu"}, "hidden_activation", "gelu"),
    ("llama", {"sliding_window": 128}, "sliding_window", 128),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window", 0),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention", "chunked"]},
     "layer_types", "chunked"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"]},
     "layer_types", "expected 2"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_type", "yarn"),
    ("qwen2", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_type", "linear"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_type", "dynamic"),
    ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type", "longrope"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor", 0.5),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.25}}, "partial_rotary_factor", 0.25),
    ("llama", {"mlp_bias": True}, "mlp_bias", True),
    ("llama", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config", "awq"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "low_freq_factor", "llama3"),
]


@pytest.mark.parametrize("model_type, changes, field, value", REJECTED,
                         ids=[f"{r[0]}-{r[2]}-{r[3]}" for r in REJECTED])
def test_unsupported_field_is_named(model_type, changes, field, value):
    ModelConfig.from_hf(hf_dict(model_type))  # the baseline loads
    with raises(field, value):
        ModelConfig.from_hf(hf_dict(model_type, **changes))


@pytest.mark.parametrize("model_type, changes", [
    ("llama", {"hidden_act": "silu"}),
    ("llama", {"sliding_window": 256}),                      # spans every position: never binds
    ("llama", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 64}),   # Qwen2.5's own configs
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096}),
    ("llama", {"attention_dropout": 0.1}),                   # dropout is off at inference
    ("llama", {"partial_rotary_factor": 1.0}),
    ("llama", {"mlp_bias": False, "pretraining_tp": 2}),
])
def test_fields_that_change_nothing_are_accepted(model_type, changes):
    config = ModelConfig.from_hf(hf_dict(model_type, **changes))
    assert config.architecture == ARCHITECTURES[model_type]


@pytest.mark.parametrize("model_type, changes, windows", [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
               "layer_types": ["full_attention", "sliding_attention"]}, (0, 8)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "layer_types": None,
               "max_window_layers": 1}, (0, 8)),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8,
               "layer_types": ["full_attention", "sliding_attention"]}, ()),   # as transformers: off
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4096,
               "layer_types": ["sliding_attention"] * 2}, ()),                    # never binds
])
def test_sliding_windows_are_read_per_layer(model_type, changes, windows):
    assert ModelConfig.from_hf(hf_dict(model_type, **changes)).layer_windows == windows


def test_mistral_windows_every_layer():
    cfg = transformers.MistralConfig(**SMALL, sliding_window=16).to_dict()
    config = ModelConfig.from_hf({**cfg, "architectures": ["MistralForCausalLM"]})
    assert config.architecture == "MistralForCausalLM" and config.layer_windows == (16, 16)


def test_supported_fields_are_read():
    llama = ModelConfig.from_hf(hf_dict("llama", attention_bias=True, tie_word_embeddings=True))
    assert llama.qkv_bias and llama.o_bias and llama.tie_word_embeddings
    qwen2 = ModelConfig.from_hf(hf_dict("qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert ModelConfig.from_hf(hf_dict("llama", rope_parameters=rope)).rope_scaling == \
        RopeScaling(8.0, 1.0, 4.0, 64)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_model_type_stands_in_for_missing_architectures(model_type):
    for missing in ({"architectures": None}, {"architectures": []}):
        config = ModelConfig.from_hf(hf_dict(model_type, **missing))
        assert config.architecture == ARCHITECTURES[model_type]
    assert ModelConfig.from_hf(hf_dict(model_type, architectures=None)).qk_norm == (model_type == "qwen3")


def test_architectures_as_a_string():
    config = ModelConfig.from_hf(hf_dict("llama", architectures="Qwen3ForCausalLM"))
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm
    with raises("unsupported architecture", "GemmaForCausalLM"):
        ModelConfig.from_hf(hf_dict("llama", architectures="GemmaForCausalLM"))


def test_unknown_model_type_without_architectures_is_named():
    with raises("unsupported architecture", "gpt2"):
        ModelConfig.from_hf(hf_dict("llama", architectures=None, model_type="gpt2"))


@pytest.mark.parametrize("field", REQUIRED_FIELDS)
def test_missing_required_field_is_named(field):
    cfg = hf_dict("llama")
    del cfg[field]
    with raises("missing", field):
        ModelConfig.from_hf(cfg)


# ---------------------------------------------------------------- end to end


def test_load_refuses_a_saved_config_naming_the_field():
    path = copy_checkpoint("llama")
    edit_config(path, hidden_act="gelu_new")
    with raises("hidden_act", "gelu_new"):
        ts.models.load(path)
    edit_config(path, hidden_act="silu", hidden_size=None)
    with raises("missing", "hidden_size"):
        ts.models.load(path)


def test_load_falls_back_to_model_type():
    path = copy_checkpoint("qwen2")
    edit_config(path, architectures=None)
    model = ts.models.load(path)
    assert model.config.architecture == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_attention_bias_gives_transformers_tokens(model_type):
    """``attention_bias=True`` (biases on q, k, v and o) is implemented, not just accepted."""
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    config = CONFIG_CLASSES[model_type](**SMALL, attention_bias=True, tie_word_embeddings=False)
    hf = randomize(model_cls(config).eval(), seed=3)
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    path = new_tmpdir(f"ts_bias_{model_type}_")
    hf.save_pretrained(path)
    prompts = make_prompts((7, 20), seed=1, vocab=SMALL["vocab_size"])
    llm = ts.LLM(ts.models.load(path), enforce_eager=True, max_model_len=128, page_size=4)
    got = llm.generate(prompts, ts.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, got):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          output_logits=True, return_dict_in_generate=True)
        assert min(float(step[0].topk(2).values.diff().abs()) for step in ref.logits) > 1e-3
        assert list(out.token_ids) == ref.sequences[0, len(prompt):].tolist()
