"""Our layers as a checkpoint's weights fill them, and swapping a layer for one that keeps
its weight in a stored format (GGUF blocks, FP8).

The loader fills a stacked projection (``qkv_proj``, ``gate_up_proj``) from its parts'
weights (``q_proj``...), so a stored format is decided per layer of ours: every part of
it must be stored alike.
"""

import collections

from torch import nn

from tokenspeed.models.stacking import STACKED_LAYERS, stacked_parts, stacked_sizes

EMBEDDING, HEAD = "model.embed_tokens", "lm_head"


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
