"""Linear layers whose weights are integers with bfloat16 scales, for torch's CPU kernels
(``quantization="int4"``): the layers in int4, a scale and zero per 32 inputs
(``Int4Linear``), the output head in int8, a scale per output channel (``Int8Linear``).

The integer weight and its scales are parameters (``weight``, ``weight_scale``) moved with
the model but never cast (``layer_swap.apply_frozen``); the op reads them as the ``INT4``
or ``INT8`` format (quantized by ``ir/integer_weights.py``), which only the CPU's backend
runs (``backends/kernels/cpu_int4.py``, ``cpu_int8.py``). A tied head becomes its own int8
matrix; the embedding keeps its table.
"""

import logging

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.ir.integer_weights import (INT4_N_MULTIPLE, INT8_K_MULTIPLE, int4_fits, int8_fits,
                                           pack_int4, quantize_int4, quantize_int8)
from tokenspeed.ir.weights import INT4, INT4_GROUP, INT8
from tokenspeed.models.layer_swap import FROZEN, HEAD, apply_frozen, quantizable_layers, replace_layer

log = logging.getLogger(__name__)


class _WeightOnlyLinear(nn.Module):
    """``x @ W.T + bias`` with ``W`` stored as ``FORMAT``'s integers and scales."""
    FORMAT = None

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor,
                 weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _apply(self, fn, recurse=True):
        return apply_frozen(self, fn, recurse, FROZEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.FORMAT, self.weight_scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.FORMAT}, bias={self.bias is not None}")


class Int4Linear(_WeightOnlyLinear):
    """Packed int4 ``uint8 [N, K / 2]`` (torch's CPU layout), scales and zeros
    ``bfloat16 [K / 32, N, 2]``."""
    FORMAT = INT4

    @classmethod
    def quantized(cls, dense: nn.Linear) -> "Int4Linear":
        q, scales_zeros = quantize_int4(dense.weight)
        return cls(dense.in_features, dense.out_features, pack_int4(q), scales_zeros, dense.bias)


class Int8Linear(_WeightOnlyLinear):
    """``int8 [N, K]``, scales ``bfloat16 [N]``."""
    FORMAT = INT8

    @classmethod
    def quantized(cls, dense: nn.Linear) -> "Int8Linear":
        q, scale = quantize_int8(dense.weight)
        return cls(dense.in_features, dense.out_features, q, scale, dense.bias)


def quantized_to_int4(model: nn.Module) -> nn.Module:
    """``model`` (on the CPU) with each dense linear layer but the head in int4, as
    ``quantized_to_fp8`` chooses them, and the head in int8. A layer whose shape does not
    pack (``int4_fits``, ``int8_fits``) stays dense, named in one log line."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("quantization='int4' runs on the CPU (torch's int4 CPU kernel); on a GPU "
                         "use 'fp8' or a GGUF file's blocks")
    unfit = []
    for name in quantizable_layers(model, "int4"):
        layer = model.get_submodule(name)
        if int4_fits(layer.out_features, layer.in_features):
            replace_layer(model, name, Int4Linear.quantized)
        else:
            unfit.append(f"{name} [{layer.out_features}, {layer.in_features}]")
    head = model.get_submodule(HEAD)
    if type(head) is nn.Linear and int8_fits(head.in_features):
        replace_layer(model, HEAD, Int8Linear.quantized)
    elif type(head) is nn.Linear:
        unfit.append(f"{HEAD} [{head.out_features}, {head.in_features}]")
    if unfit:
        log.warning("quantization='int4' left %d layers dense (int4: K a multiple of %d and N of %d; "
                    "the int8 head: K a multiple of %d): %s", len(unfit), INT4_GROUP, INT4_N_MULTIPLE,
                    INT8_K_MULTIPLE, ", ".join(unfit))
    return model
