"""Load a Hugging Face checkpoint directory (config.json + safetensors), or a GGUF file
(read by ``tokenspeed.models.gguf`` as the same Hugging Face tensors), into our model.

Tensors are read straight into freshly allocated parameters (the model is built on the
meta device first, so nothing is initialised twice).
"""

import json
from pathlib import Path

import attrs
import torch
from safetensors import safe_open
from tqdm import tqdm

from tokenspeed.models import gguf as gguf_file
from tokenspeed.models.config import ModelConfig, eos_ids
from tokenspeed.models.llama import STACKED, LlamaForCausalLM, stacked_sizes

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build(config: ModelConfig, dtype=torch.float32, device="cpu") -> LlamaForCausalLM:
    """An uninitialised model: parameters allocated (rotary tables compute themselves)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def read_config(path) -> ModelConfig:
    """config.json, with the end-of-sequence ids of generation_config.json added (as
    transformers' generate stops on those)."""
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face model directory")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    generation = Path(path) / "generation_config.json"
    if generation.exists():
        extra = eos_ids(json.loads(generation.read_text()))
        config = attrs.evolve(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
    return config


def load(path, dtype=None, device="cpu", gguf_reader=None) -> LlamaForCausalLM:
    """A Hugging Face directory, or a ``.gguf`` file (``gguf_reader``: that file already
    opened with ``gguf.GGUFReader``). ``dtype=None`` keeps the directory's
    ``torch_dtype``/``dtype`` (float32 if absent); for GGUF see ``gguf.default_dtype``."""
    if gguf_file.is_gguf(path):
        return _load_gguf(path, dtype, device, gguf_reader)
    config = read_config(path)
    hf = json.loads((Path(path) / "config.json").read_text())
    dtype = dtype or getattr(torch, hf.get("dtype") or hf.get("torch_dtype") or "float32")
    model = build(config, dtype, device)
    _load_tensors(model, safetensors_files(Path(path)))
    return model.eval()


def _load_gguf(path, dtype, device, reader) -> LlamaForCausalLM:
    checkpoint = gguf_file.open_gguf(path, reader)
    model = build(checkpoint.config, dtype or checkpoint.dtype, device)
    load_state_dict(model, checkpoint.tensors())
    return model.eval()


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _load_tensors(model: torch.nn.Module, files: list[Path]) -> None:
    load_state_dict(model, _read(files))


def _read(files: list[Path]):
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_state_dict(model: torch.nn.Module, state) -> None:
    """Load Hugging Face tensors (a dict, or (name, tensor) pairs) into ``model``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unexpected, loaded = [], set()
    pairs = state.items() if isinstance(state, dict) else state
    for name, tensor in tqdm(pairs, desc="loading weights", unit="tensor", disable=None, leave=False):
        if not name.endswith(IGNORED_SUFFIXES):
            _load_one(model, params, name, tensor, loaded, unexpected)
    _check_complete(model, loaded, unexpected)


def _load_one(model, params, name, tensor, loaded: set, unexpected: list) -> None:
    """Copy one checkpoint tensor into its parameter or its slice of a stacked one."""
    if name in params:
        _copy(params[name], tensor, name)
        loaded.add(name)
        return
    for part, (stacked, index) in STACKED.items():
        target = name.replace(f".{part}.", f".{stacked}.")
        if target != name and target in params:
            _copy(params[target].split(stacked_sizes(model.config, stacked))[index], tensor, name)
            loaded.add(f"{target}#{index}")
            return
    unexpected.append(name)


def _check_complete(model, loaded: set, unexpected: list) -> None:
    expected = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        stacked = next((s for s, _ in STACKED.values() if f".{s}." in name), None)
        parts = len(stacked_sizes(model.config, stacked)) if stacked else 0
        expected.update([f"{name}#{i}" for i in range(parts)] if parts else [name])
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(_checkpoint_name(n) for n in expected - loaded - tied)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {model.config.architecture}: "
                         f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def _checkpoint_name(expected: str) -> str:
    """``...qkv_proj.weight#1`` -> ``...k_proj.weight``: name missing tensors as stored."""
    if "#" not in expected:
        return expected
    name, index = expected.split("#")
    part = next(p for p, (s, i) in STACKED.items() if f".{s}." in name and i == int(index))
    stacked = STACKED[part][0]
    return name.replace(f".{stacked}.", f".{part}.")


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"tensor {name}: checkpoint shape {tuple(value.shape)}, "
                         f"model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)
