"""The torch reference of every IR op: what the CPU runs, and the oracle every Triton
kernel is tested against. One function per op, with the op's signature.

Kernels see the cache as flat slots, ``kv_cache[layer, 0 | 1, slot, kv_head, head_dim]``
with ``slot = page * page_size + offset`` (``flat_slots``); page 0 is the null page.
Attention is described per query row, so one formulation serves decode, extend and the
narrowed decoder view: row r belongs to request ``row_request[r]`` and sits at position
``positions[r]``; it attends causally to positions 0..positions[r] of that request (the
last ``window`` of them with a sliding window), found through ``block_tables[row_request[r]]``.
How the CPU computes it, a request's rows at once, is ``torch_attention.py``'s. An FP8
cache stores and reads through the layer's ``k_scale`` and ``v_scale`` (``kv_fp8``).
"""

import torch

from tokenspeed.backends.kernels import (cpu_attention, cpu_blocks, cpu_int4, cpu_int8, gguf_reference, kv_fp8,
                                         mla_reference, moe_reference)
from tokenspeed.backends.kernels.fp8_weights import dequantize
from tokenspeed.backends.kernels.gguf_blocks import block_format
from tokenspeed.backends.kernels.group_route_reference import group_top_k  # noqa: F401  (DeepSeek's routing)
from tokenspeed.backends.kernels.mla_reference import mla_attention, write_latent  # noqa: F401  (MLA's reference)
from tokenspeed.backends.kernels.state_reference import (  # noqa: F401  (recurrent layers' references)
    causal_conv_silu, causal_conv_silu_step, gated_delta_rule, gated_delta_rule_step)
from tokenspeed.backends.kernels.torch_attention import lone_rows_attention, paged_attention
from tokenspeed.ir.rope import apply_rotary
from tokenspeed.ir.weights import BLOCK_FORMATS, DENSE, FP8, INT4, INT8

SLAB_ROWS = 16   # activation rows up to which the CPU's dense linear reads its weight in slabs


def flat_slots(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[L, 2, pages, P, Hkv, D]`` -> (``[L, 2, pages * P, Hkv, D]`` view, P)."""
    return kv_cache.flatten(2, 3), kv_cache.shape[3]


def write_kv(k, v, kv_cache, layer, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    flat, _ = flat_slots(kv_cache)
    scales = kv_fp8.applied(flat.dtype, k_scale, v_scale)
    for i, (x, x_scale) in enumerate(zip((k, v), scales)):
        _put(flat[layer, i], slot_mapping, kv_fp8.stored(x, x_scale, flat.dtype))


def _put(slots: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """``slots[slot_mapping] = values``; float8 through its bytes (the CPU has no float8
    ``index_copy_``)."""
    if slots.element_size() == 1:
        slots, values = slots.view(torch.uint8), values.view(torch.uint8)
    slots.index_copy_(0, slot_mapping, values)


def attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window, k_scale=1.0,
              v_scale=1.0):
    return _attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window, q.shape[0],
                      (k_scale, v_scale))


def extend_attention(q, kv_cache, layer, block_tables, row_request, positions, tiles, scale, window,
                     k_scale=1.0, v_scale=1.0):
    """The rows the tiles cover (the first ``tiles[-1]``); the others, padding, are zero."""
    return _attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window,
                      int(tiles[-1]), (k_scale, v_scale))


def _attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window, num_rows, scales):
    flat, page_size = flat_slots(kv_cache)
    return paged_attention(q, flat[layer], block_tables, row_request, positions, scale, page_size,
                           window, num_rows, kv_fp8.applied(flat.dtype, *scales))


def decode_attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window, k_scale=1.0,
                     v_scale=1.0):
    """One row per request: every row alone in its run (a float32 cache's rows by the CPU's
    C kernel, ``cpu_attention``)."""
    flat, page_size = flat_slots(kv_cache)
    if cpu_attention.reads(q, flat[layer]):
        return cpu_attention.decode_attention(q, flat[layer], block_tables, row_request, positions, scale, page_size,
                                              window)
    return lone_rows_attention(q, flat[layer], block_tables, row_request, positions, scale, page_size, window,
                               kv_fp8.applied(flat.dtype, k_scale, v_scale))


def silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rms_norm(x, weight, eps):
    """Hugging Face's: in float32, the normed row rounded to x's dtype before the weight.
    Float32 rows and weight, where that rounding is none, take torch's own kernel: the same
    products, one op for six (a decode step on the CPU is bound by its small ops)."""
    if x.dtype == weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x, residual, weight, eps):
    total = x + residual
    return [rms_norm(total, weight, eps), total]


def moe(x, w13, w2, topk_weights, topk_ids, shared=None, shared_w13=None, shared_w2=None):
    """The shared experts' weights: their MLP by this module's projections, as their own ops."""
    if shared_w13 is not None:
        shared = gated_linear(linear(x, shared_w13, None), shared_w2, None)
    return moe_reference.moe(x, w13, w2, topk_weights, topk_ids, shared)


def softmax_top_k(logits, k, normalize, scale):
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return [weights * scale, ids]


def route(x, weight, k, normalize, scale, logits_dtype=None, split_counters=None, correction_bias=None, n_group=1,
          topk_group=1, method="greedy"):
    """The ops it stands for (``split_counters`` unread)."""
    return choose(gate_logits(x, weight, logits_dtype, linear), k, normalize, scale, correction_bias, n_group,
                  topk_group, method, softmax_top_k, group_top_k)


def norm_route(x, residual, norm_weight, eps, weight, k, normalize, scale, logits_dtype=None, split_counters=None,
               correction_bias=None, n_group=1, topk_group=1, method="greedy"):
    """The ops it stands for: the norm (with its residual add), then ``route``."""
    norm = [rms_norm(x, norm_weight, eps)] if residual is None else add_rms_norm(x, residual, norm_weight, eps)
    return [*route(norm[0], weight, k, normalize, scale, logits_dtype, None, correction_bias, n_group, topk_group,
                   method), *norm]


def choose(logits, k, normalize, scale, correction_bias, n_group, topk_group, method, softmax_op, group_op):
    """A ``route``'s choice as its own op would make it: ``softmax_op`` (``softmax_top_k``)
    for the greedy method, else ``group_op`` (``group_top_k``), the backend's."""
    if method == "greedy":
        return softmax_op(logits, k, normalize, scale)
    return group_op(logits, correction_bias, k, n_group, topk_group, method, normalize, scale)


def gate_logits(x, weight, logits_dtype, linear_op):
    """A router gate's logits as the model computed them: float32 ones as its ``torch.linear``
    of the cast operands, the others as its ``linear`` op (``linear_op``, the backend's)."""
    if logits_dtype is None:
        return linear_op(x, weight, None)
    return torch.nn.functional.linear(x.to(logits_dtype), weight.to(logits_dtype))


def rope(x, cos_sin, positions, interleaved):
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary(x, cos_sin[positions]).contiguous()


def norm_rope_write_latent(latent, norm_weight, eps, k_rope, cos_sin, positions, interleaved, kv_cache, layer,
                           slot_mapping) -> None:
    rotated = rope(k_rope, cos_sin, positions, interleaved)
    write_latent(rms_norm(latent, norm_weight, eps), rotated.view(-1, rotated.shape[-1]), kv_cache, layer,
                 slot_mapping)


def mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions, kv_b_weight,
                         scale, cos_sin=None, rope_interleaved=False):
    """With ``cos_sin``, q_rope is rotated first (``rope``)."""
    q_rope = q_rope if cos_sin is None else rope(q_rope, cos_sin, positions, rope_interleaved)
    return mla_reference.mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request,
                                              positions, kv_b_weight, scale)


def mla_write_decode_attention(q_nope, q_rope, latent, norm_weight, eps, k_rope, cos_sin, positions,
                               rope_interleaved, kv_cache, layer, slot_mapping, block_tables, row_request,
                               kv_b_weight, scale):
    norm_rope_write_latent(latent, norm_weight, eps, k_rope, cos_sin, positions, rope_interleaved, kv_cache, layer,
                           slot_mapping)
    return mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions, kv_b_weight,
                                scale, cos_sin, rope_interleaved)


def rope_write_kv(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping, k_scale=1.0, v_scale=1.0):
    """Queries and keys rotated together: one rotation's ops instead of two (a decode step
    on the CPU is bound by how many small ops it runs)."""
    rotated = apply_rotary(torch.cat((q, k.to(q.dtype)), dim=1), cos_sin[positions])
    q_rot, k_rot = rotated.split((q.shape[1], k.shape[1]), dim=1)
    write_kv(k_rot.to(k.dtype), v, kv_cache, layer, slot_mapping, k_scale, v_scale)
    return q_rot.contiguous()


def rope_decode_attention(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping,
                          block_tables, row_request, scale, window, k_scale=1.0, v_scale=1.0, q_norm=None,
                          k_norm=None, norm_eps=0.0):
    """On a float32 cache, the CPU's C kernel (``cpu_attention``): rotation, write and
    attention in one call."""
    q = q if q_norm is None else rms_norm(q, q_norm, norm_eps)
    k = k if k_norm is None else rms_norm(k, k_norm, norm_eps)
    flat, page_size = flat_slots(kv_cache)
    if cpu_attention.rope_reads(q, k, v, cos_sin, flat[layer]):
        return cpu_attention.rope_decode_attention(q, k, v, cos_sin, positions, flat[layer], slot_mapping, block_tables,
                                                   row_request, scale, page_size, window)
    q_rot = rope_write_kv(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping, k_scale, v_scale)
    return decode_attention(q_rot, kv_cache, layer, block_tables, row_request, positions, scale, window,
                            k_scale, v_scale)


def linear(x, weight, bias, weight_format=DENSE, weight_scale=None, split_counters=None):
    """A block format's weight by the CPU's block kernels (``cpu_blocks``, the formats they
    read) or else through ``gguf``'s dequantization (``gguf_reference``), an
    FP8 weight times its scales (``fp8_weights.dequantize``), an int4 or int8 weight by
    torch's CPU kernels (``cpu_int4``, ``cpu_int8``). No split K: ``split_counters`` unread."""
    if weight_format == DENSE:
        return _dense_linear(x, weight, bias)
    if weight_format in (INT4, INT8):
        return (cpu_int4 if weight_format == INT4 else cpu_int8).linear(x, weight, weight_scale, bias)
    if weight_format == FP8:
        return torch.nn.functional.linear(x, dequantize(weight, weight_scale, x.dtype), bias)
    fmt = block_format(weight_format)
    if cpu_blocks.reads(fmt, x.device):
        return cpu_blocks.linear(x, weight, fmt, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = gguf_reference.linear(rows, weight, fmt, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _dense_linear(x, weight, bias):
    """``x @ weight.T + bias``; for up to ``SLAB_ROWS`` rows of activations (decode), with
    the weight's rows in one slab per torch thread, one batched product: MKL runs a product
    of few rows on one core, and a decode step is a chain of them over weights larger than
    the caches. On the 2-core machine, a row over a 113 MB head read 26 GB/s this way
    against 15 in one product, and 1.3-1.8x more for 1 to 4 rows of the default model's
    layers (docs/PERFORMANCE.md); more rows are left to MKL's own threads. Each output is
    the same dot product, equal within float32 rounding (tests/test_kernels.py)."""
    slabs, (rows, features) = torch.get_num_threads(), weight.shape
    flat = x if x.dim() == 2 else x.reshape(-1, features)
    if slabs < 2 or rows % slabs or not 0 < flat.shape[0] <= SLAB_ROWS or x.dim() < 2 \
            or x.device.type != "cpu" or not weight.is_contiguous():
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.bmm(flat.expand(slabs, -1, -1), weight.view(slabs, -1, features).transpose(1, 2))
    out = out.transpose(0, 1).reshape(flat.shape[0], rows)
    out = out if x.dim() == 2 else out.view(*x.shape[:-1], rows)
    return out if bias is None else out + bias


def gated_linear(gate_up, weight, bias, weight_format=DENSE, weight_scale=None, split_counters=None):
    """A block weight's activation computed by the CPU's C before its product."""
    if weight_format in BLOCK_FORMATS and cpu_blocks.prepares_input(block_format(weight_format), gate_up):
        return cpu_blocks.gated_linear(gate_up, weight, block_format(weight_format), bias)
    return linear(silu_and_mul(gate_up), weight, bias, weight_format, weight_scale)


def norm_linear(x, residual, norm_weight, eps, weight, bias, weight_format=DENSE, weight_scale=None,
                split_counters=None):
    """A block weight's norm computed by the CPU's C before its product."""
    if weight_format in BLOCK_FORMATS and cpu_blocks.prepares_input(block_format(weight_format), x, residual,
                                                                    norm_weight):
        return cpu_blocks.norm_linear(x, residual, norm_weight, eps, weight, block_format(weight_format), bias)
    if residual is None:
        return [linear(rms_norm(x, norm_weight, eps), weight, bias, weight_format, weight_scale)]
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    return [linear(normed, weight, bias, weight_format, weight_scale), total]


def embedding(ids, weight, weight_format, features, dtype):
    if weight_format == DENSE:
        return weight[ids].to(dtype)
    return gguf_reference.embedding(ids, weight, block_format(weight_format), dtype)
