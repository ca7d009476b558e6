"""Chooses the kernel for a tensor's device: Triton on CUDA, the torch reference elsewhere.

The choice is made per call from the device alone, so eager runs and captured graphs
take the same kernels. Kernels see the cache as flat slots ``[layer, 0 | 1, slot, ...]``.
"""

from tokenspeed.backends.kernels import reference


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
        from tokenspeed.backends.kernels import triton_attention
        return triton_attention.decode_attention(q, flat, layer, block_tables, row_request,
                                                 positions, scale, page_size)
    return reference.paged_attention(q, flat, layer, block_tables, row_request, positions,
                                     scale, page_size)
