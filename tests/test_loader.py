"""Loading Hugging Face checkpoint directories: shards, bad checkpoints, rope settings."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import tokenspeed as ts
from benchmarks import moe_decode
from tokenspeed.models.config import ModelConfig, RopeScaling
from tokenspeed.models import loader
from tokenspeed.models.loader import build
from tokenspeed.models.random import TINY_LLAMA

from hf_models import LLAMA3_ROPE, checkpoint, copy_checkpoint, edit_config, hf_model, \
    make_prompts, new_tmpdir, reference

PROMPTS = make_prompts((1, 6, 30), seed=21)
MAX_TOKENS = 8
GREEDY = ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def generate(path, **llm_kwargs):
    llm = ts.LLM(path, page_size=4, **llm_kwargs)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def single_file(path):
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1 and not (path / "model.safetensors.index.json").exists()
    return files[0]


# ---------------------------------------------------------------- sharded checkpoints


@pytest.fixture(scope="module", params=["llama", "tied", "qwen2"])
def sharded(request):
    variant = request.param
    model, _ = hf_model(variant)
    path = new_tmpdir(f"ts_sharded_{variant}_")
    model.save_pretrained(path, max_shard_size="60KB")
    return variant, path


def test_sharded_checkpoint_has_an_index(sharded):
    _, path = sharded
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((path / s).exists() for s in shards)


def test_sharded_checkpoint_loads_the_same_weights(sharded):
    variant, path = sharded
    whole = ts.models.load(checkpoint(variant)).state_dict()
    parts = ts.models.load(path).state_dict()
    assert whole.keys() == parts.keys()
    for name in whole:
        assert torch.equal(whole[name], parts[name]), name


def test_sharded_checkpoint_gives_hf_tokens(sharded):
    variant, path = sharded
    assert generate(path) == reference(variant, PROMPTS, MAX_TOKENS)


def test_sharded_checkpoint_missing_tensor_in_a_shard(sharded):
    variant, src = sharded
    path = new_tmpdir("ts_sharded_broken_")
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.v_proj.weight"
    shard = path / index["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ts.models.load(path)


# ---------------------------------------------------------------- bad checkpoints


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "GemmaForCausalLM"])
def test_unsupported_architecture_is_named(arch):
    path = copy_checkpoint("llama")
    edit_config(path, architectures=[arch])
    with pytest.raises(ValueError, match=arch):
        ts.models.load(path)
    with pytest.raises(ValueError, match=arch):
        ts.LLM(path)


def test_missing_architectures_field_falls_back_to_model_type():
    path = copy_checkpoint("llama")
    edit_config(path, architectures=None)
    assert ts.models.load(path).config.architecture == "LlamaForCausalLM"
    edit_config(path, model_type=None)
    with pytest.raises(ValueError, match="unsupported architecture .none given, model_type=None"):
        ts.models.load(path)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.norm.weight",
                                  "lm_head.weight", "model.embed_tokens.weight"])
def test_missing_tensor_is_named(name):
    path = copy_checkpoint("llama")
    file = single_file(path)
    tensors = load_file(str(file))
    assert name in tensors
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \[.*" + name.replace(".", r"\.")):
        ts.models.load(path)


def edited_checkpoint(variant, edit):
    """A copy of ``variant``'s checkpoint whose tensors went through ``edit(tensors)``."""
    path = copy_checkpoint(variant)
    file = single_file(path)
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def test_missing_bias_of_qwen2_is_named():
    path = edited_checkpoint("qwen2", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        ts.models.load(path)


def test_unexpected_tensor_is_named():
    path = edited_checkpoint("llama", lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra\.weight"):
        ts.models.load(path)


def test_wrong_shape_is_named():
    path = edited_checkpoint("llama", lambda t: t.update(
        {"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 100)}))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\(64, 100\)"):
        ts.models.load(path)


def test_tied_checkpoint_without_lm_head_loads_tied():
    path = checkpoint("tied")
    model = ts.models.load(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    hf, _ = hf_model("tied")
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def test_missing_config_or_weights():
    empty = new_tmpdir("ts_empty_")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ts.models.load(empty)
    (empty / "config.json").write_text((checkpoint("llama") / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ts.models.load(empty)


def test_dtype_override():
    model = ts.models.load(checkpoint("llama"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert ts.models.load(checkpoint("llama")).model.embed_tokens.weight.dtype == torch.float32


# ---------------------------------------------------------------- rope settings


def test_rope_theta_from_rope_parameters():
    cfg = json.loads((checkpoint("llama") / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 1000.0 and "rope_theta" not in cfg
    assert ts.models.load(checkpoint("llama")).config.rope_theta == 1000.0


def test_rope_theta_top_level_only():
    path = copy_checkpoint("llama")
    edit_config(path, rope_parameters=None, rope_theta=1000.0)
    assert ts.models.load(path).config.rope_theta == 1000.0
    assert ts.models.load(path).config.rope_scaling is None
    assert generate(path) == reference("llama", PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("where", ["rope_parameters", "top_level"])
def test_rope_theta_is_not_ignored(where):
    path = copy_checkpoint("llama")
    if where == "rope_parameters":
        edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 123.0})
    else:
        edit_config(path, rope_parameters=None, rope_theta=123.0)
    assert ts.models.load(path).config.rope_theta == 123.0
    assert generate(path) != reference("llama", PROMPTS, MAX_TOKENS)


def test_rope_theta_default_when_absent():
    path = copy_checkpoint("llama")
    edit_config(path, rope_parameters=None, rope_theta=None)
    assert ts.models.load(path).config.rope_theta == 10000.0


def test_llama3_rope_parameters():
    config = ts.models.load(checkpoint("llama3_rope")).config
    assert config.rope_theta == LLAMA3_ROPE["rope_theta"]
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_llama3_old_style_rope_scaling(type_key):
    """Pre-transformers-5 layout: top-level rope_theta plus a rope_scaling dict."""
    path = copy_checkpoint("llama3_rope")
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_theta", "rope_type")}
    scaling[type_key] = "llama3"
    edit_config(path, rope_parameters=None, rope_theta=LLAMA3_ROPE["rope_theta"],
                rope_scaling=scaling)
    config = ts.models.load(path).config
    assert config.rope_theta == LLAMA3_ROPE["rope_theta"]
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    assert generate(path) == reference("llama3_rope", PROMPTS, MAX_TOKENS)


def test_llama3_scaling_is_not_ignored():
    path = copy_checkpoint("llama3_rope")
    edit_config(path, rope_parameters={"rope_type": "default",
                                       "rope_theta": LLAMA3_ROPE["rope_theta"]})
    assert ts.models.load(path).config.rope_scaling is None
    long_prompts = make_prompts((100,), seed=4)
    llm = ts.LLM(path, page_size=4)
    got = [o.token_ids for o in llm.generate(long_prompts, GREEDY)]
    assert got != reference("llama3_rope", long_prompts, MAX_TOKENS)


def test_unsupported_rope_type_is_named():
    path = copy_checkpoint("llama")
    edit_config(path, rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        ts.models.load(path)


def test_generation_config_eos_ids_are_added():
    path = copy_checkpoint("llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert set(ts.models.load(path).config.eos_token_ids) == {2, 7}


@pytest.mark.parametrize("stored, device, runs", [
    (torch.float32, "cuda", torch.bfloat16), (torch.float32, "cuda:1", torch.bfloat16),
    (torch.float16, "cuda", torch.float16), (torch.bfloat16, "cuda", torch.bfloat16),
    (torch.float32, "cpu", torch.float32), (torch.bfloat16, "cpu", torch.bfloat16)])
def test_dtype_none_runs_float32_checkpoints_in_bfloat16_on_a_gpu_only(stored, device, runs):
    from tokenspeed.models.loader import run_dtype
    assert run_dtype(stored, device) == runs


# ---------------------------------------------------------------- memory while building


class _Allocations(TorchDispatchMode):
    """The (dtype, elements) of every tensor an op creates while the mode is on."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not out.is_meta:
            self.made.append((out.dtype, out.numel()))
        return out


@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_a_bfloat16_model_is_never_allocated_in_float32_first(architecture):
    """A float32 copy first would need twice a 16-bit model's memory: Qwen3-30B-A3B's 57 GiB
    in bfloat16 did not load on an 80 GB card that way."""
    config = ModelConfig.from_hf(TINY_LLAMA if architecture == "llama" else
                                 moe_decode.shape_config("qwen3-30b-a3b", tiny=True))
    with _Allocations() as allocations:
        model = build(config, torch.bfloat16, "cpu")
    largest = max(p.numel() for p in model.parameters())
    assert max(n for dtype, n in allocations.made if dtype == torch.bfloat16) == largest
    assert all(n < largest // 8 for dtype, n in allocations.made if dtype == torch.float32)


def test_a_model_larger_than_the_gpu_is_refused_before_any_of_it_is_allocated(monkeypatch):
    """Refused from the sizes alone: on this CPU-only host, any CUDA allocation would raise
    another error."""
    config = ModelConfig.from_hf({**TINY_LLAMA, "tie_word_embeddings": True})
    held = build(config, torch.bfloat16, "cpu")
    size = sum(t.numel() * t.element_size() for t in [*held.parameters(), *held.buffers()])
    assert held.lm_head.weight is held.model.embed_tokens.weight   # counted once
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (size - 1, 80 * 2**30))
    with pytest.raises(ValueError, match=r"weights take 0.0 GiB; cuda has 0.0 GiB free of 80.0 GiB"):
        build(config, torch.bfloat16, "cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (size, 80 * 2**30))
    loader._check_fits(loader._on_meta(config).to(torch.bfloat16), torch.device("cuda"))  # fits
