"""The FP8 checkpoint schemes ``quantization_config`` declares, and the refusal of others.

Three ways of writing FP8 checkpoints are common: ``quant_method: "fp8"`` with
``weight_block_size: [128, 128]`` (DeepSeek-V3, Qwen3-FP8: ``weight`` and a
``weight_scale_inv`` per 128 x 128 tile, which multiplies despite its name);
``quant_method: "fp8"`` without blocks (vLLM's serialized FP8: one ``weight_scale`` per
tensor); and ``compressed-tensors`` float8 weights (``weight_scale`` per tensor, per
channel ``[N, 1]`` or per tile). Read apart from the loader so that parsing a config
needs no model code.
"""

import attrs

from tokenspeed.ir.weights import FP8_TILE

SUPPORTED_METHODS = ("fp8", "compressed-tensors (float8 weights)")


@attrs.frozen
class Fp8Scheme:
    """How a checkpoint's FP8 matrices are scaled: per 128 x 128 tile (``tiled``), else
    per tensor or per channel (both read as per channel)."""
    method: str
    tiled: bool


def fp8_scheme(quant) -> Fp8Scheme:
    """The scheme a ``quantization_config`` declares; any other quantization is refused
    with the field and what is supported."""
    if not isinstance(quant, dict):
        raise ValueError(f"config field quantization_config={quant!r} is not valid: expected an object "
                         f"with a quant_method")
    method = quant.get("quant_method")
    if method == "fp8":
        return Fp8Scheme(method, _tiled(quant.get("weight_block_size"), "weight_block_size"))
    if method == "compressed-tensors":
        return Fp8Scheme(method, _compressed_tensors_tiled(quant))
    raise ValueError(f"quantization_config.quant_method={method!r} is not supported; "
                     f"supported: {', '.join(SUPPORTED_METHODS)} (and GGUF files)")


def _tiled(block, field: str) -> bool:
    if block is None:
        return False
    if not isinstance(block, list) or block != [FP8_TILE, FP8_TILE]:
        raise ValueError(f"quantization_config.{field}={block} is not supported; supported: "
                         f"[{FP8_TILE}, {FP8_TILE}] or none")
    return True


def _compressed_tensors_tiled(quant: dict) -> bool:
    """Every config group's weights float8 of one strategy: tensor, channel or block."""
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) and isinstance(g.get("weights") or {}, dict)
                                               for g in groups.values()):
        raise ValueError(f"quantization_config.config_groups={groups!r} is not valid: expected an object "
                         f"of groups, each with a weights object")
    weights = [group.get("weights") or {} for group in groups.values()]
    strategies = {w.get("strategy") for w in weights}
    float8 = all(w.get("num_bits") == 8 and w.get("type") == "float" for w in weights)
    if not weights or not float8 or len(strategies) != 1 or not strategies <= {"tensor", "channel", "block"}:
        raise ValueError(f"compressed-tensors weights {weights} are not supported; supported: 8-bit "
                         f"float weights of one strategy (tensor, channel or block)")
    return _tiled(weights[0].get("block_structure"), "block_structure") if strategies == {"block"} else False


