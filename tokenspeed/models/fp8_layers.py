"""A linear layer whose weight stays FP8 (e4m3) on the device, with its float32 scales.

The weight and its scale are parameters named as checkpoints name them (``weight``,
``weight_scale``), so loading, ties and device moves work as for a dense layer. A dtype
cast of the model (``model.to(torch.bfloat16)``) must not widen them: float8 counts as a
floating-point dtype to ``nn.Module.to``, so the layer moves its weight and scale to the
cast's device only, and casts its bias (activation-typed) as the model is cast.
"""

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.ir.weights import FP8, FP8_TILE, quantize_per_channel
from tokenspeed.models.layer_swap import replace_layer


FROZEN = ("weight", "weight_scale")


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


def scale_shape(out_features: int, in_features: int, tiled: bool) -> tuple[int, ...]:
    """``[N]`` per output channel, or one scale per 128 x 128 tile."""
    if not tiled:
        return (out_features,)
    return (-(-out_features // FP8_TILE), -(-in_features // FP8_TILE))


class Fp8Linear(nn.Module):
    """``x @ (weight * scale).T + bias`` with ``weight`` float8_e4m3fn ``[N, K]``."""

    def __init__(self, in_features: int, out_features: int, tiled: bool = False, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.tiled = in_features, out_features, tiled
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(scale_shape(out_features, in_features, tiled)),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def quantized(cls, dense: nn.Linear) -> "Fp8Linear":
        """``dense`` quantized per output channel (``quantization="fp8"``), on its device."""
        with torch.device("meta"):
            layer = cls(dense.in_features, dense.out_features, bias=dense.bias is not None)
        weight, scale = quantize_per_channel(dense.weight.detach())
        layer.weight, layer.weight_scale = (nn.Parameter(t, requires_grad=False) for t in (weight, scale))
        if dense.bias is not None:
            layer.bias = nn.Parameter(dense.bias.detach().clone(), requires_grad=False)
        return layer

    def _apply(self, fn, recurse=True):
        return apply_frozen(self, fn, recurse, FROZEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, FP8, self.weight_scale)

    def extra_repr(self) -> str:
        scales = "128x128 tiles" if self.tiled else "per channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={FP8} (scales {scales}), bias={self.bias is not None}")


def quantized_to_fp8(model: nn.Module) -> nn.Module:
    """``model`` with each dense linear layer but the output head quantized per output
    channel (as ``vllm --quantization fp8``: the head keeps its dtype, the logits' precision
    is worth its bytes). Layers already FP8 stay; a model of GGUF blocks is refused."""
    for name in quantizable_layers(model, "fp8"):
        replace_layer(model, name, Fp8Linear.quantized)
    return model


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
