"""Fused ops that decode lowering substitutes for runs of plain ops.

Each has a reference implementation with the plain ops' numerics (the CPU path and the
oracle) and a Triton kernel on CUDA; the fusion passes in ``tokenspeed.passes.fusion``
decide where they go.
"""

import torch

from tokenspeed.backends.kernels import dispatch


@torch.library.custom_op("tokenspeed::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return dispatch.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("tokenspeed::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> list[torch.Tensor]:
    """``[rms_norm(x + residual), x + residual]``: the residual add fused into the norm."""
    return dispatch.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    return [torch.empty_like(x), torch.empty_like(x)]


@torch.library.custom_op("tokenspeed::rope_write_kv", mutates_args=("kv_cache",))
def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q and k, write k and v to the cache; returns the rotated q."""
    return dispatch.rope_write_kv(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping)


@rope_write_kv.register_fake
def _rope_write_kv_fake(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping):
    return torch.empty_like(q)


@torch.library.custom_op("tokenspeed::rope_decode_attention", mutates_args=("kv_cache",))
def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                          layer: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                          row_request: torch.Tensor, scale: float) -> torch.Tensor:
    """``decode_attention(rope_write_kv(...))``: one kernel rotates, writes the row's key and
    value and attends, using that key from registers."""
    return dispatch.rope_decode_attention(q, k, v, cos_sin, positions, kv_cache, layer,
                                          slot_mapping, block_tables, row_request, scale)


@rope_decode_attention.register_fake
def _rope_decode_attention_fake(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping,
                                block_tables, row_request, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


ROPE_DECODE_ATTENTION = torch.ops.tokenspeed.rope_decode_attention.default


@torch.library.custom_op("tokenspeed::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A linear layer whose kernel is chosen by shape: split-K GEMV for few rows on CUDA."""
    return dispatch.linear(x, weight, bias)


@linear.register_fake
def _linear_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("tokenspeed::gated_linear", mutates_args=())
def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(silu(gate) * up)``: the MLP activation read inside the down projection."""
    return dispatch.gated_linear(gate_up, weight, bias)


@gated_linear.register_fake
def _gated_linear_fake(gate_up, weight, bias):
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])


@torch.library.custom_op("tokenspeed::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
    """``[linear(rms_norm(x + residual)), x + residual]`` (``[linear(rms_norm(x))]`` without
    a residual): a norm read inside the projection it feeds."""
    return dispatch.norm_linear(x, residual, norm_weight, eps, weight, bias)


@norm_linear.register_fake
def _norm_linear_fake(x, residual, norm_weight, eps, weight, bias):
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return [out] if residual is None else [out, torch.empty_like(x)]
