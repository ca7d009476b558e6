"""Chooses the kernel for a tensor's device: Triton on CUDA, the torch reference elsewhere.

The choice is made per call from the device and, for projections, the row count (a
GEMV up to ``GEMV_MAX_ROWS``), never from tensor values, so eager runs and captured
graphs of the same shapes take the same kernels. Kernels see the cache as flat slots
``[layer, 0 | 1, slot, ...]``.
"""

import torch

from tokenspeed.backends.kernels import reference

GEMV_MAX_ROWS = 16  # up to here a linear layer streams its weight: the split-K GEMV wins


def flat_slots(kv_cache):
    """``[L, 2, pages, P, Hkv, D]`` -> (``[L, 2, pages * P, Hkv, D]`` view, P)."""
    return kv_cache.flatten(2, 3), kv_cache.shape[3]


def write_kv(k, v, kv_cache, layer, slot_mapping):
    flat, _ = flat_slots(kv_cache)
    if flat.is_cuda:
        from tokenspeed.backends.kernels import triton_cache
        return triton_cache.write_kv(k, v, flat, layer, slot_mapping)
    return reference.write_kv(k, v, flat, layer, slot_mapping)


def attention(q, kv_cache, layer, block_tables, row_request, positions, scale):
    flat, page_size = flat_slots(kv_cache)
    if q.is_cuda:
        from tokenspeed.backends.kernels import triton_attention
        return triton_attention.extend_attention(q, flat, layer, block_tables, row_request,
                                                 positions, scale, page_size)
    return reference.paged_attention(q, flat, layer, block_tables, row_request, positions,
                                     scale, page_size)


def decode_attention(q, kv_cache, layer, block_tables, row_request, positions, scale):
    flat, page_size = flat_slots(kv_cache)
    if q.is_cuda:
        from tokenspeed.backends.kernels import triton_decode
        return triton_decode.decode_attention(q, flat, layer, block_tables, row_request,
                                              positions, scale, page_size)
    return reference.paged_attention(q, flat, layer, block_tables, row_request, positions,
                                     scale, page_size)


def rope_decode_attention(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping,
                          block_tables, row_request, scale):
    flat, page_size = flat_slots(kv_cache)
    if q.is_cuda:
        from tokenspeed.backends.kernels import triton_decode
        return triton_decode.rope_decode_attention(q, k, v, cos_sin, positions, flat, layer,
                                                   slot_mapping, block_tables, row_request,
                                                   scale, page_size)
    q_rot = rope_write_kv(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping)
    return reference.paged_attention(q_rot, flat, layer, block_tables, row_request, positions,
                                     scale, page_size)


def silu_and_mul(gate_up):
    if gate_up.is_cuda:
        from tokenspeed.backends.kernels import triton_fused
        return triton_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rms_norm(x, weight, eps):
    if x.is_cuda:
        from tokenspeed.backends.kernels import triton_fused
        return triton_fused.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    if x.is_cuda:
        from tokenspeed.backends.kernels import triton_fused
        return list(triton_fused.add_rms_norm(x, residual, weight, eps))
    total = x + residual
    return [reference.rms_norm(total, weight, eps), total]


def rope_write_kv(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping):
    flat, _ = flat_slots(kv_cache)
    if q.is_cuda:
        from tokenspeed.backends.kernels import triton_fused
        return triton_fused.rope_and_write_kv(q, k, v, cos_sin, positions, flat, layer,
                                              slot_mapping)
    q_rot, k_rot = (reference.rotate(t, cos_sin, positions) for t in (q, k))
    reference.write_kv(k_rot, v, flat, layer, slot_mapping)
    return q_rot


def linear(x, weight, bias):
    if x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS:
        from tokenspeed.backends.kernels import triton_gemv
        return triton_gemv.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def gated_linear(gate_up, weight, bias):
    # one row only: with more, the activation computed between the loads and ``tl.dot``
    # stalls the pipeline (a 1B-shape down projection took 39 us for 8 rows against 12 us
    # unfused on the H200), far more than the activation's own kernel costs
    if gate_up.is_cuda and gate_up.shape[0] == 1:
        from tokenspeed.backends.kernels import triton_gemv
        return triton_gemv.linear(gate_up, weight, bias, gated=True)
    return linear(silu_and_mul(gate_up), weight, bias)


def norm_linear(x, residual, norm_weight, eps, weight, bias):
    # one row only: with more, every GEMV program re-reads all rows for the statistics in a
    # loop that is not pipelined, which cost more than the norm's own kernel on the H200
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1:
        from tokenspeed.backends.kernels import triton_gemv
        out, total = triton_gemv.norm_linear(x, residual, norm_weight, eps, weight, bias)
        return [out] if total is None else [out, total]
    if residual is None:
        return [linear(rms_norm(x, norm_weight, eps), weight, bias)]
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    return [linear(normed, weight, bias), total]
