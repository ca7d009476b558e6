"""The two custom ops the IR is built around.

``tokenspeed::write_kv`` stores a layer's keys and values at their write slots and
``tokenspeed::attention`` attends queries over the paged cache. They are separate ops so
the row-narrowing pass can see the last cache write: keys and values must be computed for
every token row, queries only for the rows that are kept. Both are leaves in the FX
graph; their fake implementations let shape propagation run on fake tensors.

The cache is ``kv_cache[layer, 0 | 1, page, offset, kv_head, head_dim]``: the page size
is part of its shape, so no op needs it as an argument.
"""

import torch

from tokenspeed.backends.kernels import dispatch
from tokenspeed.ir.fused_ops import ROPE_DECODE_ATTENTION


@torch.library.custom_op("tokenspeed::write_kv", mutates_args=("kv_cache",))
def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor) -> None:
    dispatch.write_kv(k, v, kv_cache, layer, slot_mapping)


@write_kv.register_fake
def _write_kv_fake(k, v, kv_cache, layer, slot_mapping):
    return None


@torch.library.custom_op("tokenspeed::attention", mutates_args=())
def attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
              row_request: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    return dispatch.attention(q, kv_cache, layer, block_tables, row_request, positions, scale)


@attention.register_fake
def _attention_fake(q, kv_cache, layer, block_tables, row_request, positions, scale):
    return torch.empty_like(q)


@torch.library.custom_op("tokenspeed::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                     row_request: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """``attention`` restricted to one row per request: what decode lowering selects."""
    return dispatch.decode_attention(q, kv_cache, layer, block_tables, row_request, positions, scale)


@decode_attention.register_fake
def _decode_attention_fake(q, kv_cache, layer, block_tables, row_request, positions, scale):
    return torch.empty_like(q)


@torch.library.custom_op("tokenspeed::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a stacked ``[rows, 2 * I]`` projection (gate first)."""
    return dispatch.silu_and_mul(gate_up)


@silu_and_mul.register_fake
def _silu_and_mul_fake(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


WRITE_KV = torch.ops.tokenspeed.write_kv.default
DECODE_ATTENTION = torch.ops.tokenspeed.decode_attention.default
ATTENTION = torch.ops.tokenspeed.attention.default
ATTENTION_TARGETS = (torch.ops.tokenspeed.attention, ATTENTION, DECODE_ATTENTION,
                     ROPE_DECODE_ATTENTION)
WRITE_KV_TARGETS = (torch.ops.tokenspeed.write_kv, WRITE_KV)
