"""Hugging Face checkpoints whose matrices are stored in FP8 (e4m3), read as stored.

``fp8_scheme`` reads how the file declares them. A layer keeps FP8 where the file stores its weight in
FP8; its scales become ours: per channel ``[N]`` (a per-tensor scale is repeated over its
rows, which stacks the parts of ``qkv_proj`` exactly) or per tile.

Activations are quantized per token as each step runs (dynamic scales); the static
``input_scale`` such files may hold is not read, and the loader says so once.
"""

import logging

import torch
from torch import nn

from tokenspeed.ir.weights import FP8_TILE
from tokenspeed.models.fp8_layers import Fp8Linear
from tokenspeed.models.fp8_scheme import Fp8Scheme
from tokenspeed.models.layer_swap import layer_module, part_sizes, parts_by_layer, replace_layer

log = logging.getLogger(__name__)
SCALE_NAMES = {"weight_scale_inv": "weight_scale", "weight_scale": "weight_scale"}
UNREAD = ("input_scale",)
# A layer's KV-cache scales as FP8 checkpoints name them (vLLM's, and compressed-tensors'
# outputs of k_proj / v_proj): (key 0 | value 1).
KV_SCALES = {"self_attn.k_scale": 0, "self_attn.v_scale": 1,
             "self_attn.k_proj.output_scale": 0, "self_attn.v_proj.output_scale": 1}


def fp8_layers(model: nn.Module, fp8_weights) -> dict[str, list[str]]:
    """Our linear layers whose every part's weight is among ``fp8_weights`` (checkpoint
    weights stored in FP8) -> those parts; a layer with parts stored both ways is refused."""
    layers = parts_by_layer(model, fp8_weights)
    for layer, names in layers.items():
        if not isinstance(layer_module(model, layer), nn.Linear):
            raise ValueError(f"{names[0]} is stored in FP8 but {layer} is not a linear layer")
        parts = len(part_sizes(model, layer))
        if len(names) != parts:
            raise ValueError(f"{layer}: {len(names)} of its {parts} parts are stored in FP8 "
                             f"({', '.join(names)}); a layer's parts must be stored alike")
    return layers


def swap_fp8_layers(model: nn.Module, layers, scheme: Fp8Scheme) -> nn.Module:
    """``model`` (on the meta device) with each of ``layers`` an ``Fp8Linear``."""
    for layer in layers:
        replace_layer(model, layer, lambda dense, name=layer: _fp8_layer(model, name, dense, scheme))
    return model


def _fp8_layer(model, layer: str, dense: nn.Linear, scheme: Fp8Scheme) -> Fp8Linear:
    sizes = part_sizes(model, layer)
    if scheme.tiled and len(sizes) > 1 and any(n % FP8_TILE for n in sizes):
        raise ValueError(f"{layer} stacks parts of {sizes} rows, but 128 x 128 tile scales stack "
                         f"only parts of whole tiles (multiples of {FP8_TILE} rows)")
    return Fp8Linear(dense.in_features, dense.out_features, scheme.tiled, bias=dense.bias is not None)


def stored_tensors(pairs):
    """The checkpoint's (name, tensor) pairs with scales as our layers hold them
    (``weight_scale_inv`` renamed, ``[N, 1]`` flattened), ``input_scale`` left out."""
    unread = 0
    for name, tensor in pairs:
        base, _, leaf = name.rpartition(".")
        if leaf in UNREAD:
            unread += 1
            continue
        if leaf in SCALE_NAMES:
            yield f"{base}.{SCALE_NAMES[leaf]}", _scales(tensor)
        else:
            yield name, tensor
    if unread:
        log.info("FP8 checkpoint: %d static activation scales (input_scale) not read; "
                 "activations are scaled per token as they run", unread)


def _scales(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.float()
    return tensor.flatten() if tensor.dim() == 2 and tensor.shape[1] == 1 else tensor


def fitted_scale(name: str, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale (one value) repeated over the per-channel scales it fills."""
    if name.endswith(".weight_scale") and value.numel() == 1 and param.dim() == 1:
        return value.reshape(()).expand(param.shape)
    return value


def part_rows(param: torch.Tensor, sizes: list[int]) -> list[int]:
    """How a stacked parameter splits into its parts: by rows, or, for tile scales, by
    tiles of rows."""
    if param.shape[0] == sum(sizes) or any(n % FP8_TILE for n in sizes):
        return sizes
    return [n // FP8_TILE for n in sizes]


def kv_scale_entry(name: str) -> tuple[int, int] | None:
    """(layer, 0 for the key | 1 for the value) of a checkpoint's KV-cache scale, else None."""
    head, _, rest = name.partition("model.layers.")
    layer, _, leaf = rest.partition(".")
    if head or not layer.isdigit() or leaf not in KV_SCALES:
        return None
    return int(layer), KV_SCALES[leaf]
