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
from tokenspeed.models.layer_swap import FROZEN, apply_frozen, quantizable_layers, replace_layer


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

