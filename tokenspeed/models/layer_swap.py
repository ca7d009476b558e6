"""Our layers as a checkpoint's weights fill them, and swapping a layer for one that keeps
its weight in a stored format (GGUF blocks, FP8, the CPU's int4 and int8): which layers a
quantization at load replaces, and how such a layer moves with the model uncast.

The loader fills a stacked projection (``qkv_proj``, ``gate_up_proj``) from its parts'
weights (``q_proj``...), so a stored format is decided per layer of ours: every part of
it must be stored alike.
"""

import collections

import torch
from torch import nn

from tokenspeed.models.stacking import STACKED_LAYERS, stacked_parts, stacked_sizes

EMBEDDING, HEAD = "model.embed_tokens", "lm_head"
FROZEN = ("weight", "weight_scale")   # a stored format's parameters, never cast


def layer_of(model: nn.Module, name: str) -> tuple[str, int]:
    """As the loader maps a checkpoint weight: the layer of that name if the model has one
    (a KV-shared layer's own ``q_proj``), else the stacked projection it is a slice of,
    with its index there."""
    module = name.removesuffix(".weight")
    base, _, part = module.rpartition(".")
    table = stacked_parts(model.config)
    if layer_module(model, module) is not None or part not in table:
        return module, 0
    stacked, index = table[part]
    return f"{base}.{stacked}", index


def parts_by_layer(model: nn.Module, names) -> dict[str, list[str]]:
    """Our layer -> its checkpoint weights among ``names``, in stacking order."""
    parts = collections.defaultdict(dict)
    for name in names:
        layer, index = layer_of(model, name)
        parts[layer][index] = name
    return {layer: [by_index[i] for i in sorted(by_index)] for layer, by_index in parts.items()}


def layer_module(model: nn.Module, layer: str) -> nn.Module | None:
    """The dense ``nn.Linear``/``nn.Embedding`` named ``layer``, if the model has one."""
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        return None
    return module if isinstance(module, (nn.Linear, nn.Embedding)) else None


def replace_layer(model: nn.Module, layer: str, new) -> None:
    """The module at ``layer`` becomes ``new(old module)``."""
    parent, _, attr = layer.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    setattr(owner, attr, new(getattr(owner, attr)))


def part_sizes(model: nn.Module, layer: str) -> list[int]:
    """The rows of each checkpoint weight ``layer`` is filled from (one part unless stacked)."""
    stacked = layer.rpartition(".")[2]
    if stacked in STACKED_LAYERS:
        return stacked_sizes(model.config, stacked, model.get_submodule(layer).weight.shape[0])
    return [model.get_submodule(layer).weight.shape[0]]


def _moved_not_cast(fn, tensor: torch.Tensor) -> torch.Tensor:
    """``fn(tensor)`` where ``fn`` keeps its dtype (a move, ``to_empty``), else ``tensor``
    moved to the device ``fn`` would put it on."""
    witness = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
    return fn(tensor) if witness.dtype == tensor.dtype else tensor.to(witness.device)


def apply_frozen(module: nn.Module, fn, recurse: bool, names: tuple[str, ...]) -> nn.Module:
    """``nn.Module._apply`` that moves the parameters ``names`` (stored formats) to ``fn``'s
    device but never casts them, while the rest (a bias) follows the model's dtype."""
    frozen = {name: nn.Parameter(_moved_not_cast(fn, module._parameters[name].data), requires_grad=False)
              for name in names}
    for name in names:
        module._parameters[name] = None     # skipped by the cast below, keeping its place
    try:
        return nn.Module._apply(module, fn, recurse)
    finally:
        module._parameters.update(frozen)


def quantizable_layers(model: nn.Module, quantization: str) -> list[str]:
    """The names of ``model``'s dense linear layers but the head, which ``quantization``
    replaces; refused for a model of GGUF blocks (already quantized), a mixture of experts
    (its experts have no kernel for it) and latent attention (which reads its key and value
    projection's weight whole)."""
    from tokenspeed.models.block_layers import BlockLinear
    if any(isinstance(m, BlockLinear) for m in model.modules()):
        raise ValueError(f"quantization={quantization!r} quantizes 16- or 32-bit weights; this model's "
                         "weights are GGUF blocks, already quantized")
    if model.config.moe is not None:
        raise ValueError(f"quantization={quantization!r} quantizes linear layers; {model.config.architecture}'s "
                         f"experts have no {quantization} kernel, so its weights load unquantized only")
    if model.config.mla is not None:   # the latent attention reads kv_b_proj's weight itself, unscaled
        raise ValueError(f"quantization={quantization!r} quantizes linear layers; {model.config.architecture}'s "
                         "latent attention reads its key and value projection's weight whole, so its weights "
                         "load unquantized only")
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and name != "lm_head"]
