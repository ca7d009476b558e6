"""The scales of a model's FP8 KV cache: ``kv_scales``, a float32 ``[num_layers, 2]``
tensor (row i: layer i's key scale and value scale), all 1.0 unless set, as vLLM runs a
checkpoint that calibrated none. A pool of float8 stores ``k / k_scale`` and reads back
``stored * k_scale`` (``backends.kernels.kv_fp8``); a pool of the model's dtype ignores
them. A layer that reads another layer's cache (KV sharing) reads it with that layer's
scales.

The model keeps the tensor on the CPU (``LlamaModel.kv_scales``), outside its parameters
and buffers: no dtype cast or device move touches it, and no checkpoint must hold it. The
ops take the values as constants when the model is traced, so scales are set before
``ts.trace`` (``ts.LLM`` traces what it loads): a checkpoint's ``k_scale``/``v_scale``
tensors go in with ``set_kv_scales`` as it is loaded.
"""

import torch


def unit_scales(num_layers: int) -> torch.Tensor:
    return torch.ones(num_layers, 2, dtype=torch.float32, device="cpu")


def layer_scales(scales: torch.Tensor, layer: int) -> dict[str, float]:
    """The keyword arguments of the cache ops of ``layer``'s cache."""
    k_scale, v_scale = scales[layer].tolist()
    return {"k_scale": k_scale, "v_scale": v_scale}


def kv_scales(model) -> torch.Tensor:
    """A copy of ``model``'s scales (a ``LlamaForCausalLM``)."""
    return model.model.kv_scales.clone()


def set_kv_scales(model, scales) -> None:
    """Set every layer's (key, value) scales of ``model`` (a ``LlamaForCausalLM``) from
    ``scales``, ``[num_layers, 2]``, finite and positive; before it is traced."""
    scales = torch.as_tensor(scales, dtype=torch.float32)
    held = model.model.kv_scales
    if scales.shape != held.shape:
        raise ValueError(f"kv_scales of shape {tuple(scales.shape)}: expected [num_layers={held.shape[0]}, 2] "
                         f"(a key and a value scale per layer)")
    bad = (~torch.isfinite(scales) | (scales <= 0)).nonzero()
    if len(bad):
        layer, which = bad[0].tolist()
        raise ValueError(f"kv_scales[{layer}, {which}] = {scales[layer, which].item()}: a "
                         f"{'key' if which == 0 else 'value'} scale must be finite and > 0")
    held.copy_(scales)
