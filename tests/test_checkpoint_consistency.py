"""A checkpoint whose parts disagree, or whose values cannot be right, is refused at load
naming the file and the value; none loads and writes token 0 without complaint. Each case
breaks one thing in a fresh copy of a tiny valid checkpoint (``hf_models``)."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import tokenspeed as ts
from tokenspeed.models.errors import ModelFileError

from hf_models import copy_checkpoint, edit_config, hf_model, new_tmpdir
from test_fp8_models import fp8_file
from test_model_file_errors import contains


def rewrite(path, change):
    """``path``'s model.safetensors with ``change(tensors)`` applied."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


def test_a_tensor_stored_in_two_files_is_refused_naming_both():
    path = copy_checkpoint("llama")
    save_file({"model.norm.weight": torch.full((64,), 5.0)}, str(path / "model_old.safetensors"))
    with pytest.raises(ModelFileError, match=contains("model.norm.weight", "model_old.safetensors",
                                                      "also stored in model.safetensors")):
        ts.models.load(path)


def test_a_shard_holding_another_shards_tensor_is_refused():
    path = new_tmpdir()
    hf_model("llama")[0].save_pretrained(path, max_shard_size="60KB")
    first, second = sorted(path.glob("*.safetensors"))[:2]
    head = load_file(str(first))
    name = next(iter(head))
    tensors = load_file(str(second))
    tensors[name] = torch.zeros_like(head[name])
    save_file(tensors, str(second), metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=contains(name, first.name, second.name)):
        ts.models.load(path)


def test_an_index_naming_a_file_outside_its_directory_is_refused():
    path = copy_checkpoint("llama")
    names = load_file(str(path / "model.safetensors"))
    index = {"weight_map": {name: "../elsewhere/model.safetensors" for name in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=contains("model.safetensors.index.json", "../elsewhere",
                                                      "not file names in its directory")):
        ts.models.load(path)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_directory_in_a_files_place_is_named(name):
    path = copy_checkpoint("llama")
    (path / name).unlink()
    (path / name).mkdir()
    with pytest.raises(ModelFileError, match=contains(path / name, "cannot be read")):
        ts.models.load(path)


@pytest.mark.parametrize("field, value, fragments", [
    ("num_hidden_layers", 10**9, ["num_hidden_layers=1000000000", "hold 2 layers"]),
    ("num_hidden_layers", 3, ["num_hidden_layers=3", "hold 2 layers"]),
    ("vocab_size", 10**8, ["vocab_size=100000000", "embed_tokens.weight", "384 rows"]),
    ("max_position_embeddings", 10**12, ["max_position_embeddings=1000000000000", "<= 16,777,216"]),
])
def test_config_sizes_past_the_checkpoint_are_refused_before_building(field, value, fragments):
    """Refused from the headers at once: built first, these ran the machine out of memory."""
    path = copy_checkpoint("llama")
    edit_config(path, **{field: value})
    start = time.monotonic()
    with pytest.raises(ModelFileError, match=contains(path / "config.json", *fragments)):
        ts.models.load(path)
    assert time.monotonic() - start < 30


LLAMA3 = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes, fragments", [
    ({"rope_scaling": "linear", "rope_parameters": None}, ["rope_scaling='linear'", "an object"]),
    ({"quantization_config": "fp8"}, ["quantization_config='fp8'", "an object"]),
    ({"architectures": {"LlamaForCausalLM": 1}}, ["architectures={'LlamaForCausalLM': 1}", "a list of class names"]),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}, ["weight_block_size=128"]),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": 1}}},
     ["config_groups={'g': 1}", "an object of groups"]),
    ({"rope_parameters": {**LLAMA3, "factor": 0}}, ["rope_parameters.factor=0", ">= 1"]),
    ({"rope_parameters": {**LLAMA3, "factor": "8"}}, ["rope_parameters.factor='8'", "a finite number"]),
    ({"rope_parameters": {**LLAMA3, "factor": -2.0}}, ["rope_parameters.factor=-2.0", ">= 1"]),
    ({"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 0}},
     ["original_max_position_embeddings=0", "an integer >= 1"]),
    ({"rope_parameters": {**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     ["low_freq_factor=4.0", "below high_freq_factor=1.0"]),
])
def test_config_fields_of_the_wrong_kind_are_named(changes, fragments):
    path = copy_checkpoint("llama")
    edit_config(path, **changes)
    with pytest.raises(ModelFileError, match=contains(path / "config.json", *fragments)):
        ts.models.load(path)


def test_a_mixture_with_fewer_experts_than_its_file_is_refused_by_shape():
    path = copy_checkpoint("mixtral")
    edit_config(path, num_local_experts=3)
    with pytest.raises(ModelFileError, match=contains("gate.weight", "(4, 64)", "(3, 64)", "num_experts=3")):
        ts.models.load(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_weight_holding_nan_or_inf_is_refused_naming_it(value):
    path = copy_checkpoint("llama")
    rewrite(path, lambda t: t["model.layers.1.mlp.up_proj.weight"].view(-1).__setitem__(7, value))
    with pytest.raises(ModelFileError, match=contains(path, "model.layers.1.mlp.up_proj.weight",
                                                      "NaN or infinite")):
        ts.models.load(path)


def test_finite_weights_load_in_every_dtype():
    """The check sums in float32: large half-precision weights do not overflow it."""
    path = copy_checkpoint("llama")
    rewrite(path, lambda t: t["model.layers.0.mlp.down_proj.weight"].fill_(60000.0))
    for dtype in ("float16", torch.bfloat16, None):
        assert ts.models.load(path, dtype=dtype) is not None


@pytest.mark.parametrize("scheme, name, value", [
    ("fp8-tensor", "model.layers.0.self_attn.o_proj.weight_scale", float("nan")),
    ("fp8-tensor", "model.layers.0.self_attn.o_proj.weight_scale", -0.5),
    ("fp8-tile", "model.layers.0.mlp.down_proj.weight_scale_inv", float("inf")),
])
def test_an_fp8_scale_that_is_not_finite_and_positive_is_refused(scheme, name, value):
    path, _ = fp8_file(scheme)
    file = rewrite(path, lambda t: t[name].view(-1).__setitem__(0, value))
    with pytest.raises(ModelFileError, match=contains(file, name, str(value), "finite scales >= 0")):
        ts.models.load(path)
