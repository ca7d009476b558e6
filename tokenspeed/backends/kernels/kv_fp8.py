"""How a KV pool of float8 (e4m3) stores keys and values: every layer's cache has a key
scale and a value scale, and an element is stored as ``x / scale`` rounded to e4m3,
saturated at +-448 (e4m3 has no infinity: beyond its largest finite value a cast gives
NaN on some devices), and read back as ``stored * scale``. A pool of another dtype
stores values as they are and ignores the scales, as vLLM does with ``kv_cache_dtype``
auto. Scales of 1.0 are vLLM's default for a checkpoint that calibrated none.

Kernels fold the scales into their arithmetic: the key scale into the softmax scale, the
value scale into the output. This module holds the rule the torch reference follows.
"""

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0   # torch.finfo(float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_E4M3


def applied(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a pool of ``cache_dtype`` applies: the given ones for FP8, else none."""
    return (float(k_scale), float(v_scale)) if is_fp8(cache_dtype) else (1.0, 1.0)


def stored(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a pool of ``cache_dtype`` keeps it (quantized from float32 for FP8)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def read(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache elements as float32 values (``scale``: 1.0 for a pool that applies none)."""
    return x.float() if scale == 1.0 else x.float() * scale
